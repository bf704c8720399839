"""The runner hides its secrets from the processes on its machine, its own sandboxes first.

Two things a local command could read are closed here, for the whole process:

- ``/proc/<runner>/cmdline`` is readable by every user, and ``environ`` by
  the same user: the secret values in the runner's argument and environment
  blocks (``--api_key sk-...``, ``OPENAI_API_KEY=sk-...``) are overwritten in
  place.  Python keeps its own copies (``sys.argv``, ``os.environ``), and the
  variables are set again through ``putenv`` so child processes still inherit
  them; only the original blocks that ``/proc`` shows are blanked.
- The process is made non-dumpable (``PR_SET_DUMPABLE``): its ``/proc`` files
  (``environ``, ``mem``, ``maps``, ``fd``) belong to root and need
  ``CAP_SYS_PTRACE``, so a command of the same user cannot read its memory,
  and it leaves no core dump.  Debuggers then need root to attach.

A command running as root with every capability can still read the runner's
memory; the local sandbox drops those capabilities from root's commands and
gives them a ``/proc`` of their own (see ``local_sandbox.namespace``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Iterable

log = logging.getLogger(__name__)

PR_SET_DUMPABLE = 4


def protect(secrets: Iterable[str]) -> None:
    """Blank ``secrets`` in this process's argument and environment blocks and make it non-dumpable."""
    if not sys.platform.startswith("linux"):
        return
    secrets = [s.encode() for s in secrets if s]
    try:
        _blank(secrets)
    except (OSError, ValueError) as exc:  # an unusual /proc: the redaction of outputs still holds
        log.debug("could not blank the secrets of the runner's command line: %s", exc)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError) as exc:
        log.debug("could not make the runner non-dumpable: %s", exc)


def _blocks() -> list:
    """(start, end) of the argument and the environment blocks, from /proc/self/stat (fields 48 to 51)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    # fields[0] is field 3 of the file (the state)
    arg_start, arg_end, env_start, env_end = (int(v) for v in fields[45:49])
    return [(arg_start, arg_end), (env_start, env_end)]


def _blank(secrets: list) -> None:
    if not secrets:
        return
    hit = False
    for start, end in _blocks():
        if not 0 < start < end:
            continue
        block = ctypes.string_at(start, end - start)
        for secret in secrets:
            position = block.find(secret)
            while position >= 0:
                ctypes.memset(start + position, ord("*"), len(secret))
                hit = True
                position = block.find(secret, position + len(secret))
    if hit:
        # The C environment pointed into the blanked block: point it at copies again, for child processes.
        for name, value in os.environ.items():
            if any(secret in value.encode() for secret in secrets):
                os.putenv(name, value)
