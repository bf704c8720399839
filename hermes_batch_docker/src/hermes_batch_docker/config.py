"""Options of the docker sandbox (``-S key=value``), validated before the run starts."""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any, Optional

import attrs

DEFAULT_IMAGE = "python:3.11-slim"
DEFAULT_WORKDIR = "/workspace"  # when neither the row nor the image names one

# What a shell session run as root needs: own files, change owners and modes, switch users
# (package managers drop privileges), signal its own processes, bind low ports.
BASE_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "NET_BIND_SERVICE")

# The helper of -S reuse=namespace makes each prompt's namespaces in the container with these; every
# process of the prompt drops them (see hermes_batch's namespace_view.h).
HELPER_CAPABILITIES = ("SYS_ADMIN", "SYS_CHROOT", "SYS_PTRACE", "SETPCAP")
# Linux's numbers of the capabilities (linux/capability.h), for the helper's mask of what a prompt keeps.
CAPABILITY_NUMBERS = {
    name: number for number, name in enumerate(
        """CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE
        NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT
        SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE
        AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ
        PERFMON BPF CHECKPOINT_RESTORE""".split()
    )
}

KNOWN_CAPABILITIES = frozenset(
    """AUDIT_CONTROL AUDIT_READ AUDIT_WRITE BLOCK_SUSPEND BPF CHECKPOINT_RESTORE CHOWN DAC_OVERRIDE
    DAC_READ_SEARCH FOWNER FSETID IPC_LOCK IPC_OWNER KILL LEASE LINUX_IMMUTABLE MAC_ADMIN MAC_OVERRIDE
    MKNOD NET_ADMIN NET_BIND_SERVICE NET_BROADCAST NET_RAW PERFMON SETFCAP SETGID SETPCAP SETUID
    SYS_ADMIN SYS_BOOT SYS_CHROOT SYS_MODULE SYS_NICE SYS_PACCT SYS_PTRACE SYS_RAWIO SYS_RESOURCE
    SYS_TIME SYS_TTY_CONFIG SYSLOG WAKE_ALARM""".split()
)
# Each of these lets a process reach past the container (mount, load modules, read host files by handle).
ESCAPE_CAPABILITIES = frozenset(
    {"SYS_ADMIN", "SYS_MODULE", "SYS_RAWIO", "SYS_BOOT", "DAC_READ_SEARCH", "MAC_ADMIN", "MAC_OVERRIDE", "BPF"}
)

MIN_MEMORY = 6 * 1024 * 1024  # the engine refuses less
DEFAULT_DISK = "10g"  # where the engine can limit a container's writable layer
MIN_DISK = 64 * 1024 * 1024
_USER = re.compile(r"^\d+(?::\d+)?$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_NETWORK_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")


def default_max_starting() -> int:
    """Containers created at the same time: twice the cores, between 2 and 16."""
    return max(2, min(16, 2 * (os.cpu_count() or 1)))


def parse_memory(value: Any) -> int:
    """``4g``, ``512m``, ``1.5g`` or a number of bytes, as bytes."""
    if isinstance(value, bool):
        raise ValueError(f"memory must be a size such as 512m or 4g, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise ValueError(f"memory must be a size such as 512m or 4g, got {value!r}")
    if size < MIN_MEMORY:
        raise ValueError(f"memory must be at least 6m (the Docker engine refuses less), got {value!r}")
    return size


def _capabilities(value: Any) -> tuple:
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"cap_add must be capability names such as NET_RAW or [\"NET_RAW\", \"SYS_PTRACE\"], got {value!r}")
    names = []
    for raw in value:
        name = raw.strip().upper().removeprefix("CAP_")
        if name == "ALL":
            raise ValueError("cap_add=ALL is refused: the docker sandbox never runs containers with every capability")
        if name not in KNOWN_CAPABILITIES:
            raise ValueError(f"cap_add: {raw!r} is not a Linux capability")
        if name in ESCAPE_CAPABILITIES:
            raise ValueError(f"cap_add: {name} would let commands reach past the container, so it is never granted")
        if name not in names and name not in BASE_CAPABILITIES:
            names.append(name)
    return tuple(names)


def _check_memory(_instance, _attribute, value) -> None:
    parse_memory(value)


def parse_size(value: Any, name: str) -> int:
    """``10g``, ``512m`` or a number of bytes, as bytes (for options other than memory)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name} must be a size such as 512m or 10g, got {value!r}")
    match = _SIZE.match(value) if isinstance(value, str) else None
    if isinstance(value, str) and not match:
        raise ValueError(f"{name} must be a size such as 512m or 10g, or none, got {value!r}")
    return value if isinstance(value, int) else int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _check_disk(_instance, _attribute, value) -> None:
    if value is None or value == "none":
        return
    if parse_size(value, "disk") < MIN_DISK:
        raise ValueError(f"disk must be at least 64m, got {value!r}")


def _check_user(_instance, _attribute, value) -> None:
    if value is not None and not (isinstance(value, str) and _USER.match(value)):
        raise ValueError(f"user must be a numeric UID or UID:GID such as 1000 or 1000:1000, got {value!r}")


def _check_network(_instance, _attribute, value: str) -> None:
    if value == "host" or value.startswith("container:"):
        raise ValueError(f"network={value} would share a network namespace outside the container; use bridge, none or a network you created")
    if not _NETWORK_NAME.match(value):
        raise ValueError(f"network must be bridge, none or the name of a Docker network, got {value!r}")


def _check_workdir(_instance, _attribute, value: Optional[str]) -> None:
    if value is not None and not posixpath.isabs(value):
        raise ValueError(f"workdir must be an absolute path inside the container, got {value!r}")


def _check_image_cache(_instance, _attribute, value) -> None:
    if value is None or value == "none":
        return
    parse_size(value, "image_cache")


def _check_pool(_instance, _attribute, value) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"pool must be a number of containers (0 for none) or auto, got {value!r}")


def _pool(value: Any) -> Any:
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return value.strip().lower() if isinstance(value, str) else value


def _at_least(minimum, name):
    def check(_instance, _attribute, value) -> None:
        if value is not None and value < minimum:
            raise ValueError(f"{name} must be at least {minimum}, got {value!r}")

    return check


@attrs.frozen
class DockerConfig:
    """Options of the docker sandbox (``-S key=value``)."""

    image: str = attrs.field(default=DEFAULT_IMAGE, validator=attrs.validators.min_len(1))  # for rows without one
    memory: Any = attrs.field(default="4g", validator=_check_memory)  # per container; 512m, 4g, or bytes
    cpus: Optional[float] = attrs.field(default=None, validator=_at_least(0.01, "cpus"))  # None: min(2, engine CPUs)
    pids_limit: int = attrs.field(default=1024, validator=_at_least(16, "pids_limit"))
    network: str = attrs.field(default="bridge", validator=_check_network)  # "none" cuts the container off
    disk: Any = attrs.field(default=None, validator=_check_disk)  # writable layer; None: DEFAULT_DISK where supported
    user: Optional[str] = attrs.field(default=None, validator=_check_user)  # UID[:GID]; None: the image's user
    cap_add: Any = attrs.field(default=(), converter=_capabilities)  # beyond BASE_CAPABILITIES
    workdir: Optional[str] = attrs.field(default=None, validator=_check_workdir)  # for rows without a cwd
    pull: str = attrs.field(default="missing", validator=attrs.validators.in_(("missing", "never")))
    max_starting: int = attrs.field(factory=default_max_starting, validator=_at_least(1, "max_starting"))
    max_output_bytes: int = attrs.field(default=1_000_000, validator=_at_least(1024, "max_output_bytes"))
    max_builds: int = attrs.field(default=2, validator=_at_least(1, "max_builds"))  # task images built at once
    # Containers started ahead of need per image, each still for one prompt only; 0: each made when asked for;
    # auto (the default): as many as the run works on at once (--num_workers).
    pool: Any = attrs.field(default="auto", converter=_pool, validator=_check_pool)
    # How commands reach the container: "agent", one long-lived shell per container started with it
    # (no engine call per command); "exec", one docker exec per command.
    runner: str = attrs.field(default="agent", validator=attrs.validators.in_(("agent", "exec")))
    # What a container serves: "none", one prompt and then it is removed (the strict mode); "namespace", prompts
    # one after another, each in new namespaces of its own inside it with a fresh view of the image's files
    # (see the README of hermes-batch-docker for what each guarantees).
    reuse: str = attrs.field(default="none", validator=attrs.validators.in_(("none", "namespace")))
    # The most disk the images this run pulled or built may hold (10g, 500m): beyond it the least recently used
    # of them that no prompt still to come needs are removed; images found on the engine are never removed.
    image_cache: Any = attrs.field(default=None, validator=_check_image_cache)

    def __attrs_post_init__(self) -> None:
        if self.reuse == "namespace" and self.runner != "agent":
            raise ValueError("reuse=namespace runs each prompt's commands through its command runner; drop runner=exec")
        if self.reuse == "namespace":
            # The helper's capabilities are what keeps a prompt in its view: no prompt may hold one. NET_ADMIN would
            # let a prompt change the container's network, which the prompts after it share (unless network=none).
            held = [name for name in self.cap_add if name in HELPER_CAPABILITIES
                    or (name == "NET_ADMIN" and self.network != "none")]
            if held:
                raise ValueError(
                    f"cap_add={','.join(held)} cannot be combined with reuse=namespace, whose prompts share a "
                    "container and must never hold the capabilities that keep them apart; use reuse=none for such tasks"
                )

    def pool_size(self, concurrency: int) -> int:
        """Containers kept started ahead of need per image: ``pool``, or with ``auto`` the run's concurrency."""
        return max(1, concurrency) if self.pool == "auto" else self.pool

    @property
    def prompt_capability_mask(self) -> int:
        """The capabilities a prompt's processes keep (BASE_CAPABILITIES and cap_add) as a bit mask."""
        return sum(1 << CAPABILITY_NUMBERS[name] for name in BASE_CAPABILITIES + self.cap_add)

    @property
    def image_cache_bytes(self) -> Optional[int]:
        """``image_cache`` in bytes, None for no limit."""
        if self.image_cache is None or self.image_cache == "none":
            return None
        return parse_size(self.image_cache, "image_cache")

    @property
    def memory_bytes(self) -> int:
        return parse_memory(self.memory)

    @property
    def uid_gid(self) -> Optional[tuple]:
        """(uid, gid) of ``user`` (gid defaults to uid), or None."""
        if self.user is None:
            return None
        uid, _, gid = self.user.partition(":")
        return int(uid), int(gid or uid)
