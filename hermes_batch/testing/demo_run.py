"""A small, varied run made against the scripted model server: kept, discarded and failed prompts.

The report and viewer tests, the README's screenshots and the viewer benchmark
all look at a run like this one, so it has a bit of everything: tool calls
that succeed and fail, a prompt without reasoning (discarded by
``no-reasoning``), a hallucinated tool (discarded by ``hallucinated-tools``),
a prompt that hits ``--max_turns``, and one whose model calls always fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from .scripts import Reply, RoutedScript, ScriptRequest, ToolLoopScript
from .server import ErrorRule, ScriptedModelServer

DEMO_API_KEY = "sk-demo-run-0000"

NO_REASONING = "Say hello without thinking about it."
HALLUCINATED = "Use the teleport tool to fetch the file."
FAILING = "This prompt always meets a broken provider."
LOOPING = "Keep listing files forever."
FAILING_TOOL = "Read the file that does not exist."

# prompts that end kept: one or more terminal calls, then an answer
KEPT_PROMPTS = (
    "Count the lines of a small file and report the number.",
    "Print the current date in ISO format.",
    "Write hello to a file and read it back.",
    "Compute 6 times 7 with the shell.",
    "List the environment variables that start with HOME.",
    "Make a folder called reports and show that it exists.",
)

DEMO_PROMPTS = KEPT_PROMPTS + (NO_REASONING, HALLUCINATED, FAILING, LOOPING, FAILING_TOOL)


def _hallucinate(request: ScriptRequest) -> Reply:
    if request.turn == 0:
        return Reply(reasoning="The teleport tool should do it.", tool_calls=[("teleport", {"target": "file.txt"})])
    return Reply(reasoning="That tool does not exist; I will answer anyway.", content="I could not teleport the file.")


def _failing_tool(request: ScriptRequest) -> Reply:
    if request.turn == 0:
        return Reply(reasoning="Let me read it.", tool_calls=[("terminal", {"command": "cat /nonexistent/file.txt"})])
    return Reply(reasoning="The file is missing.", content="The file does not exist.")


def demo_script() -> RoutedScript:
    """The script of the demo run: each demo prompt gets its own behaviour."""
    routes = {
        NO_REASONING: ToolLoopScript(tool_calls=0, reasoning=None, final="Hello!"),
        HALLUCINATED: _hallucinate,
        LOOPING: ToolLoopScript(tool_calls=100, command="ls -la"),
        FAILING_TOOL: _failing_tool,
    }
    for i, prompt in enumerate(KEPT_PROMPTS):
        routes[prompt] = ToolLoopScript(tool_calls=1 + i % 3, command="echo step-{turn}-{prompt_hash}",
                                        final="Finished after {tool_calls} commands: {last_result}")
    return RoutedScript(routes)


def demo_server(**options) -> ScriptedModelServer:
    """A scripted server for the demo run (not started); FAILING always gets a 503."""
    errors = [ErrorRule(status=503, rate=1.0, match=lambda r: r.prompt == FAILING,
                        message="The provider is overloaded.")]
    return ScriptedModelServer(demo_script(), errors=errors, api_key=DEMO_API_KEY, **options)


def write_demo_dataset(path: Path, prompts: Sequence[str] = DEMO_PROMPTS) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, prompt in enumerate(prompts):
            f.write(json.dumps({"prompt": prompt, "id": f"demo-{i}"}) + "\n")
    return path


def run_args(dataset: Path, output_dir: Path, base_url: str, run_name: str = "demo", *extra: str) -> list[str]:
    """Arguments of ``hermes-batch run`` for the demo run."""
    return [
        "run", "--dataset_file", str(dataset), "--batch_size", "4", "--run_name", run_name,
        "--output_dir", str(output_dir), "--model", "scripted-model", "--api_key", DEMO_API_KEY,
        "--base_url", base_url, "--distribution", "terminal_only", "--max_turns", "4",
        "--max_retries", "1", "--seed", "7", "--no-progress", *extra,
    ]


def make_demo_run(output_dir: Path, run_name: str = "demo", *extra: str) -> Path:
    """Run the demo dataset through ``hermes-batch run`` (a child process; the server runs here); return the run folder."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    dataset = write_demo_dataset(output_dir / f"{run_name}-prompts.jsonl")
    with demo_server() as server:
        # a child process, so that a caller's running event loop (Playwright's sync API has one) is no obstacle
        proc = subprocess.run([sys.executable, "-m", "hermes_batch",
                               *run_args(dataset, output_dir, server.base_url, run_name, *extra)],
                              capture_output=True, text=True)
    if proc.returncode not in (0, 3):  # 3: the prompt meant to fail failed
        raise RuntimeError(f"the demo run exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return output_dir / run_name
