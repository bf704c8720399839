"""The Apptainer or SingularityCE command: finding it, its environment, running it with a time limit."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from typing import Optional

import attrs

from hermes_batch import ConfigError

from .config import RUNTIMES

VERSION_TIMEOUT_S = 60.0
LIST_TIMEOUT_S = 60.0

# What the runtime itself needs from the runner's environment; everything else (API keys!) stays out.
_KEPT = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TMPDIR", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME")
# Site and user settings of the runtime (cache, temporary folder, binds, registry logins) are kept,
# but not the variables it would inject into every container.
_SETTING_PREFIXES = ("APPTAINER_", "SINGULARITY_")
_INJECTING_PREFIXES = ("APPTAINERENV_", "SINGULARITYENV_", "APPTAINER_ENV", "SINGULARITY_ENV")
# Image conversions may need the site's proxy to reach a registry; containers never see these.
_PROXIES = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")


def runtime_environment(*, proxies: bool = False) -> dict:
    """The environment the runtime runs with: a few basics and its own settings, never the rest."""
    env = {}
    for name, value in os.environ.items():
        if name in _KEPT or (proxies and name in _PROXIES):
            env[name] = value
        elif name.startswith(_SETTING_PREFIXES) and not name.startswith(_INJECTING_PREFIXES):
            env[name] = value
    env.setdefault("PATH", os.defpath)
    env.setdefault("LANG", "C.UTF-8")
    return env


def find_binary(binary: Optional[str], option: str = "-S binary") -> str:
    """The runtime's path: ``binary`` if given, else apptainer, else singularity on PATH.

    ``option`` is how the user gives ``binary`` to the command at hand (``-S binary`` for a run, ``--binary``
    for ``hermes-batch singularity cleanup``), which the errors name.
    """
    candidates = (binary,) if binary else RUNTIMES
    for candidate in candidates:
        found = shutil.which(candidate)
        if found:
            return found
    if binary:
        raise ConfigError(
            f"{option}={binary}: no such command on PATH or file that can be run; "
            "give the path of apptainer or singularity, or leave the option out to find one on PATH."
        )
    raise ConfigError(
        "Neither apptainer nor singularity is on PATH, so the singularity sandbox cannot run; "
        f"install Apptainer (or SingularityCE), load its module, or give its path with {option}=PATH."
    )


@attrs.frozen
class Completed:
    """A runtime command that ended: its exit status and its two outputs (bounded by the caller)."""

    returncode: Optional[int]  # None: killed at its time limit
    stdout: bytes
    stderr: bytes

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def reason(self) -> str:
        """The runtime's own explanation: its last FATAL or ERROR line, else its last line."""
        lines = [line.strip() for line in self.stderr.decode("utf-8", "replace").splitlines() if line.strip()]
        for line in reversed(lines):
            for marker in ("FATAL:", "ERROR:", "ERROR  :"):
                if marker in line:
                    return _cut(line.split(marker, 1)[1].strip())
        if lines:
            return _cut(lines[-1])
        if self.timed_out:
            return "it did not finish in time"
        return f"exit status {self.returncode}"


def _cut(text: str, limit: int = 400) -> str:
    text = text.replace("\x1b[0m", "").replace("\x1b[91m", "").strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def run(argv: list, *, env: dict, timeout: float, input: Optional[bytes] = None, cwd: Optional[str] = None) -> Completed:
    """Run a runtime command to its end or ``timeout``; cancelling it kills it.

    The command gets a session of its own, so a Ctrl-C typed at the terminal reaches
    hermes-batch (which stops its instances in order) and not the runtime mid-step.
    """
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(input), timeout)
    except asyncio.TimeoutError:
        kill(proc)
        stdout, stderr = await proc.communicate()
        return Completed(None, stdout, stderr)
    except BaseException:
        kill(proc)
        raise
    return Completed(proc.returncode, stdout, stderr)


def kill(proc) -> None:
    """SIGKILL a local runtime process that has not ended."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def version(binary: str) -> str:
    """``apptainer version 1.4.5`` and the like; ConfigError when the command does not run."""
    try:
        done = subprocess.run(
            [binary, "--version"], capture_output=True, timeout=VERSION_TIMEOUT_S, env=runtime_environment(),
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"{binary} --version did not run ({exc}); check the installation of Apptainer or SingularityCE.") from exc
    text = done.stdout.decode("utf-8", "replace").strip()
    if done.returncode != 0 or not text:
        reason = Completed(done.returncode, done.stdout, done.stderr).reason()
        raise ConfigError(f"{binary} --version failed ({reason}); check the installation of Apptainer or SingularityCE.")
    return text.splitlines()[0]


def list_instances(binary: str) -> list[dict]:
    """The instances of this user on this machine, as the runtime lists them (through spython).

    Each is a dict with at least ``instance`` (the name), ``pid`` and ``img``.
    """
    from spython.main import get_client

    client = get_client(quiet=True)

    def init_command(action, flags=None):
        # spython always runs `singularity`; this runs the runtime that was chosen.
        action = action if isinstance(action, list) else [action]
        return [binary, *(flags or []), *action]

    client._init_command = init_command
    found = client.instances(return_json=True, quiet=True)
    return [item for item in found or () if isinstance(item, dict) and item.get("instance")]
