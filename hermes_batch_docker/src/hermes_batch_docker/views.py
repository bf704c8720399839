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

from hermes_batch import container_views

from .agent import new_nonce
from .config import DockerConfig

View, VIEW_ENDED = container_views.View, container_views.VIEW_ENDED  # the helper's command lines
VIEW_FOLDER = "/.hermes-batch"  # a memory file system of the container alone: the helper and the views' tags
HELPER = VIEW_FOLDER + "/helper"
VIEW_READY_S = 60.0  # a view's runner not started by then (a loaded engine) is given up, which ends the view
VIEW_END_S = 10.0  # a closed view's processes are gone by then, or its container is removed instead
# A view's files live in memory, counted in the container's memory limit: they may take that limit less this
# (at most half of it), so that a prompt that fills them gets "No space left on device" before its processes
# run out of memory (the kernel would kill them, its runner too, which ends the view).
MEMORY_FOR_PROCESSES = 512 * 1024 * 1024
# Run as the commands' user (-S user=, else the image's USER): its uid, gid and the HOME Docker gives it
# (from the image's /etc/passwd, else /), which the helper, run as root, gives every command of the views.
IDENTITY_SCRIPT = (
    'while read -r key real _; do case "$key" in Uid:) u=$real;; Gid:) g=$real;; esac; done < /proc/self/status; '
    'printf "%s %s %s" "$u" "$g" "$HOME"'
)


def files_bytes(memory: int) -> int:
    """The size of a view's memory file system in a container of ``memory`` bytes (see MEMORY_FOR_PROCESSES)."""
    return memory - min(memory // 2, MEMORY_FOR_PROCESSES)


def parse_identity(output: str) -> tuple:
    """(uid, gid, home) from what IDENTITY_SCRIPT printed; ValueError when it is not that."""
    uid, gid, home = output.split(" ", 2)
    return int(uid), int(gid), home


def new_view(config: DockerConfig, workdir: str, user: Optional[tuple]) -> View:
    """A new view for a container whose commands run as ``user`` ((uid, gid, home), or None for its root)."""
    return View(
        helper=HELPER, tag=f"{VIEW_FOLDER}/{new_nonce()}", mask=config.prompt_capability_mask, workdir=workdir,
        user=user, own_network=config.network == "none", memory_bytes=files_bytes(config.memory_bytes),
    )
