"""A prompt's network of its own with a way out: user-mode NAT into its network namespace (``-S network=nat``).

A network namespace per prompt keeps its abstract unix sockets, its listeners
and what ``/proc/net`` shows apart from the machine's and the other prompts';
a user-mode NAT program outside it (pasta, from Debian's ``passt``, else
``slirp4netns``) gives it an interface and a default route, and makes its
outbound connections as sockets of the runner, so ``pip install`` works as on
the host.  Neither forwards a port into the namespace nor, unless asked
(``loopback``), lets it reach the machine's own loopback: like Docker's bridge,
a listener of the machine on 127.0.0.1 stays out of reach.

The program is found once per backend (:func:`find`, which also checks that it
works here, and takes none where the machine's only name server is on its
loopback, as systemd-resolved's 127.0.0.53, which a namespace cannot reach) and attached to each namespace as it starts (:meth:`Nat.attach`),
through descriptors of the namespace the runner opens (so it never has to open
another process's ``/proc`` entries).  It ends with the namespace: the runner
kills it at close, and if the runner dies it ends too (slirp4netns when its
exit pipe closes, pasta by its parent-death signal).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import time
from typing import Optional

import attrs

from ..sandbox_blocks.processes import ChildProcess

log = logging.getLogger(__name__)

# slirp4netns first: a prompt's start costs it about 5 ms of CPU, pasta about 23 (bench/NOTES.md)
PROGRAMS = ("slirp4netns", "pasta")
RESOLV_CONF = "/etc/resolv.conf"
READY_TIMEOUT_S = 30.0
INSTALL_HINT = "apt-get install passt (or slirp4netns)"


@attrs.frozen
class Nat:
    """A user-mode NAT program found on this machine."""

    name: str  # pasta or slirp4netns
    path: str
    setpriv: Optional[str] = None  # pasta runs in the foreground under setpriv --pdeathsig, so it dies with the runner
    loopback: bool = False  # the machine's loopback is reachable at the namespace's gateway address

    def argv(self, netns: int, userns: Optional[int], ready: int, exit_fd: int) -> list:
        """The program's argv attaching it to the namespaces open as ``netns`` and ``userns`` (descriptors it
        inherits); it writes to ``ready`` once the namespace's interface is up."""
        if self.name == "pasta":
            return [
                *((self.setpriv, "--pdeathsig=KILL", "--") if self.setpriv else ()),
                self.path, "--foreground", "--quiet", "--config-net", "--ipv4-only",
                # no port of the machine forwarded into the namespace, none of the namespace's out to the machine
                "--tcp-ports", "none", "--udp-ports", "none", "--tcp-ns", "none", "--udp-ns", "none",
                *(() if self.loopback else ("--no-map-gw",)),
                # as root it would switch to nobody, who may not enter a namespace of root's; it drops its capabilities
                *(("--runas", "0") if os.geteuid() == 0 else ()),
                "--pid", f"/proc/self/fd/{ready}",  # written once the namespace is configured
                "--netns", f"/proc/self/fd/{netns}",
                *(("--userns", f"/proc/self/fd/{userns}") if userns is not None else ()),
            ]
        # slirp4netns's sandbox makes only "/" private before it detaches the old root, so as root, in the machine's
        # mount namespace, that detach reached every shared mount's peers (a running container's root file system
        # under /var/lib/docker vanished): it starts in a mount namespace of its own whose mounts are all private.
        private = (os.geteuid() == 0 and shutil.which("unshare")) or None
        wrapper = (private, "--mount", "--propagation", "private", "--") if private else ()
        sandbox = ("--enable-sandbox",) if private or os.geteuid() != 0 else ()
        return [
            *wrapper, self.path, "--configure", "--mtu=65520", *(() if self.loopback else ("--disable-host-loopback",)),
            *sandbox, "--enable-seccomp", f"--ready-fd={ready}", f"--exit-fd={exit_fd}",
            "--netns-type=path", *((f"--userns-path=/proc/self/fd/{userns}",) if userns is not None else ()),
            f"/proc/self/fd/{netns}", "tap0",
        ]

    def _fds(self, pid: int, user: bool) -> tuple:
        """(netns, userns or None, ready read end, ready write end, exit read end, exit write end) for ``pid``."""
        opened = []
        try:
            for kind in ("net", "user") if user else ("net",):
                opened.append(os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC))
            if not user:
                opened.append(None)
            opened += [*os.pipe(), *os.pipe()]
        except OSError:
            for fd in opened:
                if fd is not None:
                    os.close(fd)
            raise
        return tuple(opened)

    async def attach(self, pid: int, user: bool, nicer: int = 0) -> "Attached":
        """Start the program for the network namespace of ``pid`` (with ``user``, entering its user namespace too)
        and wait until the namespace's interface is up; raises OSError or RuntimeError.  A few at a time: each holds
        six descriptors while it starts (run/limits.py counts them once, in FILES_BASE)."""
        async with _starting():
            return await self._attach(pid, user, nicer)

    async def _attach(self, pid: int, user: bool, nicer: int) -> "Attached":
        netns, userns, ready_r, ready_w, exit_r, exit_w = self._fds(pid, user)
        kept = (netns, ready_w, exit_r, *((userns,) if userns is not None else ()))
        child = None
        try:
            child = await ChildProcess.start(
                self.argv(netns, userns, ready_w, exit_r), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, pass_fds=kept, nicer=nicer,
            )
            for fd in kept:
                os.close(fd)
            kept = ()
            loop = asyncio.get_running_loop()
            answer = loop.create_future()

            def readable():
                if not answer.done():
                    answer.set_result(os.read(ready_r, 64))

            loop.add_reader(ready_r, readable)
            try:
                async with asyncio.timeout(READY_TIMEOUT_S):
                    said = await answer
            finally:
                loop.remove_reader(ready_r)
            if not said:
                raise RuntimeError(f"{self.name} ended before the namespace's network was up")
            return Attached(child, exit_w)
        except BaseException:
            if child is not None:
                child.kill()
                child.reap_when_exited()
            os.close(exit_w)
            raise
        finally:
            for fd in kept:
                os.close(fd)
            os.close(ready_r)


STARTING_AT_ONCE = 4  # NAT programs being started at the same time (each holds six descriptors meanwhile)
_semaphores: dict = {}


def _starting() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if loop not in _semaphores:
        _semaphores.clear()  # a semaphore belongs to one event loop; the run has one
        _semaphores[loop] = asyncio.Semaphore(STARTING_AT_ONCE)
    return _semaphores[loop]


class Attached:
    """A NAT program serving one namespace."""

    def __init__(self, child: ChildProcess, exit_fd: int):
        self._child = child
        self._exit_fd: Optional[int] = exit_fd

    def stop(self) -> None:
        """End the program (the namespace is gone or going)."""
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None
        self._child.kill()
        self._child.reap_when_exited()


def find(check, loopback: bool = False) -> tuple:
    """(the first of PROGRAMS installed here that ``check(nat)`` finds working, None), or (None, why not)."""
    resolver = loopback_resolver()
    if resolver:
        # the commands read the machine's resolv.conf, and a namespace's 127.0.0.53 is its own
        return None, f"this machine's resolver is on its loopback ({resolver}), which a namespace of its own cannot reach"
    tried = []
    for name in PROGRAMS:
        path = shutil.which(name)
        if path is None:
            continue
        nat = Nat(name, path, shutil.which("setpriv") if name == "pasta" else None, loopback)
        why = check(nat)
        if why is None:
            return nat, None
        tried.append(f"{name} {why}")
        log.info("The local sandbox's network: %s %s.", name, why)
    if not tried:
        return None, f"neither pasta nor slirp4netns is installed ({INSTALL_HINT})"
    return None, "; ".join(tried)


def loopback_resolver() -> str:
    """The first name server of RESOLV_CONF when every one it names is on the loopback (systemd-resolved's
    127.0.0.53), else ``""``."""
    try:
        with open(RESOLV_CONF, errors="replace") as f:
            servers = [line.split()[1] for line in f.read(65536).splitlines()
                       if line.startswith("nameserver") and len(line.split()) > 1]
    except OSError:
        return ""
    local = [server for server in servers if server.startswith("127.") or server == "::1"]
    return local[0] if servers and len(local) == len(servers) else ""


def attach_now(nat: Nat, pid: int, user: bool) -> Optional[str]:
    """Attach ``nat`` to the namespace of ``pid`` and see a default route there, synchronously (the start's check);
    None when it works, else why not."""
    netns, userns, ready_r, ready_w, exit_r, exit_w = nat._fds(pid, user)
    kept = (netns, ready_w, exit_r, *((userns,) if userns is not None else ()))
    try:
        child = subprocess.Popen(nat.argv(netns, userns, ready_w, exit_r), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=kept, start_new_session=True)
    except OSError as exc:
        for fd in (*kept, ready_r, exit_w):
            os.close(fd)
        return f"could not start ({exc.strerror or exc})"
    for fd in kept:
        os.close(fd)
    try:
        import select

        if not select.select([ready_r], [], [], READY_TIMEOUT_S)[0] or not os.read(ready_r, 64):
            child.kill()
            error = child.communicate(timeout=30)[1].decode(errors="replace").strip()
            return f"could not attach to a namespace ({error.splitlines()[-1] if error else 'no message'})"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with open(f"/proc/{pid}/net/route") as f:
                if any(line.split()[1:2] == ["00000000"] for line in f.read().splitlines()[1:]):
                    return None
            time.sleep(0.01)
        return "gave the namespace no default route"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"did not answer ({exc})"
    finally:
        os.close(exit_w)
        os.close(ready_r)
        child.kill()
        try:
            child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pass
