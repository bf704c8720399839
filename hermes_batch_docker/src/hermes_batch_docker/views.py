"""``-S reuse=namespace``: a container serves prompts one after another, each in a view of its own.

Creating, starting and removing a container costs the engine about 230 ms of
CPU per prompt (dockerd, containerd and the shim), the bound of a run on few
cores.  In this mode a container (per image) is made once and serves one
prompt at a time: each prompt's command runner is one exec of hermes-batch's
static namespace helper (``namespace_view.h`` in hermes_batch's local
sandbox), bind-mounted read-only into the container, which makes new mount,
PID, IPC and UTS namespaces (and, with ``-S network=none``, a network
namespace of its own) and in them a fresh view of the image's files: an
overlay whose lower layer is the container's root, which nothing writes, and
whose upper layer is a memory file system that dies with the prompt; a new
/proc, /dev, /dev/shm; the prompt's processes hold only the strict mode's
capabilities, no new privileges, and a seccomp filter against mounts, new
namespaces, ptrace and keyrings.  The helper holds the extra capabilities it
needs for that (HELPER_CAPABILITIES); no process of a prompt does.

The helper writes the pid of the view's first process to a tag file on a
memory file system only the container sees (VIEW_FOLDER, which the views
cover); commands that must not go through the runner (the kill of a timed-out
command, every command after ``stop_processes``: the verifiers' checks) are
fresh execs that join the view by that tag, so their output stream is one no
process of the prompt holds.  The view ends when its sandbox closes the
runner's input, or when the runner ends (a command killed it) unless
``stop_processes`` ended it; the kernel then kills every process left in it,
and the container serves the next prompt.
"""

from __future__ import annotations

from typing import Optional

import attrs

from .agent import new_nonce
from .config import DockerConfig

VIEW_FOLDER = "/.hermes-batch"  # a memory file system of the container alone: the helper and the views' tags
HELPER = VIEW_FOLDER + "/helper"
VIEW_ENDED = "the prompt's view of the container has ended"  # what the helper says when a view is gone
VIEW_READY_S = 60.0  # a view's runner not started by then (a loaded engine) is given up, which ends the view
VIEW_END_S = 10.0  # a closed view's processes are gone by then, or its container is removed instead


@attrs.frozen
class View:
    """One prompt's view of a reused container: how to make it, join it and stop its processes."""

    tag: str
    mask: int  # the capabilities its processes keep
    workdir: str
    user: Optional[tuple]  # (uid, gid) of -S user=, else None (the container's root)
    own_network: bool  # -S network=none: a network namespace of its own, loopback only
    memory_bytes: int  # its files' memory file system (counted in the container's memory limit)

    def _options(self) -> list:
        user = ["-i", f"{self.user[0]}:{self.user[1]}"] if self.user else []
        return ["-k", f"{self.mask:x}", *user, "-w", self.workdir]

    def open_argv(self, argv: list) -> list:
        """The exec that makes the view and runs ``argv`` (the runner) as its first command."""
        network = ["-n"] if self.own_network else []
        return [HELPER, "-O", str(self.memory_bytes), "-T", self.tag, *network, *self._options(), "--", *argv]

    def join_argv(self, argv: list) -> list:
        """An exec that runs ``argv`` inside the view, lowered as its commands are."""
        return [HELPER, "-J", self.tag, *self._options(), "--", *argv]

    def stop_argv(self) -> list:
        """An exec that kills every process of the view but its first, which then outlives the runner."""
        return [HELPER, "-J", self.tag, "-X"]


def new_view(config: DockerConfig, workdir: str) -> View:
    return View(
        tag=f"{VIEW_FOLDER}/{new_nonce()}", mask=config.prompt_capability_mask, workdir=workdir,
        user=config.uid_gid, own_network=config.network == "none", memory_bytes=config.memory_bytes,
    )
