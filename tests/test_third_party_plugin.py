"""A third party's distribution, built and installed from a temporary folder, works as the first-party ones do.

``tests/third_party/hermes-batch-blockbox`` was written against the public API
and docs/plugins.md alone: a filter, a toolset, a writer, a distribution and
``blockbox``, a sandbox backend made of the public building blocks
(``SandboxFolder``, ``run_command``, ``ChildProcess``) in under 100 lines.  It is
built and installed into a fresh virtual environment layered over this one,
passes ``SandboxContract`` there, and runs a batch against the scripted model server.
"""

from __future__ import annotations

import csv
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

import hermes_batch
from hermes_batch.testing import TEST_API_KEY, Reply, ScriptedModelServer, read_jsonl, write_dataset

DIST = Path(__file__).parent / "third_party" / "hermes-batch-blockbox"
BACKEND = DIST / "src" / "hermes_batch_blockbox" / "backend.py"
# The namespace's first process, as its commands see it in /proc/1/cmdline: one namespace for all of them.
INIT_MARK = "echo ready; while"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the python of a fresh virtual environment with the distribution installed, its source folder)."""
    tmp = tmp_path_factory.mktemp("third-party")
    source = shutil.copytree(DIST, tmp / "hermes-batch-blockbox", ignore=shutil.ignore_patterns("*.egg-info", "build"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # This environment (hermes-batch, pip, setuptools, pytest) seen from the new one, as --system-site-packages
    # would show a system's; what is installed there goes into the new one only.
    tested = str(Path(hermes_batch.__file__).resolve().parent.parent)  # the hermes-batch under test
    lines = "; ".join(f"site.addsitedir({path!r})" for path in [tested, *site.getsitepackages()])
    Path(purelib, "_hermes_batch_tests.pth").write_text(f"import site; {lines}\n")
    built = subprocess.run(
        [python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", str(source)],
        capture_output=True, text=True,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    where = subprocess.run([python, "-c", "import hermes_batch_blockbox; print(hermes_batch_blockbox.__file__)"],
                           check=True, capture_output=True, text=True, cwd=tmp).stdout
    assert where.startswith(str(venv)), where  # the installed copy, not the source
    return python, source


def test_the_backend_is_made_of_the_building_blocks_in_under_100_lines():
    text = BACKEND.read_text()
    assert len(text.splitlines()) < 100
    for block in ("SandboxFolder", "run_command", "ChildProcess"):
        assert block in text
    assert "from hermes_batch import" in text and "hermes_batch." not in text  # the public API only


def test_the_installed_plugins_are_listed(installed):
    python, _ = installed
    for command, name in (("sandboxes", "blockbox"), ("filters", "needs-tool-calls"), ("writers", "turns-csv"),
                          ("toolsets", "shouting")):
        listed = subprocess.run([python, "-m", "hermes_batch", command], capture_output=True, text=True)
        assert listed.returncode == 0 and name in listed.stdout, (command, listed.stdout, listed.stderr)


def test_the_backend_passes_the_sandbox_contract(installed):
    python, source = installed
    done = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "tests"],
        cwd=source, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    # skipped: only the ten boundary classes blockbox declares not applicable (plain processes, no boundary)
    assert " passed, 15 skipped" in done.stdout and "failed" not in done.stdout, done.stdout


def script(request) -> Reply:
    if request.prompt == "nothing to do":
        return Reply(content="Nothing to do.")
    if request.turn == 0:
        return Reply(tool_calls=[
            ("shout", {"text": request.prompt}),
            ("terminal", {"command": "echo made > made.txt && cat made.txt && tr '\\0' ' ' < /proc/1/cmdline"}),
        ])
    return Reply(content=f"Done: {request.tool_results[0]}")


def test_a_batch_runs_with_the_plugins(installed, tmp_path):
    python, _ = installed
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": "hello"}, {"prompt": "nothing to do"},
                                                      {"prompt": "good bye"}])
    with ScriptedModelServer(script, api_key=TEST_API_KEY) as server:
        done = subprocess.run(
            [python, "-m", "hermes_batch", "run", "--dataset_file", dataset, "--batch_size", "2", "--run_name", "run",
             "--output_dir", tmp_path / "out", "--model", "scripted-model", "--api_key", TEST_API_KEY,
             "--base_url", server.base_url, "--max_turns", "4", "--num_workers", "3", "--no-progress",
             "--distribution", "blockbox", "--sandbox", "blockbox", "--filter", "needs-tool-calls",
             "--writer", "jsonl", "--writer", "turns-csv"],
            capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    run = tmp_path / "out" / "run"
    kept = read_jsonl(run / "trajectories.jsonl")
    assert [record["prompt_index"] for record in kept] == [0, 2]
    for record, prompt in zip(kept, ("hello", "good bye")):
        results = [turn["value"] for turn in record["conversations"] if turn["from"] == "tool"]
        text = "\n".join(results)
        assert prompt.upper() in text  # the toolset's function
        assert "made" in text and INIT_MARK in text  # the terminal, in the backend's namespace
    discarded = read_jsonl(run / "discarded.jsonl")
    assert [(record["trajectory"]["prompt_index"], record["filters"]) for record in discarded] == [
        (1, ["needs-tool-calls"])
    ]
    with open(run / "turns.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [row["prompt_index"] for row in rows] == ["0", "2"]
    assert rows[0]["answer"].startswith("Done:")
