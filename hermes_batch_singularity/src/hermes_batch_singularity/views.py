"""``-S reuse=namespace``: an instance serves prompts one after another, each in a view of its own.

Starting and stopping an instance is most of the runtime's work per prompt (about
0.2 s of CPU, more through the test rig), the bound of a run on few cores.  In
this mode an instance (per image) is started once and serves one prompt at a
time: each prompt's command runner is one exec of hermes-batch's static namespace
helper (``namespace_view.h`` in hermes_batch's local sandbox, the Docker
sandbox's ``-S reuse=namespace`` too), bound read-only into the instance, which
makes new mount, PID, IPC and UTS namespaces (with ``-S network=none`` also a
network namespace of its own) and in them a fresh view of the image's files: an
overlay whose lower layer is the image's own file system (the SIF's squashfs, or
the sandbox folder, bound read-only at IMAGE_FOLDER: Apptainer's root, an overlay
itself, cannot be one) and whose upper layer is a memory file system that dies
with the prompt; a new /proc, /dev, /dev/shm; the prompt's processes hold no
capability, no new privileges, and a seccomp filter against mounts, new
namespaces, ptrace and keyrings.  The helper holds the capabilities it needs for
that (HELPER_CAPABILITIES, given to the instance's execs as root with
``--no-privs --add-caps``); no process of a prompt does.

The helper writes the pid of the view's first process to a tag file in the
instance's own /tmp, which no view shows; commands that must not go through the
runner (the kill of a timed-out command, every command and file after
``stop_processes``: the verifiers' checks) are execs that join the view by that
tag, so their output stream is one no process of the prompt holds.  The view ends
when its sandbox closes the runner's input, or when the runner ends (a command
killed it) unless ``stop_processes`` ended it; the kernel then kills every process
left in it, and the instance serves the next prompt.

An ordinary user's instances hold no capability at all, and a user namespace of
the helper's own cannot make an overlay of them, so this mode needs Apptainer
run as root.
"""

from __future__ import annotations

import os
import re
import subprocess

from hermes_batch import ConfigError, build_namespace_helper, command_runner, container_views

View, VIEW_ENDED = container_views.View, container_views.VIEW_ENDED  # the helper's command lines
VIEW_FOLDER = "/tmp/.hermes-batch"  # the instance's own /tmp (--containall): the helper and the views' tags
HELPER = VIEW_FOLDER + "/helper"
IMAGE_FOLDER = "/tmp/.hermes-batch-image"  # the image's files, the views' lower layer
HELPER_CAPABILITIES = (
    "CAP_SYS_ADMIN", "CAP_SYS_CHROOT", "CAP_SETPCAP", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_CHOWN",
)
VIEW_END_S = 10.0  # a closed view's processes are gone by then, or its instance is stopped instead
VIEW_BYTES = 1 << 30  # the memory file system of a view's files (the instance's writable tmpfs had no limit as root)
NOT_ROOT = (
    "-S reuse=namespace needs Apptainer run as root (an ordinary user's instances hold no capability to make "
    "each prompt's own view of them); leave it out, or use -S reuse=none."
)
_SQUASHFS_ROOT = re.compile(r"^\s*(\d+)\s*\|.*\|\s*FS \(Squashfs/\*System", re.M)


def helper_path(cache_dir) -> str:
    """The static namespace helper, built once into the image cache folder (which the runtime sees); ConfigError."""
    path, why = build_namespace_helper(os.path.join(str(cache_dir), "helper"), static=True)
    if path is None:
        raise ConfigError(f"-S reuse=namespace needs hermes-batch's namespace helper, which could not be built: {why}")
    return str(path)


def image_bind(binary: str, env: dict, image_path: str) -> str:
    """The ``--bind`` that shows the image's own files at IMAGE_FOLDER: the SIF's root file system, or the folder."""
    if os.path.isdir(image_path):
        return f"{image_path}:{IMAGE_FOLDER}:ro"
    listing = subprocess.run([binary, "sif", "list", image_path], capture_output=True, text=True, env=env, timeout=60)
    found = _SQUASHFS_ROOT.search(listing.stdout)
    if found is None:
        raise ConfigError(
            f"-S reuse=namespace: the image {image_path} has no squashfs root file system to make views of "
            f"({listing.stderr.strip()[-200:] or 'apptainer sif list found none'}); use -S reuse=none."
        )
    return f"{image_path}:{IMAGE_FOLDER}:id={found.group(1)},image-src=/"


def new_view(workdir: str, network: str) -> View:
    """A new view of an instance: its commands keep no capability (an instance's own have none either)."""
    return View(
        helper=HELPER, tag=f"{VIEW_FOLDER}/{command_runner.new_nonce()}", workdir=workdir, memory_bytes=VIEW_BYTES,
        lower=IMAGE_FOLDER, own_network=network == "none",
    )
