"""Whether the hermes-batch process that left something behind (a lock, a container, an instance) may still run.

The folder lock, the view's search files and every sandbox backend's leftover cleanup ask this one
question; plugins reach it as ``hermes_batch.SandboxBackend.owner_alive``.
"""

from __future__ import annotations

import os
import socket
from typing import Collection, Optional


def owner_alive(pid, host: Optional[str] = None, *, session: Optional[str] = None,
                live_sessions: Optional[Collection[str]] = None) -> bool:
    """Whether process ``pid`` of ``host`` (None: this machine), which left a lock or sandbox behind, may still run.

    Only a process of this machine can be checked: one of another host is taken to be running (a host name
    cut to 63 characters, as labels and tags hold it, still names this machine).  A ``pid`` that is not a
    positive integer (or its text) belongs to no one.  When ``pid`` is this very process (tests run several
    runs in one) and ``live_sessions`` is given, what it left is in use while its ``session`` is among them.
    """
    if host is not None:
        this_host = socket.gethostname()
        if host not in (this_host, this_host[:63]):
            return True
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    if pid == os.getpid() and live_sessions is not None:
        return session in live_sessions
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
