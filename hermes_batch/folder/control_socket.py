"""The client's end of a run's control socket (``hermes-batch ctl``, the viewer's controls): where it is in the run
folder, how it is reached whatever the folder's path length, and one request sent (the run's end is
hermes_batch/run/control.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
from pathlib import Path
from typing import Optional

from ..errors import HermesBatchError, UsageError

CONTROL_DIR = "control"
SOCKET_NAME = "socket"
MAX_REQUEST = 4096
MAX_ANSWER = 1 << 20
REQUEST_TIMEOUT_S = 5.0
COMMANDS = ("status", "pause", "resume", "workers", "max_cost", "stop")


class NoRunListening(HermesBatchError):
    """``ctl`` found no run listening in the folder."""


def open_folder(run_dir: Path, create: bool) -> Optional[int]:
    """A descriptor of ``run_dir/control`` (made 0700 with ``create``), None when missing; refuses a link, a
    folder of another user or one others may enter."""
    path = run_dir / CONTROL_DIR
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise HermesBatchError(f"{path} is not a folder the run made ({exc.strerror}); move it away.") from None
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        os.close(fd)
        raise HermesBatchError(f"{path} belongs to another user; move it away.")
    if create and stat.S_IMODE(info.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def through(fd: int) -> str:
    return f"/proc/self/fd/{fd}/{SOCKET_NAME}"


def send(run_dir: Path, request: dict, timeout: float = 10.0) -> dict:
    """``ctl``'s end: ``request`` to the run listening in ``run_dir``, its answer; NoRunListening when none is."""
    run_dir = Path(run_dir)
    nobody = f"No run is listening in {run_dir}"
    fd = open_folder(run_dir, create=False) if run_dir.is_dir() else None
    if fd is None:
        if not run_dir.is_dir():
            raise NoRunListening(f"{run_dir} is not a run folder; pass the folder of a running run (OUTPUT_DIR/RUN_NAME).")
        raise NoRunListening(f"{nobody} (it has no control socket): the run has ended or has not started its prompts yet.")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(through(fd))
            except (FileNotFoundError, ConnectionRefusedError):
                raise NoRunListening(f"{nobody}: the run that made its control socket has ended.") from None
            sock.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n") and len(data) < MAX_ANSWER:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except socket.timeout:
        raise NoRunListening(f"{nobody}: the run did not answer within {timeout:g} s.") from None
    finally:
        os.close(fd)
    try:
        answer = json.loads(data)
    except ValueError:
        raise NoRunListening(f"{nobody}: the control socket answered something that is not JSON.") from None
    if not isinstance(answer, dict):
        raise NoRunListening(f"{nobody}: the control socket answered something that is not a JSON object.")
    return answer


def request_of(command: str, value: Optional[str]) -> dict:
    """The request of ``ctl``'s arguments; UsageError for a command that is not one or a value that is missing."""
    if command not in COMMANDS:
        raise UsageError(f"ctl knows {', '.join(COMMANDS)}, not {command!r}.")
    needs = command in ("workers", "max_cost")
    if needs != (value is not None):
        raise UsageError(f"ctl {command} takes {'one value' if needs else 'no value'}; "
                         f"for example: hermes-batch ctl RUN_DIR {'workers 8' if command == 'workers' else 'max_cost 25' if needs else command}.")
    if value is None:
        return {"command": command}
    try:
        number = int(value) if command == "workers" else float(value)
    except ValueError:
        raise UsageError(f"ctl {command} takes a number, not {value!r}.") from None
    return {"command": command, "value": number}
