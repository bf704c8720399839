"""The asyncio engine: observers, scheduling per prompt, concurrency, the thread pool."""

import asyncio
import time
from pathlib import Path

import hermes_batch
from hermes_batch.run.config import RunConfig
from hermes_batch.contract.plugins import get_plugin_manager
from hermes_batch.run.runner import RunEngine
from hermes_batch.testing import RoutedScript, ToolLoopScript

from hermes_batch.testing import TEST_API_KEY as API_KEY, write_dataset


class Observer:
    """A throwaway plugin recording what the observer hooks see."""

    def __init__(self):
        self.events = []
        self.finished_indexes = []
        self.pool_size = None

    @hermes_batch.hookimpl
    def run_started(self, run):
        self.pool_size = run.thread_pool._max_workers
        self.events.append(("start", run.run_name))

    @hermes_batch.hookimpl
    def prompt_finished(self, run, outcome):
        self.events.append(("finished", type(outcome).__name__))
        self.finished_indexes.append(getattr(outcome, "trajectory", outcome).prompt_index)

    @hermes_batch.hookimpl
    def run_finished(self, run, statistics):
        self.events.append(("end", statistics["prompts"]["finished"]))


def run_api(tmp_path: Path, server, rows, observer=None, **options):
    """Run through the Python API (RunEngine), the way the CLI does, with an optional extra plugin."""
    config = RunConfig(
        dataset_file=write_dataset(tmp_path / "prompts.jsonl", rows),
        batch_size=options.pop("batch_size", 10),
        run_name=options.pop("run_name", "engine"),
        base_url=server.base_url,
        model="scripted-model",
        api_key=API_KEY,
        output_dir=tmp_path / "out",
        distribution="terminal_only",
        progress=False,
        **options,
    )
    pm = get_plugin_manager(extra_plugins=[observer] if observer else ())
    run = RunEngine(config, pm)
    run.prepare()
    started = time.monotonic()
    result = asyncio.run(run.execute())
    return result, time.monotonic() - started


def test_observers_see_the_run(tmp_path, model_server):
    server = model_server(RoutedScript({"no reasoning": ToolLoopScript(tool_calls=0, reasoning=None)},
                                       default=ToolLoopScript(tool_calls=1)))
    observer = Observer()
    rows = [{"prompt": f"p{i}"} for i in range(4)] + [{"prompt": "no reasoning"}]
    result, _ = run_api(tmp_path, server, rows, observer, num_workers=3)
    assert result.exit_code == 0
    assert observer.events[0] == ("start", "engine")
    finished = [kind for event, kind in observer.events if event == "finished"]
    assert sorted(finished) == ["Discarded"] + ["Trajectory"] * 4
    assert observer.events[-1] == ("end", 5)
    assert observer.pool_size >= 3  # blocking calls get a pool sized to the concurrency


def test_a_slow_prompt_never_holds_up_the_others(tmp_path, model_server):
    server = model_server(ToolLoopScript(tool_calls=0), latency=lambda req: 3.0 if req.prompt == "slow" else 0.05)
    rows = [{"prompt": "slow"}] + [{"prompt": f"fast {i}"} for i in range(20)]
    observer = Observer()
    result, wall = run_api(tmp_path, server, rows, observer, num_workers=4, batch_size=100)
    assert result.exit_code == 0
    # 20 fast prompts on the 3 other slots take ~0.4 s idle (under 3 s on a machine loaded ten times over);
    # they all end before the slow one.
    assert len(observer.finished_indexes) == 21
    assert observer.finished_indexes[-1] == 0
    assert wall < 3.0 + 4
    assert server.calls_for("slow") == 1


def test_hundreds_of_sessions_at_once(tmp_path, model_server):
    server = model_server(ToolLoopScript(tool_calls=1, command="echo {prompt_hash}"), latency=0.5)
    rows = [{"prompt": f"task {i}"} for i in range(300)]
    result, wall = run_api(tmp_path, server, rows, num_workers=300, batch_size=50)
    assert result.exit_code == 0
    assert result.statistics["prompts"]["kept"] == 300
    # 2 model calls at 0.5 s each: about 1.5 s with the preflight if the 300 sessions really run together,
    # 300 s if they ran one after another; the bound leaves room for a loaded machine.
    assert wall < 20, wall
