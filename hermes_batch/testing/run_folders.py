"""Finished run folders with trajectories of every shape, for testing what reads them (exports, filters).

:class:`ShapeScript` makes the scripted model behave as the prompt's leading
``[shape]`` tag says, so one dataset yields kept and discarded records, failed
tool calls, loops, cut-off sessions and planted near-duplicates::

    server = model_server(script=ShapeScript())
    folder = run_shapes(tmp_path, server, ["[ok] a", "[fail] b", "[loop] c"])
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Iterable, Optional, Sequence

from .scripts import Reply, ScriptRequest

SHAPES = ("ok", "fail", "loop", "noreason", "cut", "notool", "empty", "unknown", "dup", "long")
"""ok: two tool calls then an answer; fail: two of three calls fail; loop: one call four times in a row;
noreason: no reasoning (the no-reasoning filter discards it); cut: calls tools until --max_turns; notool: answers at
once; empty: an empty final answer; unknown: calls a tool that was not offered; dup: a long answer that
nearly repeats another dup of the same group (``[dup] G V``: group G, variant V changes one word);
long: a long answer of distinct words."""


def _words(seed: str, count: int) -> list[str]:
    rng = random.Random(hashlib.sha256(seed.encode()).digest())
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(count)]


def shape_of(prompt: str) -> tuple[str, list[str]]:
    """The ``[shape]`` tag of a prompt and the words after it."""
    if prompt.startswith("[") and "]" in prompt:
        tag, rest = prompt[1:].split("]", 1)
        return tag, rest.split()
    return "ok", prompt.split()


def answer_for(prompt: str) -> str:
    """The final answer ShapeScript gives ``prompt`` (for checking exports)."""
    shape, words = shape_of(prompt)
    if shape == "empty":
        return ""
    if shape == "dup":
        group, variant = (words + ["0", "0"])[:2]
        text = _words(f"group {group}", 200)
        if variant != "0":
            text[100] = f"variant{variant}"  # one word of 200: about 95% of the 5-word shingles are shared
        return " ".join(text)
    if shape == "long":
        return " ".join(_words(f"long {prompt}", 200))
    return f"Answer to {prompt}."


class ShapeScript:
    """A script for :class:`~hermes_batch.testing.ScriptedModelServer` driven by the prompt's ``[shape]`` tag."""

    def __call__(self, request: ScriptRequest) -> Reply:
        shape, _words_ = shape_of(request.prompt)
        turn = request.turn
        reasoning = None if shape == "noreason" else f"Thinking about step {turn}."
        key = hashlib.sha256(request.prompt.encode()).hexdigest()[:8]
        calls: Optional[list] = None
        if shape in ("ok", "dup", "long", "empty", "noreason") and turn < 2:
            calls = [("terminal", {"command": f"echo {key}-{turn}"})]
        elif shape == "fail" and turn < 3:
            calls = [("terminal", {"command": "" if turn < 2 else f"echo {key}"})]
        elif shape == "loop" and turn < 4:
            calls = [("terminal", {"command": f"echo {key}"})]
        elif shape == "unknown" and turn < 1:
            calls = [("teleport", {"where": "moon"})]
        elif shape == "cut":
            calls = [("terminal", {"command": f"echo {key}-{turn}"})]
        if calls:
            return Reply(reasoning=reasoning, tool_calls=calls)
        return Reply(content=answer_for(request.prompt), reasoning=reasoning)


def shape_rows(shapes: Iterable[str], copies: int = 1) -> list[dict]:
    """Dataset rows ``{"prompt": "[shape] task N"}``, ``copies`` of each shape."""
    rows = []
    for shape in shapes:
        for n in range(copies):
            rows.append({"prompt": f"[{shape}] task {n}"})
    return rows


def run_cli(*args, ok: bool = True):
    """``hermes-batch ARGS`` in-process (click's runner); with ``ok``, fail unless it exits 0."""
    from click.testing import CliRunner

    from ..cli import cli

    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    if ok and result.exit_code != 0:
        raise AssertionError(f"hermes-batch {' '.join(map(str, args[:2]))} exited with {result.exit_code}:\n{result.output}")
    return result


def read_jsonl(path: Path) -> list:
    """The decoded lines of a JSONL file ([] when it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def batch_records(folder: Path) -> list:
    """The records in the batch files of the run folder ``folder`` so far, while a run may still write them:
    whole lines only (records that end together are written together, and a reader can see half of that)."""
    records = []
    for path in sorted(Path(folder).glob("batch_*.jsonl")):
        text = path.read_text(encoding="utf-8", errors="replace")
        records += [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
    return records


def run_args(dataset: Path, output_dir: Path, run_name: str, base_url: str, api_key: str,
             extra: Sequence[str] = ()) -> list[str]:
    """``hermes-batch run`` arguments for a quick local run against the scripted server."""
    return [
        "run", "--dataset_file", str(dataset), "--batch_size", "4", "--run_name", run_name,
        "--output_dir", str(output_dir), "--model", "scripted-model", "--api_key", api_key,
        "--base_url", base_url, "--max_turns", "5", "--num_workers", "4", "--no-progress",
        "--distribution", "terminal_only", *extra,
    ]


def run_shapes(tmp_path: Path, server, prompts: Sequence, run_name: str = "run", extra: Sequence[str] = ()) -> Path:
    """Run ``prompts`` (strings or row dicts) through ``hermes-batch run`` in-process; return the run folder."""
    from click.testing import CliRunner

    from ..cli import cli
    from .fixtures import TEST_API_KEY

    dataset = tmp_path / f"{run_name}.jsonl"
    with open(dataset, "w", encoding="utf-8") as fh:
        for prompt in prompts:
            fh.write(json.dumps(prompt if isinstance(prompt, dict) else {"prompt": prompt}) + "\n")
    args = run_args(dataset, tmp_path / "out", run_name, server.base_url, TEST_API_KEY, extra)
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    if result.exit_code != 0:
        raise AssertionError(f"the run ended with status {result.exit_code}:\n{result.output}")
    return tmp_path / "out" / run_name
