"""The ``local`` sandbox backend: one fresh folder per prompt, commands as local subprocesses.

Each prompt works in its own folder under the run's ``scratch/`` area, and the
file API refuses paths that leave it, links included.  Where the machine allows
it (the compiled helper, namespaces as root or through user namespaces) each
prompt's commands run in namespaces of their own that see only that folder,
a private ``/tmp`` and the read-only system, as a user of their own, with
limits (:mod:`~hermes_batch.local_sandbox.boundary`); elsewhere the start of
the run says which of those protections are missing (see
:mod:`~hermes_batch.local_sandbox.launchers`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import posixpath
import secrets
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import attrs

import hermes_batch

from ..errors import ConfigError, SandboxError
from ..contract.interfaces import KILL_EVERY_OTHER_PROCESS, STOP_PROCESSES_TIMEOUT_S, Sandbox, SandboxBackend
from ..formats.records import ExecResult, SandboxSpec, TestsRun
from ..sandbox_blocks.grading import environment_block, read_report, tests_environment, tests_script
from ..session.threads import in_daemon_thread
from .control import DEFAULT_BASE, SPILL_BYTES, ControlRoot, run_key
from ..sandbox_blocks.commands import POST_KILL_DRAIN_S, OutputPipe, run_command, wait_for_command
from ..sandbox_blocks.files import SandboxFolder
from .copying import copy_folder, empty_folder
from ..sandbox_blocks.trees import remove_tree
from .boundary import (
    NETWORKS, Boundary, folder_over, missing, parse_expose, parse_size, privileged_groups, runner_groups,
)
from .launchers import (
    HELPERS, ISOLATIONS, Launcher, find_nat, launcher, private_network_works, tests_apart_missing,
)
from .namespace import Namespace
from .sweep import MARKER_VARIABLE, alone, kill_prompt_processes, session_members, ticks_since_boot
from ..sandbox_blocks.processes import ChildProcess

log = logging.getLogger(__name__)

# The control folders of a namespace's helper: the prompt folder's name and this, in the backend's folder in
# memory (local_control) and, for what that cannot hold, beside the prompt folder (the spill folder).
CONTROL_SUFFIX = ".ctl"
# Threads that make prompt folders: they never block for long, so a few keep up with any rate of prompts.
FOLDER_THREADS = 4
# Process mode: a command's shell is held unreaped after it ends (its session may live on in `cmd &`);
# once this many are held, one scan of /proc releases those whose sessions are empty.
HELD_BEFORE_CHECK = 8
# -S disk holds what a prompt's folder takes in all (with the compiled helper): a command still running after
# WATCH_AFTER_S has the folder measured every WATCH_EVERY_S or more (at most a fifth of a core for a folder of
# many files) and is killed once over; after a command, the folder is measured when the disk's free space fell
# by a quarter of the limit since it last was.  Shorter commands cost nothing more than a statvfs.
WATCH_AFTER_S = 0.5
WATCH_EVERY_S = 0.25


@attrs.frozen
class LocalSandboxConfig:
    """Options of the local sandbox (``-S key=value``)."""

    keep: bool = False  # keep each prompt's folder after the prompt, for debugging
    max_starting: int = 64  # prompts setting up their folder at the same time
    max_output_bytes: int = 1_000_000  # output kept per command: the first and last halves
    isolation: str = "auto"  # namespace, process, or auto: namespace where the machine allows it
    control_dir: str = DEFAULT_BASE  # a memory file system for the helper's scripts and FIFOs; "" for none
    nice: int = 10  # how much nicer than the run the commands run, so that they never starve its event loop
    helper: str = "auto"  # a namespace's first process: auto (compiled where it builds and works, else bash), bash
    # auto: nat where pasta or slirp4netns works here, else host (said at start); nat: a network namespace of the
    # prompt's own with a user-mode NAT out; host: the machine's; none: a namespace with only its loopback
    network: str = "auto"
    host_loopback: bool = False  # nat: the machine's loopback is reachable at the namespace's gateway address
    allow_groups: str = ""  # NAME,...: privileged groups of the runner (not root) its commands may keep
    memory: str = "8g"  # address space of each command's process ("0": no limit)
    pids: int = 512  # processes the prompt's user may have at once (0: no limit)
    disk: str = "2g"  # size of the prompt's folder, of each file a command writes, of its private /tmp and /dev/shm ("0": no limit)
    cpu: int = 600  # CPU seconds of each command's process (0: no limit)
    expose: str = ""  # PATH[:rw],...: folders or files of the machine the commands see (read-only unless :rw)

    def __attrs_post_init__(self):
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {self.isolation!r}")
        if self.helper not in HELPERS:
            raise ValueError(f"helper must be one of {', '.join(HELPERS)}, got {self.helper!r}")
        if self.max_starting < 1:
            raise ValueError("max_starting must be at least 1")
        if self.max_output_bytes < 1024:
            raise ValueError("max_output_bytes must be at least 1024")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be from 0 to 19, got {self.nice}")
        if self.network not in NETWORKS:
            raise ValueError(f"network must be one of {', '.join(NETWORKS)}, got {self.network!r}")
        parse_size(self.memory, "memory")
        parse_size(self.disk, "disk")
        parse_expose(self.expose)
        for name in filter(None, (part.strip() for part in self.allow_groups.split(","))):
            if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
                raise ValueError(f"allow_groups takes group names (NAME,...), got {name!r}")
        for name in ("pids", "cpu"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (no limit) or more, got {getattr(self, name)}")


class LocalSandboxBackend(SandboxBackend):
    """Runs each prompt's commands as subprocesses in a fresh folder under the run's scratch area."""

    name = "local"
    description = (
        "A fresh folder per prompt under the run folder; commands see only it, as a user of their own, with limits, "
        "where namespaces work (else the run says which protections are missing)."
    )
    Config = LocalSandboxConfig
    ignores_images = True
    copies_workdirs = True

    def __init__(self, config: LocalSandboxConfig, run):
        super().__init__(config, run)
        self._starting = asyncio.Semaphore(config.max_starting)
        self._open: set[LocalSandbox] = set()
        self.launcher: Optional[Launcher] = None
        self._control: Optional[ControlRoot] = None  # where the helpers' control folders go, when in memory
        self._checking = asyncio.Lock()
        self.boundary: Optional[Boundary] = None  # with the compiled helper: what its commands see, are and use
        self._options: tuple = ()  # the helper's options every sandbox shares (Boundary.options)
        self.isolation = ""  # the level found at check: namespace, pid-namespace or process (Launcher.level)
        self._nat = None  # the NAT program of network=nat (local_sandbox.nat), found at check

    async def check(self) -> None:
        """Find how commands can run here; ConfigError when ``isolation=namespace`` cannot work."""
        if self.launcher is None:
            async with self._checking:
                if self.launcher is None:
                    await self._check()

    async def _check(self) -> None:
        try:
            found = await in_daemon_thread(launcher, self.config.isolation, self.config.helper)
        except RuntimeError as exc:
            raise ConfigError(
                f"-S isolation=namespace cannot work on this machine ({exc}); "
                "use -S isolation=process, or install util-linux or a C compiler and allow user namespaces."
            ) from None
        nat, network_why = await self._check_boundary(found)
        if nat is not None:
            found = found.with_network()  # unshare's namespaces get one too (the compiled helper: -n per sandbox)
        if found.namespace and found.helper and self.config.control_dir and self._control is None:
            self._control = await in_daemon_thread(ControlRoot.make, self.config.control_dir,
                                                   run_key(self.run.scratch_dir))
            if self._control is None:
                log.info("The local sandbox keeps its commands' scripts beside the prompt folders: %s cannot "
                         "hold a private folder.", self.config.control_dir)
        network = self.config.network if self.config.network in ("host", "none") else "nat" if nat else "host"
        if found.boundary:
            control = os.path.dirname(self._control.path) if self._control is not None else None
            self.boundary = Boundary.of(self.config, self.run.run_dir, control, network, self.run.private_paths)
            self._options = self.boundary.options()
        self._nat = nat
        self.isolation = found.level
        self.tests_apart_missing = await in_daemon_thread(tests_apart_missing, found)
        self.isolation_details = {
            "network": network,
            **({"nat": nat.name} if nat else {}),
            **({"groups": runner_groups()} if runner_groups() else {}),
            "missing": missing(found.level, network_why),
        }
        self.launcher = found

    async def _check_boundary(self, found: Launcher) -> tuple:
        """(the NAT program of ``network=auto`` or ``nat``, or None; why there is none where auto wanted one); a
        ConfigError where ``isolation=namespace``, ``network=none`` or ``nat``, or taking the runner's privileged
        groups away cannot be had; else say once what is missing."""
        config = self.config
        if config.isolation == "namespace" and not found.boundary:
            raise ConfigError(
                f"-S isolation=namespace cannot work on this machine ({found.reason}); use -S isolation=auto, or "
                "install a C compiler (gcc and libc6-dev on Debian) and allow user namespaces."
            )
        if config.network == "none" and not await in_daemon_thread(private_network_works, found):
            raise ConfigError(
                "-S network=none cannot work on this machine (the local sandbox cannot give its namespaces a network "
                f"of their own{': ' + found.reason if found.reason else ''}); use -S network=host or a container backend."
            )
        self._refuse_privileged_groups(found)
        nat, network_why = None, ""
        if config.network in ("auto", "nat"):
            nat, network_why = await in_daemon_thread(find_nat, found.with_network(), config.host_loopback)
            if nat is None and config.network == "nat":
                raise ConfigError(f"-S network=nat cannot work on this machine ({network_why}); install passt or "
                                  "slirp4netns (Debian's packages), or use -S network=host.")
        level_gaps = missing(found.level)
        said = []
        if level_gaps:
            said.append(f"without {'; without '.join(level_gaps)}: {found.reason or 'namespaces cannot work here'}; "
                        "-S isolation=namespace insists on them")
        if network_why and config.network == "auto":
            said.append(f"without {missing('namespace', network_why)[0]}; -S network=nat insists on it, -S network=host "
                        "asks for the machine's")
        if said:  # a warning unless asked for (isolation=process)
            log.log(logging.WARNING if config.isolation == "auto" else logging.INFO,
                    "The local sandbox runs commands %s.", "; and ".join(said))
        return nat, network_why if config.network == "auto" else ""

    def _refuse_privileged_groups(self, found: Launcher) -> None:
        """ConfigError when the runner (not root) is in a group that gives root or the machine's secrets, which
        its commands would keep where they are to have a user of their own (a user namespace cannot drop groups)."""
        if not found.boundary or self.config.isolation == "process":
            return
        allowed = {part.strip() for part in self.config.allow_groups.split(",")}
        refused = [name for name in privileged_groups() if name not in allowed]
        if refused:
            names = ", ".join(refused)
            raise ConfigError(
                f"The local sandbox cannot take your group{'s' if len(refused) > 1 else ''} {names} away from its "
                f"commands (a user namespace keeps its user's groups), and {'they give' if len(refused) > 1 else 'it gives'} "
                f"root or the machine's secrets; run as a user outside {'them' if len(refused) > 1 else 'it'} (or as "
                f"root), or let the commands have {'them' if len(refused) > 1 else 'it'} with -S allow_groups="
                f"{','.join(refused)}."
            )

    async def start(self) -> None:
        await self.check()
        # Folders of a crashed session are left alone: another worker may share this run folder.
        self.run.scratch_dir.mkdir(parents=True, exist_ok=True)

    async def open(self, spec: SandboxSpec) -> "LocalSandbox":
        """Create the prompt's folder (and its ``cwd`` inside it) and return its sandbox."""
        await self.check()
        async with self._starting:
            # On threads of their own: on a journaling file system, with hundreds of prompts at once, these few
            # system calls held the event loop about 1.5 ms a prompt.  Not the run's pool, which tools stuck
            # for ever (on FIFOs, say) may take whole.
            future = asyncio.get_running_loop().run_in_executor(_folder_executor(), self._make_folders, spec)
            try:
                root, cwd, tmp, control, owner = await asyncio.shield(future)
            except asyncio.CancelledError:
                future.add_done_callback(_remove_made)  # made all the same: nobody will close it
                raise
            except OSError as exc:
                raise SandboxError(f"Could not create the prompt folder under {self.run.scratch_dir}: {exc}") from exc
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": str(root),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "TERM": "dumb",
            "TMPDIR": str(tmp),
        }
        env.update({str(k): str(v) for k, v in spec.env.items()})
        # Started at the first command, or below as the sandbox opens when the prompt's tools run commands: a
        # prompt that runs none (or only file tools) never pays for it.  Its control folders (the commands'
        # scripts and output FIFOs) are out of the prompt folder's view.
        namespace = None
        if self.launcher.namespace:
            options = self.boundary.sandbox_options(str(root), owner) + self._options if self.boundary else ()
            namespace = Namespace(self.launcher, env, control, str(root) + CONTROL_SUFFIX, self.config.nice, options,
                                  self._nat)
        marker = secrets.token_hex(8)
        if namespace is None:
            env[MARKER_VARIABLE] = marker  # how close finds the prompt's processes
        sandbox = LocalSandbox(root, cwd, env, self, SandboxFolder(str(root), str(cwd), owner), namespace, marker)
        self._open.add(sandbox)
        if namespace is not None and spec.commands:
            # Its tools run commands: the namespace starts now, beside the first model request (the sandbox
            # opens then), not on the first command's clock.  With hundreds of prompts at once that start
            # waited for the CPU for about half a second.
            sandbox.start_namespace()
        return sandbox

    def _make_folders(self, spec: SandboxSpec) -> tuple:
        """The prompt folder, its ``cwd`` and ``.tmp``, the path of its control folder (made in memory), and the
        (uid, gid) its commands run as when not the runner's (the folders are theirs)."""
        scratch = self.run.scratch_dir
        scratch.mkdir(parents=True, exist_ok=True)
        prefix = f"p{spec.prompt_index}-{spec.content_key[:8]}-"
        root = Path(os.path.realpath(tempfile.mkdtemp(prefix=prefix, dir=scratch)))
        owner = self.boundary.new_owner() if self.boundary is not None else None
        try:
            cwd = _map_inside(root, spec.cwd)
            cwd.mkdir(parents=True, exist_ok=True)
            tmp = root / ".tmp"
            tmp.mkdir()
            if owner is not None:
                for folder in {root, tmp, *(parent for parent in cwd.parents if root in parent.parents), cwd}:
                    os.chown(folder, *owner, follow_symlinks=False)
            control = str(root) + CONTROL_SUFFIX
            if self._control is not None:
                control = self._control.folder(root.name + CONTROL_SUFFIX)
                os.mkdir(control, 0o700)
        except BaseException:
            remove_tree(root)
            raise
        return root, cwd, tmp, control, owner

    async def shutdown(self) -> None:
        for sandbox in list(self._open):
            await sandbox.close()
        try:
            self.run.scratch_dir.rmdir()  # only when empty: kept folders stay
        except OSError:
            pass
        if self._control is not None:
            control, self._control = self._control, None
            await in_daemon_thread(control.remove)

    def _forget(self, sandbox: "LocalSandbox") -> None:
        self._open.discard(sandbox)


def _map_inside(root: Path, cwd: Optional[str]) -> Path:
    """The folder inside ``root`` that stands for ``cwd``: the prompt folder acts as ``/``."""
    if not cwd:
        return root
    inside = posixpath.normpath(posixpath.join("/", cwd)).lstrip("/")
    return root / inside if inside else root


def _remove_trees(paths: list) -> None:
    for path in paths:
        remove_tree(path)


def _free_bytes(path: Path) -> Optional[int]:
    try:
        found = os.statvfs(path)
    except OSError:
        return None
    return found.f_bavail * found.f_frsize


def _seen(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # the first command reports it; no "exception never retrieved" when none runs


@functools.cache
def _folder_executor() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(FOLDER_THREADS, thread_name_prefix="hermes-batch-folders")


def _remove_made(future: asyncio.Future) -> None:
    """Remove the folders ``LocalSandboxBackend._make_folders`` made for a prompt whose open was cancelled."""
    if future.cancelled() or future.exception() is not None:
        return
    root, _cwd, _tmp, control, _owner = future.result()
    threading.Thread(target=_remove_trees, args=([root, Path(control)],), daemon=True).start()


class LocalSandbox(Sandbox):
    """One prompt's folder; commands run in it as ``/bin/sh -c`` subprocesses with a clean environment."""

    def __init__(
        self, root: Path, cwd: Path, env: dict, backend: LocalSandboxBackend, folder: SandboxFolder,
        namespace: Optional[Namespace] = None, marker: str = "",
    ):
        self.root = root
        self.cwd = cwd
        self.env = env
        self._backend = backend
        self._launcher = backend.launcher
        self._folder = folder
        self._namespace = namespace
        self._marker = marker
        # process mode: close reads only processes started since (a tick of slack: start times are rounded down)
        self._opened = ticks_since_boot() - 1 if namespace is None else 0
        self._keep = backend.config.keep
        self._max_output = backend.config.max_output_bytes
        # Process mode: leaders of commands whose sessions kept members, held unreaped (so their session
        # ids cannot pass to other processes) until close has killed those members.
        self._held: list[ChildProcess] = []
        self._commands = 0  # commands run through the namespace's helper, which numbers them
        self._spill_made = False  # the spill folder beside the prompt folder, made at its first use
        self._starting: Optional[asyncio.Task] = None  # the namespace's start, begun at open
        self._closed = False
        boundary = backend.boundary if namespace is not None else None
        self._disk_limit = boundary.disk if boundary is not None else 0  # bytes the prompt's folder may take
        self._free: Optional[int] = None  # the disk's free bytes when the folder was last measured

    @property
    def workdir(self) -> str:
        return str(self.cwd)

    def start_namespace(self) -> None:
        """Start the prompt's namespace in the background, ahead of its first command."""
        if self._starting is None and self._namespace is not None and not self._closed:
            self._starting = asyncio.get_running_loop().create_task(self._namespace.ensure(str(self.cwd)))
            self._starting.add_done_callback(_seen)

    async def exec(self, command: str, timeout: float) -> ExecResult:
        """Run ``command`` with ``/bin/sh -c``; at ``timeout`` SIGKILL its whole process group."""
        self._check_open()
        namespace = self._namespace
        if namespace is not None:
            try:
                if self._starting is not None:
                    await asyncio.shield(self._starting)  # its error is the first command's
                await namespace.ensure(str(self.cwd))
            except (OSError, RuntimeError) as exc:
                raise SandboxError(f"Could not start the namespace of the local sandbox {self.root}: {exc}") from exc
            if not namespace.alive:
                raise SandboxError(f"The namespace of the local sandbox {self.root} ended; its processes are gone.")
            if namespace.control is not None:
                return await self._exec_in_helper(namespace, command, timeout)
        argv = self._launcher.command_argv(command, str(self.cwd), namespace.init_pid if namespace else None)
        try:
            # The shell leads a new session and process group; ours to signal until _settle reaps it.
            result = await run_command(
                argv, timeout, cwd=self.cwd, env=self.env, max_output_bytes=self._max_output,
                nicer=self._backend.config.nice, settle=self._settle,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise SandboxError(f"Could not run a command in the local sandbox {self.cwd}: {exc}") from exc
        if namespace is not None and not namespace.alive and not self._closed:
            raise SandboxError(f"The namespace of the local sandbox {self.root} ended while a command ran "
                               f"({await namespace.end_reason()}); the prompt's processes are gone.")
        if len(self._held) >= HELD_BEFORE_CHECK:
            await self._release_alone()
        return result

    async def _exec_in_helper(self, namespace: Namespace, command: str, timeout: float,
                              tests_env: Optional[bytes] = None) -> ExecResult:
        """``exec`` through the namespace's helper: the command as a file, its output through a FIFO.

        With ``tests_env`` (their environment, :func:`~hermes_batch.sandbox_blocks.grading.environment_block`) the
        command is a verifier's tests (``grading.h``); the result's ``report`` attribute is then their report.
        """
        if "\0" in command:
            raise ValueError("embedded null byte")  # as a command line refuses one: a tool error, as before
        loop = asyncio.get_running_loop()
        self._commands += 1
        ident = str(self._commands)
        text = os.fsencode(command)
        tests = tests_env is not None
        spilled = tests or namespace.spill != namespace.control and len(text) > SPILL_BYTES
        try:
            try:
                script, fifo, pipe = self._control_files(namespace.spill if spilled else namespace.control, ident, text,
                                                         tests_env)
            except OSError:
                if spilled or namespace.spill == namespace.control:
                    raise
                spilled = True  # the memory file system is full: the disk may not be
                script, fifo, pipe = self._control_files(namespace.spill, ident, text)
        except OSError as exc:
            raise SandboxError(f"Could not run a command in the local sandbox {self.cwd}: {exc}") from exc
        eof = loop.create_future()
        transport = None
        started = ended = watch = report = None
        if self._disk_limit and self._free is None:
            self._free = _free_bytes(self.root)
        timed_out = killed_by_us = False
        try:
            transport, output = await loop.connect_read_pipe(lambda: OutputPipe(self._max_output, eof), pipe)
            try:
                started, ended, report = namespace.submit(ident, spilled, tests)
            except OSError as exc:
                raise SandboxError(f"Could not run a command in the local sandbox {self.cwd}: {exc}") from exc
            waited = min(timeout, WATCH_AFTER_S) if self._disk_limit else timeout
            running = await wait_for_command(ended, eof, waited)
            if running and waited < timeout:  # long enough to fill the disk: measure its folder while it runs
                watch = loop.create_task(self._watch_disk(namespace, started))
                running = await wait_for_command(ended, eof, timeout - waited)
            if running:
                timed_out = killed_by_us = not ended.done()
                await self._kill_in_helper(namespace, started)
                await asyncio.wait((eof, ended), timeout=POST_KILL_DRAIN_S)
        finally:
            if watch is not None and not watch.done():
                watch.cancel()
            if started is not None and not ended.done():
                await asyncio.shield(self._kill_in_helper(namespace, started))  # also when the caller cancels us
            if transport is not None:
                transport.close()
            else:
                pipe.close()
            namespace.forget(ident)
            # A helper that removes them does so once it has opened them (what a failed start leaves goes
            # with the control folder at close): unlinking them here cost the event loop 0.4 ms a prompt.
            taken = started is not None and started.done() and started.result() is not None
            if not (taken and namespace.launcher.removes_command_files):
                for path in (script, fifo, *((script[:-3] + ".env",) if tests else ())):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
        status = ended.result() if ended.done() else None
        if tests:
            return _Reported(output.text(), None if killed_by_us else status, timed_out,
                             report.result() if report.done() else None)
        if status is None and not killed_by_us and not self._closed:
            raise SandboxError(f"The namespace of the local sandbox {self.root} ended while a command ran "
                               f"({await namespace.end_reason()}); the prompt's processes are gone.")
        if self._disk_limit:
            stopped = watch.result() if watch is not None and watch.done() and not watch.cancelled() else ""
            over = stopped or await self._disk_checked()
            if over:
                return ExecResult(
                    f"{output.text()}\n[the prompt's folder exceeded -S disk={self._backend.config.disk} ({over}); "
                    f"{'the command was stopped' if stopped else 'the command failed'}: remove files to go on]\n",
                    status or 1, timed_out,
                )
        return ExecResult(output.text(), None if killed_by_us else status, timed_out)

    async def _watch_disk(self, namespace: Namespace, started: asyncio.Future) -> str:
        """Measure the prompt's folder while a command runs; once over ``disk``, kill the command and say why."""
        while True:
            began = time.monotonic()
            over = await in_daemon_thread(folder_over, str(self.root), self._disk_limit)
            if over:
                await self._kill_in_helper(namespace, started)
                self._free = _free_bytes(self.root)  # the next command fails only if the folder grows again
                return over
            await asyncio.sleep(max(WATCH_EVERY_S, 4 * (time.monotonic() - began)))

    async def _disk_checked(self) -> str:
        """After a command: why the prompt's folder is over ``disk``, measured when the disk's free space fell by a
        quarter of the limit since it last was (else ``""``)."""
        free = _free_bytes(self.root)
        if free is None or self._free is None or free >= self._free:
            self._free = free  # more free space (others removed files): falls are counted from here
            return ""
        if self._free - free < self._disk_limit // 4:
            return ""
        self._free = free
        return await in_daemon_thread(folder_over, str(self.root), self._disk_limit)

    def _control_files(self, folder: str, ident: str, text: bytes, env: Optional[bytes] = None) -> tuple:
        """The command's script and output FIFO in ``folder`` (made if missing), the FIFO open to read; with
        ``env``, also the tests' environment ``<ident>.env``."""
        if folder == self._namespace.spill and not self._spill_made:
            os.makedirs(folder, 0o700, exist_ok=True)
            self._spill_made = True
        script, fifo = os.path.join(folder, ident + ".sh"), os.path.join(folder, ident + ".out")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            if env is not None:
                with open(os.open(script[:-3] + ".env", flags, 0o600), "wb") as f:
                    f.write(env)
            # The prompt's commands can reach these folders: never follow a link one of them put here.
            with open(os.open(script, flags, 0o600), "wb") as f:
                f.write(text)
            os.mkfifo(fifo, 0o600)
            # opened before the helper opens it to write, so its open never waits for us
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
            pipe = os.fdopen(os.open(fifo, flags), "rb", buffering=0)
        except OSError:
            for path in (script, fifo, script[:-3] + ".env"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise
        return script, fifo, pipe

    @staticmethod
    async def _kill_in_helper(namespace: Namespace, started: asyncio.Future) -> None:
        try:
            async with asyncio.timeout(POST_KILL_DRAIN_S):  # not wait_for: see Namespace.kill
                pgid = await asyncio.shield(started)
        except TimeoutError:
            return
        if pgid is not None:
            namespace.kill_group(pgid)

    def _settle(self, child: ChildProcess) -> None:
        """Reap a command's shell; in process mode hold it until its session is known to be empty."""
        if self._namespace is None:
            self._held.append(child)  # `cmd &` may live on: close kills it by session while we hold it
        else:
            child.reap()

    async def _release_alone(self) -> None:
        # One scan of /proc, off the event loop, for every shell held: those whose sessions are empty
        # need no holding.
        members = await in_daemon_thread(session_members)
        for child in [child for child in self._held if alone(child.pid, members)]:
            if child in self._held:  # another command of this prompt may have released it meanwhile
                self._held.remove(child)
                child.reap()

    def _control_folders(self) -> list:
        namespace = self._namespace
        if namespace is None or namespace.control is None:
            return []
        folders = [Path(namespace.control)] if namespace.control != namespace.spill or self._commands else []
        return folders + ([Path(namespace.spill)] if self._spill_made and namespace.spill != namespace.control else [])

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("The local sandbox was already closed.")

    async def read_file(self, path: str, max_bytes: Optional[int] = None) -> bytes:
        """At most ``max_bytes`` bytes of the regular file ``path``; refuses paths outside the prompt folder.

        Runs in a daemon thread: nothing here can block (non-blocking opens of
        regular files only), and if the file system itself hangs, the abandoned
        call still lets the process exit.
        """
        self._check_open()
        return await in_daemon_thread(self._folder.read, path, max_bytes, name="hermes-batch-local-file")

    async def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``, creating parent folders; refuses paths outside the prompt folder."""
        self._check_open()
        await in_daemon_thread(self._folder.write, path, data, name="hermes-batch-local-file")

    async def stop_processes(self) -> bool:
        """Kill every process the prompt's commands left running; the namespace and the folder stay."""
        self._check_open()
        if self._namespace is not None:
            if not self._launcher.compiled:
                # bash's helper and nsenter's idle first process keep subshells of their own in the namespace
                return False
            # a command's kill -9 -1 in the prompt's PID namespace: the compiled helper is its one first process
            result = await self.exec(KILL_EVERY_OTHER_PROCESS, STOP_PROCESSES_TIMEOUT_S)
            return result.exit_code == 0
        await self._kill_marked()
        return True

    async def run_tests(self, command: str, files: tuple, timeout: float) -> TestsRun:
        """A verifier's tests in namespaces of their own, through the compiled helper (``grading.h``)."""
        self._check_open()
        why = self._backend.tests_apart_missing
        if why:
            raise NotImplementedError(f"the local sandbox cannot run tests apart from the agent here: {why}")
        namespace = self._namespace
        try:
            if self._starting is not None:
                await asyncio.shield(self._starting)
            await namespace.ensure(str(self.cwd))
        except (OSError, RuntimeError) as exc:
            raise SandboxError(f"Could not start the namespace of the local sandbox {self.root}: {exc}") from exc
        if not namespace.alive:
            raise SandboxError(f"The namespace of the local sandbox {self.root} ended; its processes are gone.")
        env = tests_environment(self.env.get("PATH"), (str(self.root), "/tmp", "/dev/shm"))
        result = await self._exec_in_helper(namespace, tests_script(command, files, str(self.cwd)), timeout,
                                            environment_block(env))
        if result.report is None:
            reward, problem = None, "the tests ended without a report"
        else:
            reward, problem = read_report(result.report)
        return TestsRun(ExecResult(result.output, result.exit_code, result.timed_out), reward, problem)

    async def copy_workdir_to(self, other: Sandbox) -> None:
        """Make ``other``'s working folder (a fresh local sandbox) what this one's is now (command:clean=true)."""
        self._check_open()
        if not isinstance(other, LocalSandbox):
            raise NotImplementedError("a local sandbox copies its working folder only into another local sandbox")
        other._check_open()

        def copy() -> None:
            empty_folder(str(other.cwd))
            copy_folder(str(self.cwd), str(other.cwd), other._folder.owner)

        try:
            await in_daemon_thread(copy, name="hermes-batch-local-copy")
        except OSError as exc:
            raise SandboxError(f"Could not copy the working folder {self.cwd} into a fresh sandbox: {exc}") from exc

    async def _kill_marked(self) -> None:
        """Process mode: kill the processes marked with the prompt's folder, then reap the sessions' leaders."""
        sessions = {child.pid for child in self._held}
        await in_daemon_thread(kill_prompt_processes, str(self.root), self._marker, sessions, self._opened)
        self._reap_held()

    def _reap_held(self) -> None:
        for child in self._held:
            child.reap()  # only now: their sessions' members are dead
        self._held.clear()

    async def close(self) -> None:
        """Kill every process the prompt started and remove the folder unless ``keep``."""
        if self._closed:
            return
        self._closed = True
        self._backend._forget(self)
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()  # what it started so far is killed (Namespace.start, ChildProcess.start)
            await asyncio.wait((self._starting,))
        if self._namespace is not None:
            await self._namespace.kill()
            self._reap_held()
        else:
            await self._kill_marked()
        self._folder.close()
        # The helper's control folders hold only FIFOs and scripts, so they go even when the prompt folder is
        # kept, in the same thread as the prompt folder otherwise.
        folders = self._control_folders()
        if self._keep:
            if folders:
                await in_daemon_thread(_remove_trees, folders)
            # renamed, so the next session's start tells it from a folder a killed session left (removed then)
            kept = self.root.with_name("kept-" + self.root.name)
            try:
                os.rename(self.root, kept)
                self.root = kept
            except OSError:
                pass
            log.info("Kept the local sandbox folder %s.", self.root)
            return
        await in_daemon_thread(_remove_trees, [self.root, *folders])


@attrs.frozen
class _Reported(ExecResult):
    """A verifier's tests' result through the helper, with the supervisor's report (None: it gave none)."""

    report: Optional[str] = None


@hermes_batch.hookimpl
def register_sandbox_backends(register):
    register(LocalSandboxBackend)
