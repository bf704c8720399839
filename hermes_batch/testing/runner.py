"""Running the ``hermes-batch`` command line in tests, in-process or as a child process, and reading what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import attrs

from ..contract.plugins import DISABLE_ENV
from ..formats import hermes_format
from . import scope
from .scope import UNDER_TEST

TEST_API_KEY = "sk-test-canary-3f9c1d"
"""The key ``Runner`` passes and the ``model_server`` fixture expects; tests check it never reaches a run folder."""


@attrs.define
class Runner:
    """Runs ``hermes-batch run`` against a scripted model server with test defaults.

    ``options`` are added to every run (a plugin's tests put ``--sandbox NAME -S ...``
    there); ``extra`` arguments of a call come after them, so they win.  The run
    folder is ``tmp_path/out/RUN_NAME``.  With ``plugins`` (modules or objects with
    hook implementations), in-process commands see the core's plugins and those
    only, not the installed entry points: a test does not depend on what is installed.
    Without, they see the core's plugins and the installed ``entry_points``: by default
    those of the plugin under test (``hermes_batch.testing.scope``), None for every
    installed plugin; a spawned run too (through HERMES_BATCH_DISABLE_PLUGINS).
    """

    tmp_path: Path
    server: Any = None  # a ScriptedModelServer, or pass server= to each call
    run_name: str = "run"
    options: tuple[str, ...] = ()
    env: dict[str, str] = attrs.Factory(dict)  # added to the environment of spawned runs
    plugins: tuple = ()
    entry_points: Any = UNDER_TEST  # the installed plugins commands see: the plugin under test's, None for all

    def args(self, dataset, *extra: str, server=None, run_name: Optional[str] = None) -> list[str]:
        """The arguments of ``hermes-batch run`` for ``dataset``."""
        server = server or self.server
        base = [
            "run",
            "--dataset_file", str(dataset),
            "--batch_size", "5",
            "--run_name", run_name or self.run_name,
            "--output_dir", str(self.tmp_path / "out"),
            "--model", "scripted-model",
            "--api_key", TEST_API_KEY,
            "--no-progress",
        ]
        if server is not None:
            base += ["--base_url", server.base_url]
            if _resumes(extra) and self._recorded_base_url(run_name) not in (None, server.base_url):
                # Each scripted server listens on a port of its own, so a resume against a fresh one changes
                # --base_url, which a resume refuses; the scripted model is the same, so the change is allowed.
                base.append("--allow_changed_settings")
        return base + list(self.options) + list(extra)

    def _recorded_base_url(self, run_name: Optional[str]) -> Optional[str]:
        try:
            return json.loads((self.folder(run_name) / "run.json").read_text())["config"]["base_url"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def folder(self, run_name: Optional[str] = None) -> Path:
        """The run folder."""
        return self.tmp_path / "out" / (run_name or self.run_name)

    def invoke(self, dataset, *extra: str, server=None, run_name: Optional[str] = None):
        """Run in-process; returns click's Result (``exit_code``, ``output``)."""
        return self.cli(*self.args(dataset, *extra, server=server, run_name=run_name))

    def cli(self, *args: str):
        """Any ``hermes-batch`` command, in-process; returns click's Result."""
        from click.testing import CliRunner

        from hermes_batch import get_plugin_manager
        from hermes_batch.cli import cli

        if self.plugins:
            pm = get_plugin_manager(load_entry_points=False, extra_plugins=self.plugins)
        else:
            pm = None if scope.resolve(self.entry_points) is None else scope.plugin_manager(self.entry_points)
        return CliRunner().invoke(cli, list(args), obj=pm, catch_exceptions=False)

    def spawn(self, dataset, *extra: str, server=None, run_name: Optional[str] = None, env=None, **popen) -> subprocess.Popen:
        """Run as a child process (``python -m hermes_batch``), for signals and SIGKILL; text pipes.

        The child loads the installed plugins of ``entry_points`` (``plugins`` cannot reach it).
        """
        environ = dict(os.environ, PYTHONUNBUFFERED="1", **self.env, **(env or {}))
        left_out = scope.others(self.entry_points)
        if left_out:
            environ[DISABLE_ENV] = ",".join(filter(None, (environ.get(DISABLE_ENV, ""), *left_out)))
        return subprocess.Popen(
            [sys.executable, "-m", "hermes_batch", *self.args(dataset, *extra, server=server, run_name=run_name)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ, **popen,
        )

    def records(self, name: str, run_name: Optional[str] = None) -> list[dict]:
        """The JSON lines of a file of the run folder ([] when it does not exist)."""
        path = self.folder(run_name) / name
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _resumes(args) -> bool:
    for arg in args:
        if arg == "--resume" or (arg.startswith("--resume=") and arg.partition("=")[2].lower() in ("true", "1", "yes")):
            return True
    return False


def tool_outputs(trajectory: dict) -> list[str]:
    """The ``output`` of every terminal result in a trajectory as written to trajectories.jsonl."""
    outputs = []
    for turn in trajectory["conversations"]:
        if turn["from"] != "tool":
            continue
        outputs.extend(payload["content"]["output"] for payload in hermes_format.tool_responses(turn["value"]))
    return outputs
