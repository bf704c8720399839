"""The run folder's record across sessions: completed batches, checkpoint.json, run.json, torn last lines."""

from __future__ import annotations

import collections
import json
import logging
import time
from typing import Optional

import attrs

from .. import __version__
from ..contract import toolsets
from .config import RunConfig
from .plan import RunPlan
from ..session.processor import now_iso
from ..formats.records import Checkpoint, SessionInfo
from ..formats.redaction import Redactor
from ..folder.runfolder import RunFolder, read_records
from ..folder.durable import atomic_write_text, repair_torn_tail
from ..formats.serialization import to_json_line

log = logging.getLogger("hermes_batch.run")


class BatchTracker:
    """Knows when every prompt of a batch dispatched in this session has ended, and how many of them failed.

    A batch is complete once it is ``sealed`` (no prompt of it is still to be dispatched: the scheduler's
    window has handed out its last row, see run/image_order.py) or the jobs ended, and its prompts have.
    ``on_complete(batch, failed)`` is called once per batch.
    """

    def __init__(self, on_complete):
        self.pending: collections.Counter = collections.Counter()
        self.failed: collections.Counter = collections.Counter()
        self.sealed: set[int] = set()
        self.exhausted = False
        self.on_complete = on_complete

    def dispatched(self, batch: int) -> None:
        self.pending[batch] += 1

    def seal(self, batch: int) -> None:
        """No more prompts of ``batch`` will be dispatched in this session."""
        if batch in self.pending:
            self.sealed.add(batch)
            if self.pending[batch] == 0:
                self._complete(batch)

    def hold(self, batch: int) -> None:
        """One more prompt of ``batch`` (a row's next sample) will end before the batch is complete."""
        self.pending[batch] += 1

    def finished(self, batch: int, failed: bool = False) -> None:
        self.pending[batch] -= 1
        self.failed[batch] += failed
        if self.pending[batch] == 0 and (batch in self.sealed or self.exhausted):
            self._complete(batch)

    def end_of_jobs(self) -> None:
        self.exhausted = True
        for batch in [b for b, count in self.pending.items() if count == 0]:
            self._complete(batch)

    def _complete(self, batch: int) -> None:
        del self.pending[batch]
        self.sealed.discard(batch)
        self.on_complete(batch, self.failed.pop(batch, 0))


class Checkpoints:
    """checkpoint.json: the completed batches and counts of the run, one SessionInfo per session.

    A session is the first run or one resume; ``previous`` is the checkpoint
    the earlier sessions left (None for the first).
    """

    def __init__(self, folder: RunFolder, config: RunConfig, previous: Optional[Checkpoint]):
        self.folder = folder
        self.config = config
        self.previous = previous
        self.started = time.monotonic()
        self.started_at = now_iso()
        # complete by this session: its prompts ended, or a resume found every one of them finished
        self.completed_batches: set[int] = set()
        self.previously_finished = 0  # prompts finished before this session (kept or discarded)

    @property
    def session_number(self) -> int:
        """0 for the first session of the run, then 1, 2, ... for each resume."""
        return len(self.previous.sessions) if self.previous else 0

    def renumbered(self) -> None:
        """The records were renumbered (a changed dataset): batch numbers changed meaning, so earlier ones are void."""
        if self.previous is not None:
            self.previous = attrs.evolve(self.previous, completed_batches=())

    def not_complete(self, batches) -> None:
        """``batches`` have prompts left to run (failed, or new rows): earlier sessions' word no longer holds."""
        batches = set(batches)
        if self.previous is not None and batches:
            kept = tuple(b for b in self.previous.completed_batches if b not in batches)
            self.previous = attrs.evolve(self.previous, completed_batches=kept)

    def save(self, counts: collections.Counter, session: SessionInfo) -> Checkpoint:
        """Replace checkpoint.json: this session's ``counts`` (kept, discarded, failed) and ``session`` so far."""
        prev = self.previous
        finished = self.previously_finished + counts["kept"] + counts["discarded"]
        updated = now_iso()
        checkpoint = Checkpoint(
            run_name=self.config.run_name,
            batch_size=self.config.batch_size,
            completed_batches=tuple(sorted(self.completed_batches | set(prev.completed_batches if prev else ()))),
            prompts_finished=finished,
            prompts_failed=counts["failed"],
            sessions=(prev.sessions if prev else ()) + (session,),
            updated_at=updated,
            last_updated=updated,
        )
        atomic_write_text(self.folder.checkpoint, to_json_line(checkpoint))
        return checkpoint


def load_checkpoint(folder: RunFolder) -> Optional[Checkpoint]:
    """The checkpoint earlier sessions left, or None."""
    for _line, checkpoint in read_records(folder.checkpoint, Checkpoint):
        return checkpoint
    return None


def repair_torn_tails(folder: RunFolder) -> None:
    """Cut the torn last line a crash left, in every file a resume reads or appends to."""
    # also in files this session will never append to, so every file parses when the resume ends
    paths = [path for _num, path in folder.iter_batch_files()] + [folder.discarded, folder.failed]
    for path in paths:
        dropped = repair_torn_tail(path)
        if dropped:
            log.warning("%s: dropped %d bytes of a torn last line left by an interrupted write.", path, dropped)


def write_run_json(
    folder: RunFolder, plan: RunPlan, plugins: list[dict], redactor: Redactor, settings_history: list = (),
    sandbox: Optional[dict] = None, excluded_providers: tuple = (),
) -> None:
    """run.json: the configuration (never the API key), the plan's decisions and the plugins' versions.

    ``redactor`` hides any secret of the run that reached a value (an option, a path);
    ``settings_history`` the settings that change what the data means, per session that changed them
    (``run_settings.check_resume``).
    """
    config = plan.config
    data = {
        "schema_version": 1,
        "hermes_batch_version": __version__,
        "seed": plan.seed,
        "config": config.public() | {"seed": plan.seed},
        "model_client": plan.model_client,
        "distribution": {"name": plan.distribution.name, "probabilities": dict(plan.distribution.probabilities)},
        # a resume over a file whose fingerprint differs renumbers the records (reindex.py)
        "dataset": {"path": str(config.dataset_file), "fingerprint": plan.dataset_fingerprint,
                    "lines": plan.dataset.total, "valid": plan.dataset.valid},
        "tools": list(plan.all_tools),
        "toolsets": {
            name: {"options": toolsets.describe_config(options), "left_out": plan.unconfigured.get(name)}
            for name, options in plan.toolset_configs.items()
        },
        "plugins": [{k: p[k] for k in ("name", "distribution", "version")} for p in plugins],
        "settings_history": list(settings_history),
        # the sandbox backend and its isolation level, as its check found them on this machine
        "sandbox": dict(sandbox or {}),
        # the providers the provider guard excluded so far (provider_guard.json holds the test's figures)
        "excluded_providers": list(excluded_providers),
    }
    atomic_write_text(folder.run_json, json.dumps(redactor.data(data), indent=2, default=str) + "\n")
