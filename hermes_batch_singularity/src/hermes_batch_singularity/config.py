"""Options of the singularity sandbox (``-S key=value``), validated before the run starts."""

from __future__ import annotations

import os
import posixpath
import shlex
from pathlib import Path
from typing import Any, Optional

import attrs

DEFAULT_IMAGE = "python:3.11-slim"  # a bare Docker-style name: docker://python:3.11-slim
DEFAULT_WORKDIR = "/workspace"  # for rows without a cwd
RUNTIMES = ("apptainer", "singularity")  # looked up on PATH in this order


def default_max_starting() -> int:
    """Instances started at the same time: twice the cores, between 2 and 16."""
    return max(2, min(16, 2 * (os.cpu_count() or 1)))


def default_cache_dir() -> Path:
    """Where converted images are kept: under the user's cache folder (XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hermes-batch" / "singularity"


def _arguments(value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as exc:
            raise ValueError(f"extra_args must be flags as a shell would split them, got {value!r} ({exc})") from None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"extra_args must be a string of flags such as \"--nv --bind /data\" or a list of them, got {value!r}")


def _check_extra_args(_instance, _attribute, value: tuple) -> None:
    for flag in value:
        name = flag.split("=", 1)[0]
        if name in ("--writable", "-w"):
            raise ValueError("extra_args: --writable would change the image itself for every prompt; each instance already gets its own writable tmpfs")


def _check_workdir(_instance, _attribute, value: Optional[str]) -> None:
    if value is not None and not posixpath.isabs(value):
        raise ValueError(f"workdir must be an absolute path inside the container, got {value!r}")


def _check_binary(_instance, _attribute, value: Optional[str]) -> None:
    if value is not None and not value.strip():
        raise ValueError("binary must name the apptainer or singularity command, or a path to it")


def _check_pool(_instance, _attribute, value) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"pool must be a number of instances (0 for none) or auto, got {value!r}")


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
class SingularityConfig:
    """Options of the singularity sandbox (``-S key=value``)."""

    image: str = attrs.field(default=DEFAULT_IMAGE, validator=attrs.validators.min_len(1))  # for rows without one
    binary: Optional[str] = attrs.field(default=None, validator=_check_binary)  # None: apptainer, else singularity
    cache_dir: Optional[str] = None  # converted SIFs; None: default_cache_dir()
    network: str = attrs.field(default="host", validator=attrs.validators.in_(("host", "none")))
    extra_args: Any = attrs.field(default=(), converter=_arguments, validator=_check_extra_args)  # for instance start
    no_privs: Optional[bool] = None  # drop root's privileges in the container; None: when run as root
    workdir: Optional[str] = attrs.field(default=None, validator=_check_workdir)  # for rows without a cwd
    max_starting: int = attrs.field(factory=default_max_starting, validator=_at_least(1, "max_starting"))
    max_output_bytes: int = attrs.field(default=1_000_000, validator=_at_least(1024, "max_output_bytes"))
    start_timeout: float = attrs.field(default=300.0, validator=_at_least(1, "start_timeout"))  # one instance start
    convert_timeout: float = attrs.field(default=3600.0, validator=_at_least(1, "convert_timeout"))  # one image
    max_builds: int = attrs.field(default=2, validator=_at_least(1, "max_builds"))  # task images built at once
    # Instances started ahead of need per image, each still for one prompt only; 0: each started when asked for.
    pool: Any = attrs.field(default=0, converter=_pool, validator=_check_pool)
    # agent: each prompt's commands and files through one command runner in its instance (one exec for the
    # prompt); exec: each through an `apptainer exec` of its own.
    runner: str = attrs.field(default="agent", validator=attrs.validators.in_(("agent", "exec")))
    # What an instance serves: "none", one prompt and then it is stopped (the strict mode); "namespace", prompts one
    # after another, each in new namespaces of its own inside it with a fresh view of the image's files (see the
    # README of hermes-batch-singularity for what each guarantees).
    reuse: str = attrs.field(default="none", validator=attrs.validators.in_(("none", "namespace")))

    def __attrs_post_init__(self) -> None:
        if self.reuse == "namespace" and self.runner != "agent":
            raise ValueError("reuse=namespace runs each prompt's commands through its command runner; drop runner=exec")
        if self.reuse == "namespace" and self.pool != 0:
            raise ValueError("reuse=namespace keeps each instance for the prompts that follow; drop pool=")

    def pool_size(self, concurrency: int) -> int:
        """Instances kept started ahead of need per image: ``pool``, or with ``auto`` the run's concurrency."""
        return max(1, concurrency) if self.pool == "auto" else self.pool

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()

    @property
    def drop_privileges(self) -> bool:
        return os.geteuid() == 0 if self.no_privs is None else self.no_privs
