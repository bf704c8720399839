"""Names of our instances: what run, folder, prompt and process each belongs to, so leftovers are found.

An instance has no labels, only a name (at most about 60 characters of
``[a-zA-Z0-9._-]``), so the name carries it all::

    hb-<run, cut to 40>.<run hash 4><folder hash 4>.p<prompt>.<pid>.<session>.<n>

where ``n`` counts the instances of this process (names never repeat in one process).

Apptainer lists instances per user and per machine, so the pid is one of this machine.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from pathlib import Path
from typing import Optional

import attrs
from hermes_batch import SandboxBackend

PREFIX = "hb-"
RUN_CHARS = 40
_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")
_NAME = re.compile(
    r"^hb-(?P<run>.*)\.(?P<run_hash>[0-9a-f]{4})(?P<dir_hash>[0-9a-f]{4})"
    r"\.p(?P<prompt>\d+)\.(?P<pid>\d+)\.(?P<session>[0-9a-f]{4})\.(?P<seq>[0-9a-z]+)$"
)

_SEQUENCE = itertools.count()

# Sessions of this process whose instances are still in use (several runs can share a process in tests).
LIVE_SESSIONS: set[str] = set()


def _hash4(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:4]


def run_hash(run_name: str) -> str:
    return _hash4(run_name)


def folder_hash(run_dir) -> str:
    return _hash4(str(Path(run_dir).resolve()))


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    text = ""
    while True:
        number, digit = divmod(number, 36)
        text = digits[digit] + text
        if not number:
            return text


def instance_name(run_name: str, run_dir, prompt_index: int, session: str) -> str:
    run_part = _UNSAFE.sub("-", run_name)[:RUN_CHARS]
    return (
        f"{PREFIX}{run_part}.{run_hash(run_name)}{folder_hash(run_dir)}"
        f".p{prompt_index}.{os.getpid()}.{session}.{_base36(next(_SEQUENCE))}"
    )


@attrs.frozen
class InstanceName:
    """What an instance's name says about it."""

    name: str
    run_part: str
    run_hash: str
    dir_hash: str
    prompt_index: int
    pid: int
    session: str

    @classmethod
    def parse(cls, name: str) -> Optional["InstanceName"]:
        """None for instances that hermes-batch did not make."""
        match = _NAME.match(name)
        if match is None:
            return None
        return cls(
            name, match["run"], match["run_hash"], match["dir_hash"], int(match["prompt"]), int(match["pid"]), match["session"]
        )

    def of_run(self, run_name: str) -> bool:
        return self.run_hash == run_hash(run_name) and self.run_part == _UNSAFE.sub("-", run_name)[:RUN_CHARS]

    def owner_alive(self) -> bool:
        """Whether the hermes-batch process that started the instance may still be running."""
        return SandboxBackend.owner_alive(self.pid, session=self.session, live_sessions=LIVE_SESSIONS)


def ours(listing: list[dict], run_name: Optional[str] = None) -> list[InstanceName]:
    """The instances of a listing that hermes-batch made, of one run if ``run_name`` is given."""
    found = []
    for item in listing:
        parsed = InstanceName.parse(str(item.get("instance", "")))
        if parsed is not None and (run_name is None or parsed.of_run(run_name)):
            found.append(parsed)
    return found
