"""Process mode (``-S isolation=process``): finding and killing every process a prompt started, at close.

Plain subprocesses.  At close the sandbox kills the sessions its commands led
(while it still holds their leaders, so the numbers are theirs), every process
whose environment carries the prompt's marker variable or whose working folder
is inside the prompt folder, and their descendants, each through a pidfd
checked after it was read.  A process that clears its environment, leaves the
folder and starts a new session escapes this; ``namespace`` has no such gap.
"""

from __future__ import annotations

import functools
import os

from ..sandbox_blocks.processes import kill_verified, live_pids, stat_fields

MARKER_VARIABLE = "HERMES_BATCH_SANDBOX"
KILL_ROUNDS = 10


def ticks_since_boot() -> int:
    """Now, in the clock ticks of the start times in /proc/<pid>/stat."""
    try:
        with open("/proc/uptime") as f:
            return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return 0


def _inside(link: str, root: str) -> bool:
    return link == root or link.startswith(root + "/")


def session_members() -> dict:
    """{session id: pids of its live processes} for every session on the machine (one scan of /proc)."""
    members: dict = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            state, _, _, sid, _ = stat_fields(int(entry.name))
            if state not in ("", "Z", "X"):
                members.setdefault(sid, []).append(int(entry.name))
    return members


def alone(leader: int, members: dict) -> bool:
    """Whether nothing but ``leader`` is left in the session it leads, by :func:`session_members`."""
    return all(pid == leader for pid in members.get(leader, ()))


def kill_prompt_processes(root: str, marker: str, sessions: set, since: int = 0) -> int:
    """Kill the processes of a prompt in process mode, again until none is left (they may be forking).

    A prompt's processes: those in ``sessions`` (sessions whose leaders are our
    unreaped children, so the numbers are still theirs), those whose environment
    carries the prompt's marker or whose working or root folder is inside the
    prompt folder, and their descendants.  Only processes started at ``since``
    (clock ticks since boot) or later are read: older ones cannot be the
    prompt's, and reading every process's environment costs most of a close.
    Every kill goes through :func:`kill_verified`, so no process that merely
    took a number over is hit.
    """
    needle = f"{MARKER_VARIABLE}={marker}\0".encode()
    read = functools.partial(_read_process, root, needle, sessions)
    killed = 0
    for _ in range(KILL_ROUNDS):
        hit = kill_verified(live_pids(since), read, _with_descendants)
        if not hit:
            break
        killed += hit
    return killed


def _read_process(root: str, needle: bytes, sessions: set, pid: int):
    """(parent pid, whether it is the prompt's) of a live process, None when it has ended."""
    state, ppid, _, sid, _ = stat_fields(pid)
    if state in ("", "Z", "X"):
        return None
    marked = sid in sessions
    try:
        marked = marked or _inside(os.readlink(f"/proc/{pid}/cwd"), root)
        marked = marked or _inside(os.readlink(f"/proc/{pid}/root"), root)
        if not marked:
            with open(f"/proc/{pid}/environ", "rb") as f:
                marked = needle in f.read()
    except OSError:
        pass
    return ppid, marked


def _with_descendants(seen: dict) -> set:
    """The marked pids of ``seen`` ({pid: (parent pid, marked)}) and their descendants, whatever they changed
    about themselves."""
    found = {pid for pid, (_, marked) in seen.items() if marked}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _) in seen.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found
