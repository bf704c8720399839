"""The run plan: decided before any model call, picklable, and enough to rebuild the prompt processor elsewhere."""

from __future__ import annotations

import asyncio
import json
import pickle
import re
import subprocess
import sys

import pytest

from hermes_batch.run.config import RunConfig
from hermes_batch.formats.dataset import iter_rows
from hermes_batch.errors import HermesBatchError, UsageError
from hermes_batch.contract.interfaces import PromptJob
from hermes_batch.run.plan import build_processor, make_plan
from hermes_batch.contract.plugins import get_plugin_manager
from hermes_batch.contract.run_context import RunContext
from hermes_batch.folder.runfolder import RunFolder
from hermes_batch.formats.serialization import to_json_line
from hermes_batch.testing import TEST_API_KEY, ToolLoopScript, write_dataset

# What a worker in another process does with a pickled plan: rebuild the processor from its own plugins,
# run one prompt job, print the outcome as the run folder would hold it.
WORKER = """
import asyncio, pickle, sys
from hermes_batch import RunContext, build_processor, get_plugin_manager
from hermes_batch.formats.serialization import to_json_line

plan, job, run_dir = pickle.load(sys.stdin.buffer)

async def main():
    run = RunContext(plan.config.run_name, run_dir, plan.seed)
    processor = build_processor(plan, run, get_plugin_manager().registry())
    await processor.start()
    try:
        return await processor.process(job)
    finally:
        await processor.aclose()

sys.stdout.write(to_json_line(asyncio.run(main())))
"""


def config(tmp_path, server, **changes) -> RunConfig:
    rows = [{"prompt": f"Task {i}", "id": i} for i in range(3)]
    return RunConfig(**{
        "dataset_file": write_dataset(tmp_path / "prompts.jsonl", rows), "batch_size": 2, "run_name": "planned",
        "output_dir": tmp_path / "out", "base_url": server.base_url, "model": "scripted-model",
        "api_key": TEST_API_KEY, "distribution": "terminal_only", "seed": 11, "sandbox_options": {"keep": True},
        **changes,
    })


def plan_of(cfg):
    registry = get_plugin_manager().registry()
    plan, _runtimes = make_plan(cfg, registry, RunFolder(cfg.output_dir, cfg.run_name))
    return plan


def test_the_plan_holds_the_decisions_of_the_run(tmp_path, model_server):
    plan = plan_of(config(tmp_path, model_server(), filters=("no-reasoning",), max_concurrent_requests=7))
    assert (plan.seed, plan.distribution.name, plan.toolsets, plan.sandbox) == (11, "terminal_only", ("file", "terminal"), "local")
    assert plan.tools["terminal"] == ("terminal",) and "terminal" in plan.all_tools
    assert (plan.filters, plan.writers, plan.executor, plan.model_client) == (("no-reasoning",), ("jsonl",), "local", "openai")
    assert (plan.dataset.valid, plan.dataset.invalid) == (3, 0)
    assert (plan.model.max_concurrent_requests, plan.agent.max_turns) == (7, 10)


def test_the_plan_keeps_filter_and_writer_specs_with_their_options(tmp_path, model_server):
    server = model_server()
    plan = plan_of(config(tmp_path, server, filters=("no-reasoning:0.5",), writers=("jsonl", "openai:reasoning=drop")))
    assert (plan.filters, plan.writers) == (("no-reasoning:0.5",), ("jsonl", "openai:reasoning=drop"))
    assert plan_of(config(tmp_path, server)).filters == ("no-reasoning", "hallucinated-tools", "empty-answer")  # named
    with pytest.raises(HermesBatchError, match="Invalid options for the filter no-reasoning"):
        plan_of(config(tmp_path, server, filters=("no-reasoning:nope",)))  # refused before anything is sent


def test_the_plan_survives_pickling_unchanged(tmp_path, model_server):
    plan = plan_of(config(tmp_path, model_server()))
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_planning_refuses_before_anything_is_sent(tmp_path, model_server):
    server = model_server()
    with pytest.raises(UsageError, match="Unknown --sandbox 'nowhere'; installed: .*local"):
        plan_of(config(tmp_path, server, sandbox="nowhere"))
    assert server.request_count == 0


async def _process_here(plan, job, run_dir):
    processor = build_processor(plan, RunContext(plan.config.run_name, run_dir, plan.seed), get_plugin_manager().registry())
    await processor.start()
    try:
        return await processor.process(job)
    finally:
        await processor.aclose()


def _comparable(line: str) -> dict:
    record = json.loads(re.sub(r"call_hb\d+", "call_id", line))  # the server numbers tool calls across requests
    for key in ("timestamp", "duration_s", "calls"):  # when and how long, not what
        record["metadata"].pop(key)
    return record


def test_a_process_given_the_pickled_plan_processes_a_prompt_as_the_runner_would(tmp_path, model_server):
    server = model_server(ToolLoopScript(tool_calls=2, command="echo {prompt_hash}-{turn}"))
    plan = plan_of(config(tmp_path, server))
    row = next(iter_rows(plan.config.dataset_file))
    job = PromptJob(row, 0, plan.toolsets)

    here = to_json_line(asyncio.run(_process_here(plan, job, tmp_path / "here")))
    worker = subprocess.run([sys.executable, "-c", WORKER], input=pickle.dumps((plan, job, tmp_path / "there")),
                            capture_output=True, timeout=120)
    assert worker.returncode == 0, worker.stderr.decode()
    there = worker.stdout.decode()

    assert json.loads(there)["completed"] is True
    assert _comparable(there) == _comparable(here)
    assert TEST_API_KEY not in here
