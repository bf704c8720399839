"""Per-process limits a large run meets: open files and threads, checked before any model call.

Each prompt in flight holds a connection to the model endpoint and, while a
command runs, the pipe of its output (a few more descriptors for the moment
the command is spawned), and its command is a process with a thread waiting
for it.  With the common default of 1024 open files, ``--num_workers 1000``
would fail half its prompts with EMFILE after their first model call was paid.
So at start the soft limits are raised to the hard limits, and where the run
still cannot have what its concurrency needs it runs fewer prompts at a time,
with a warning saying which ``ulimit`` gives it all.  The disk is checked too, before any prompt is
leased: ``space_needed`` is what the records of the prompts that run at once take.
"""

from __future__ import annotations

import logging
import os
import resource
from typing import Callable, Optional

import attrs

from ..errors import UsageError
from ..folder import durable
from ..folder.runfolder import RunFolder

log = logging.getLogger(__name__)

FILES_PER_PROMPT = 10
"""Descriptors one prompt in flight may hold: its model connection; with the local sandbox, its namespace's
pipe and the pidfd of its first process, its command's output pipe and pidfd; spawning (the pipe's other end
and subprocess's error pipe); its NAT program's pidfd and the pipe whose end stops it."""

FILES_BASE = 96
"""Descriptors of the run itself: run-folder files, the event loop, the SDKs' pools, standard streams, and the
local sandbox's NAT programs being started (a few at a time, each with its namespaces and two pipes)."""

TASKS_PER_PROMPT = 4
"""Threads and processes one prompt in flight may hold: the shell, its command, the thread waiting for it, and
the local sandbox's NAT program."""

TASKS_BASE = 64
"""Threads of the run itself: thread pools, the run folder's writers."""


@attrs.frozen
class Fit:
    """How many prompts may run at once, and why fewer than asked (empty when all fit)."""

    concurrency: int
    reasons: tuple = ()


def raise_soft_limit(which: int) -> tuple[int, int]:
    """Raise the soft limit ``which`` to its hard limit where allowed; return the (soft, hard) in force."""
    soft, hard = resource.getrlimit(which)
    if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(which, (hard, hard))
        except (ValueError, OSError):  # e.g. a hard limit above what the kernel allows for this process
            log.debug("could not raise the soft limit %d to %d", which, hard)
        soft, hard = resource.getrlimit(which)
    return soft, hard


def open_files() -> int:
    """Descriptors this process has open now."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 16


def user_tasks(uid: int) -> int:
    """Threads of every process of ``uid`` (what RLIMIT_NPROC counts)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total


def fit_concurrency(
    num_workers: int,
    *,
    files_reserved: int = 0,
    raise_limit: Callable[[int], tuple] = raise_soft_limit,
    files_open: Optional[Callable[[], int]] = None,
    tasks_in_use: Optional[Callable[[int], int]] = None,
    euid: Optional[int] = None,
) -> Fit:
    """Raise the soft limits, then the number of prompts (at most ``num_workers``) the limits allow at once.

    ``files_reserved``: descriptors the run's toolsets hold whatever the number of prompts
    (``ToolsetRuntime.files_needed``).  Raises UsageError when not even one prompt fits.
    The other keyword arguments exist for tests.
    """
    files_open = files_open or open_files
    tasks_in_use = tasks_in_use or user_tasks
    euid = os.geteuid() if euid is None else euid
    fit, reasons = num_workers, []

    soft, _hard = raise_limit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        spare = soft - files_open() - FILES_BASE - files_reserved
        if spare < FILES_PER_PROMPT * num_workers:
            fit = min(fit, spare // FILES_PER_PROMPT)
            need = files_open() + FILES_BASE + files_reserved + FILES_PER_PROMPT * num_workers
            reasons.append(("open files", soft, f"ulimit -n {_round_up(need)}"))

    soft, _hard = raise_limit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and euid != 0:  # the kernel does not hold root to RLIMIT_NPROC
        uid = os.getuid()
        spare = soft - tasks_in_use(uid) - TASKS_BASE
        if spare < TASKS_PER_PROMPT * num_workers:
            fit = min(fit, spare // TASKS_PER_PROMPT)
            need = tasks_in_use(uid) + TASKS_BASE + TASKS_PER_PROMPT * num_workers
            reasons.append(("threads and processes", soft, f"ulimit -u {_round_up(need)}"))

    if fit < 1:
        names = " and ".join(f"{what} (limit {limit})" for what, limit, _fix in reasons)
        fixes = " and ".join(fix for _what, _limit, fix in reasons)
        raise UsageError(f"This process may not have enough {names} to run even one prompt; run '{fixes}' first.")
    return Fit(fit, tuple(reasons))


def describe(num_workers: int, fit: Fit) -> str:
    """The warning for a run that has to run fewer prompts at once than ``--num_workers``."""
    names = " and ".join(f"{what} (limit {limit})" for what, limit, _fix in fit.reasons)
    fixes = " and ".join(fix for _what, _limit, fix in fit.reasons)
    return (
        f"--num_workers {num_workers} needs more {names} than this process may have, so {fit.concurrency} prompts "
        f"run at a time instead; run '{fixes}' before hermes-batch to run them all at once."
    )


def space_needed(folder: RunFolder, finished: int, concurrency: int, to_run: int) -> int:
    """Bytes the records of the prompts that run at once take: as big as this run's records so far."""
    written = sum(path.stat().st_size for _num, path in folder.iter_batch_files())
    if folder.discarded.exists():
        written += folder.discarded.stat().st_size
    per_record = written // finished if finished and written else durable.RECORD_BYTES
    return min(concurrency, to_run) * per_record


def _round_up(value: int) -> int:
    """What to suggest for a limit ``value`` needs: a quarter more, rounded up to a multiple of 1024."""
    return -(-(value + value // 4) // 1024) * 1024
