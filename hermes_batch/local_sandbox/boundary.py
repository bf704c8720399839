"""What a prompt's commands may see, be and use in the local sandbox: the options the namespace's helper gets.

Set up once per backend (:func:`Boundary.of`) and per sandbox only what
differs (its folder, its user): the namespace's first process, the compiled
helper (:mod:`~hermes_batch.local_sandbox.namespace_init`), does the rest once
per namespace, so a command costs nothing more.  What it builds:

* **the view of the files**: everything read-only; the prompt's folder (its
  working folder, ``HOME`` and ``TMPDIR``) and a private ``/tmp`` and
  ``/dev/shm`` the only places it writes; the run folder (so the other
  prompts' folders), the invoking user's home and hermes-batch's own files
  (its package, its virtual environment, the helper's cache) under empty
  read-only folders; each ``-S expose=PATH[:rw]`` visible at its own path;
* **the identity**: as root, each prompt's commands run as a user of their own
  (:data:`UID_BASE` plus a random number below 2**24; no groups, no
  capabilities); without root, as the invoking user inside a user namespace;
  always with no new privileges (setuid programs grant nothing);
* **the network**: ``network=none`` a network namespace of its own whose only
  interface is its loopback;
* **limits** on each command (resource limits, inherited by what it starts):
  address space (``memory``), processes of the prompt's user (``pids``), the
  size of a file written (``disk``, also the size of ``/tmp`` and
  ``/dev/shm``) and CPU seconds (``cpu``); what the prompt's folder holds in
  all is held to ``disk`` by the backend, which measures it
  (:func:`folder_over`) while a command runs longer than a moment and after a
  command when the disk's free space fell by a part of the limit.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import re
import secrets
import sys
from pathlib import Path
from typing import Optional

import attrs

from . import namespace_init
from ..sandbox_blocks.trees import walk

# auto: nat where a NAT program works here, else host (said at start); nat insists on it.
NETWORKS = ("auto", "nat", "host", "none")
# Groups that give their members root on the machine, or its secrets: a command that kept one (a user namespace
# cannot take a user's groups away) could start a container of the host's files (docker, lxd, incus, libvirt),
# read raw disks (disk), the logs and journal (adm, systemd-journal), /etc/shadow (shadow) or become root (sudo, wheel).
PRIVILEGED_GROUPS = ("root", "sudo", "wheel", "admin", "adm", "disk", "docker", "lxd", "incus", "incus-admin",
                     "libvirt", "libvirt-qemu", "kvm", "systemd-journal", "shadow")
# As root, a prompt's user: this plus a random number below 2**24 (far above any user a system makes).
UID_BASE = 0x40000000
UID_SPREAD = 1 << 24
# Folders never hidden, whatever HOME says: the system the commands need.
SYSTEM = ("/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/var", "/opt", "/dev", "/dev/shm", "/proc", "/sys", "/tmp")
_SIZE = re.compile(r"(\d+)\s*([kmgt]?)(i?b?)", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

# The protections of a level, as the start of the run names what is missing.
VIEW = "a private view of the files (commands can read the run folder, other prompts' folders and your home)"
IDENTITY = "a user of their own (commands run as the user who started the run{root})"
LIMITS = "limits on memory, processes, disk and CPU time"
PROCESSES = "a process namespace (commands see the machine's processes, and one that leaves its session may outlive the prompt)"
KEYRINGS = "keyrings of their own (a prompt's commands may use another's session keyring, and the user's)"
IPC = "IPC of their own (System V and POSIX IPC objects are the machine's, and outlive the prompt)"
NETWORK = ("a network of their own (abstract unix sockets, listeners and /proc/net are the machine's and every "
           "prompt's: {why})")
LEVELS = ("namespace", "pid-namespace", "process")
# A prompt folder with more files and folders than this counts as over its disk limit (its measure stays bounded).
MAX_ENTRIES = 100_000


def parse_size(text: str, option: str) -> int:
    """Bytes of ``text`` (``512m``, ``4g``, ``1073741824``; ``0``: no limit); ValueError naming ``option``."""
    match = _SIZE.fullmatch(str(text).strip())
    if match is None:
        raise ValueError(f"{option} must be a size such as 512m or 4g, got {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def parse_expose(text: str) -> tuple:
    """``PATH[:rw|:ro],...`` as ((absolute path, writable), ...); ValueError for a relative path."""
    found = []
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        path, writable = item, False
        for suffix, rw in ((":rw", True), (":ro", False)):
            if item.endswith(suffix):
                path, writable = item[: -len(suffix)], rw
        if not path.startswith("/"):
            raise ValueError(f"expose takes absolute paths (PATH or PATH:rw), got {item!r}")
        found.append((os.path.normpath(path), writable))
    return tuple(found)


def own_files() -> list:
    """hermes-batch's own files: its package, its virtual environment (not a system Python's), the helper's cache."""
    import hermes_batch

    found = [str(Path(hermes_batch.__file__).resolve().parent), str(namespace_init.cache_dir())]
    if sys.prefix != sys.base_prefix:
        found.append(sys.prefix)
    return found


def homes() -> list:
    """The invoking user's home, as HOME and the password database say."""
    found = [os.path.expanduser("~")]
    try:
        found.append(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        pass
    return found


def _hideable(path: str) -> bool:
    """Not a folder the system needs, nor one of its parents."""
    path = os.path.normpath(path)
    return not any(system == path or system.startswith(path.rstrip("/") + "/") for system in SYSTEM)


@attrs.frozen
class Boundary:
    """The compiled helper's options for one backend: the same for every sandbox but its folder and user."""

    hidden: tuple  # folders shown empty, files shown unreadable
    exposed: tuple  # (path, writable)
    network: str
    memory: int  # bytes of address space per process, 0: no limit
    pids: int
    disk: int  # bytes per file written; the size of /tmp and /dev/shm
    cpu: int  # CPU seconds per process
    root: bool = attrs.field(factory=lambda: os.geteuid() == 0)

    @classmethod
    def of(cls, config, run_dir: Path, control_dir: Optional[str] = None, network: str = "",
           private: tuple = ()) -> "Boundary":
        """The boundary of ``config``'s sandboxes; ``network`` the one in effect (nat, host or none); ``private`` files
        no sandbox shows (the dataset)."""
        hidden = [str(Path(run_dir).resolve()), *homes(), *own_files(), *map(str, private)]
        if control_dir:
            hidden.append(control_dir)
        hidden = tuple(dict.fromkeys(os.path.realpath(path) for path in hidden if path and _hideable(path)))
        exposed = tuple((os.path.realpath(path), rw) for path, rw in parse_expose(config.expose))
        return cls(hidden, exposed, network or config.network, parse_size(config.memory, "memory"), config.pids,
                   parse_size(config.disk, "disk"), config.cpu)

    def options(self) -> tuple:
        """The helper's options every sandbox of the backend shares (see namespace_init.c)."""
        options = ["-t", str(self.disk or 1 << 30)]
        for path in self.hidden:
            options += ["-h", path]
        for path, writable in self.exposed:
            options += ["-e", path + (":rw" if writable else ":ro")]
        if self.network in ("none", "nat"):  # nat: a NAT program attaches to it as it starts (local_sandbox.nat)
            options.append("-n")
        for flag, value in (("-M", self.memory), ("-P", self.pids), ("-F", self.disk), ("-C", self.cpu)):
            if value:
                options += [flag, str(value)]
        return tuple(options)

    def sandbox_options(self, root: str, owner: Optional[tuple]) -> tuple:
        """The options of one sandbox: its folder, and as root the user its commands run as and the one a
        verifier's tests run as (another of the same range)."""
        if not owner:
            return ("-r", root)
        grader = owner[0]
        while grader == owner[0]:
            grader = UID_BASE + secrets.randbelow(UID_SPREAD)
        return ("-r", root, "-i", f"{owner[0]}:{owner[1]}", "-g", f"{grader}:{grader}")

    def new_owner(self) -> Optional[tuple]:
        """As root, the (uid, gid) a new sandbox's commands run as; else None (the invoking user's)."""
        if not self.root:
            return None
        uid = UID_BASE + secrets.randbelow(UID_SPREAD)
        return uid, uid


def folder_over(root: str, limit: int) -> str:
    """Why the files under ``root`` exceed ``limit`` bytes on disk (their blocks, links not followed), or ``""``.

    Bounded: more than MAX_ENTRIES files and folders, or a folder that cannot be
    read (so could hide what it holds), count as over.  Any depth: one folder is
    open at a time (trees.walk).
    """
    total, entries = 0, 0
    try:
        for _, entry in walk(root):
            entries += 1
            try:
                total += entry.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:
                continue  # removed while measured
            if total > limit:
                return f"its files take more than {limit} bytes"
            if entries > MAX_ENTRIES:
                return f"it holds more than {MAX_ENTRIES} files and folders"
    except FileNotFoundError:
        return ""
    except OSError as exc:
        if exc.errno == errno.ESTALE:
            return ""  # moved while measured: measured again later
        return f"a folder in it cannot be measured ({exc.strerror})"
    return ""


def missing(level: str, network_why: str = "") -> list:
    """What a sandbox of ``level`` does not protect, as the start of the run says it; ``network_why``: why it has no
    network of its own where it would have had one (-S network=auto)."""
    gaps = []
    if level != "namespace":
        groups = ", ".join(runner_groups())
        root = " (root, with fewer capabilities)" if os.geteuid() == 0 else f" (with its groups {groups})" if groups else ""
        gaps += [VIEW, IDENTITY.format(root=root), LIMITS, KEYRINGS]
    if level == "process":
        gaps += [PROCESSES, IPC]
    if network_why:
        gaps.append(NETWORK.format(why=network_why))
    return gaps


def runner_groups() -> list:
    """The names of the runner's supplementary groups other than its own group (none as root: commands drop them)."""
    if os.geteuid() == 0:
        return []
    return [_group_name(gid) for gid in sorted(set(os.getgroups()) - {os.getgid()})]


def privileged_groups() -> list:
    """The names of the runner's groups, its own included, that give root or the machine's secrets (PRIVILEGED_GROUPS
    or gid 0): what commands would keep where a user namespace cannot drop them (not as root)."""
    if os.geteuid() == 0:
        return []
    names = [_group_name(gid) for gid in sorted(set(os.getgroups()) | {os.getgid()})]
    return [name for name in names if name in PRIVILEGED_GROUPS or name == "0"]


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
