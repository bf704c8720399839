"""Options of the modal sandbox (``-S key=value``), validated before the run starts."""

from __future__ import annotations

import posixpath
import re
from typing import Any, Optional

import attrs

DEFAULT_IMAGE = "python:3.11-slim"
DEFAULT_APP = "hermes-batch"
DEFAULT_WORKDIR = "/workspace"  # for rows without a cwd
DEFAULT_MAX_STARTING = 32  # creations in flight; Modal creates remotely, so this is not bound by local cores
DEFAULT_CREATE_RATE = 10.0  # creations started per second, under the rates at which Modal throttles
MAX_TIMEOUT = 24 * 3600  # Modal's longest sandbox lifetime

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([mgt])i?b?\s*$", re.IGNORECASE)
_MIB = {"m": 1, "g": 1024, "t": 1024 * 1024}
_APP_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,63}$")


def parse_memory_mib(value: Any) -> int:
    """``4g``, ``512m`` or a number of MiB (Modal's unit), as MiB."""
    if isinstance(value, bool):
        raise ValueError(f"memory must be a size such as 512m or 4g (or MiB as a number), got {value!r}")
    if isinstance(value, int):
        mib = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        mib = int(float(match.group(1)) * _MIB[match.group(2).lower()])
    else:
        raise ValueError(f"memory must be a size such as 512m or 4g (or MiB as a number), got {value!r}")
    if mib < 128:
        raise ValueError(f"memory must be at least 128m, got {value!r}")
    return mib


def _check_memory(_instance, _attribute, value) -> None:
    if value is not None:
        parse_memory_mib(value)


def _check_workdir(_instance, _attribute, value: str) -> None:
    if not posixpath.isabs(value):
        raise ValueError(f"workdir must be an absolute path inside the sandbox, got {value!r}")


def _check_app(_instance, _attribute, value: str) -> None:
    if not _APP_NAME.match(value):
        raise ValueError(f"app must be a Modal app name (letters, digits, '-', '_', '.'; at most 64), got {value!r}")


def _between(low, high, name):
    def check(_instance, _attribute, value) -> None:
        if value is not None and not (low <= value <= high):
            raise ValueError(f"{name} must be between {low:g} and {high:g}, got {value!r}")

    return check


@attrs.frozen
class ModalConfig:
    """Options of the modal sandbox (``-S key=value``)."""

    app: str = attrs.field(default=DEFAULT_APP, validator=_check_app)  # looked up, or created, once per run
    image: str = attrs.field(default=DEFAULT_IMAGE, validator=attrs.validators.min_len(1))  # for rows without one
    timeout: int = attrs.field(default=3600, validator=_between(10, MAX_TIMEOUT, "timeout"))  # a sandbox's longest life, s
    cpu: Optional[float] = attrs.field(default=None, validator=_between(0.125, 64, "cpu"))  # None: Modal's default
    memory: Any = attrs.field(default=None, validator=_check_memory)  # None: Modal's default; 512m, 4g, or MiB
    network: str = attrs.field(default="open", validator=attrs.validators.in_(("open", "none")))
    workdir: str = attrs.field(default=DEFAULT_WORKDIR, validator=_check_workdir)  # for rows without a cwd
    max_starting: int = attrs.field(default=DEFAULT_MAX_STARTING, validator=_between(1, 1000, "max_starting"))
    create_rate: float = attrs.field(default=DEFAULT_CREATE_RATE, validator=_between(0.01, 1000, "create_rate"))
    startup_timeout: float = attrs.field(default=180.0, validator=_between(1, 3600, "startup_timeout"))
    create_retries: int = attrs.field(default=6, validator=_between(0, 20, "create_retries"))
    max_output_bytes: int = attrs.field(default=1_000_000, validator=_between(1024, 1 << 30, "max_output_bytes"))

    @property
    def memory_mib(self) -> Optional[int]:
        return None if self.memory is None else parse_memory_mib(self.memory)
