"""The contract every sandbox backend passes: one shared test suite, subclassed by each backend's tests.

A backend's test module subclasses :class:`SandboxContract` in a class whose name
starts with ``Test``, provides a ``backend`` fixture that yields a started
:class:`~hermes_batch.contract.interfaces.SandboxBackend` (and shuts it down afterwards),
and implements :meth:`SandboxContract.sandbox_exists`::

    class TestLocalSandboxContract(SandboxContract):
        @pytest.fixture
        async def backend(self, tmp_path):
            backend = LocalSandboxBackend(LocalSandboxBackend.Config(), RunContext("contract", tmp_path, seed=0))
            await backend.start()
            yield backend
            await backend.shutdown()

        async def sandbox_exists(self, sandbox):
            return sandbox.root.exists()

Set ``image`` to the image the tests run in (any image with a POSIX ``sh``,
``sleep``, ``env``, ``cat``, ``yes``, ``head``, ``dd``, ``ln``, ``mkfifo`` and
``setsid``, and for the network class one of ``nc``, ``wget`` and ``python3``:
busybox is enough), and ``image_marker`` to what its
``/etc/hermes-image`` holds, if it has one (the test images of
``scripts/docker.sh`` name themselves there), so that the image a sandbox
records is checked against the one it runs.  The tests use POSIX sh only.  Each test closes
the sandboxes it opened.  Tests of processes outliving ``close`` look for them
in this machine's ``/proc`` (:meth:`SandboxContract.processes_with`); a backend
whose processes run elsewhere overrides it.

What the contract fixes beyond the :class:`~hermes_batch.contract.interfaces.Sandbox`
docstrings: output is stdout and stderr merged and decoded as UTF-8 with
replacement characters; a command killed at its timeout has ``timed_out=True``
and ``exit_code=None``; a command's background processes that hold its output
open do not keep ``exec`` waiting past the timeout (the ``Sandbox`` docstring
asks more: ``exec`` returns when the command ends; the local backend's tests
check that); processes a command leaves running in the background (with their
output redirected) keep running, in the sandbox's one process namespace, until
the sandbox is closed; ``exec`` on a closed sandbox raises ``SandboxError``.

The hostile classes every backend must also pass: FIFOs, sockets and devices
are refused by the file API at once (``OSError`` with ``EINVAL``, or a refusal
of the path) and never block; ``read_file(path, max_bytes)`` returns at most
``max_bytes`` and keeps the runner's memory bounded on a 1 GiB file; links,
however swapped, never lead the file API to the runner's own files; and every
process a prompt started dies at ``close``, also one that left its session
with ``setsid`` or forked twice and changed folder like a daemon, and at
``stop_processes`` (which verification calls) while the files stay and commands
still run (:attr:`SandboxContract.stops_processes`: set it True, or False where
the backend says it cannot).

The boundary classes, for a hostile model: a sandbox cannot read a neighbour's
files, a marker in the invoking user's home (a temporary ``HOME`` set for the
test) or in the run folder; it writes nothing outside its folder on this
machine; a setuid-root program grants it nothing (:meth:`SandboxContract.setuid_program`
places one); it cannot exceed the memory, process or disk limits of the
``limited_backend`` fixture (:attr:`SandboxContract.limits`), and hitting one
fails the command, not the next prompt; with the ``offline_backend`` fixture
(``network=none``) it cannot reach a listener on this machine's loopback.  A
backend where a class does not apply says why in
:attr:`SandboxContract.not_applicable`, and the test is skipped with that
reason; the ``limited_backend`` and ``offline_backend`` fixtures skip unless
the subclass provides them.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import shutil
import time
from pathlib import Path
from typing import Awaitable, Callable, Optional

import pytest

from ..errors import SandboxError
from ..contract.interfaces import Sandbox, SandboxBackend
from ..formats.records import ExecResult, SandboxSpec, content_key

# Variables of the runner that must never reach a sandbox; set for every contract test.
LEAK_CANARIES = {
    "OPENROUTER_API_KEY": "leak-canary-openrouter",
    "OPENAI_API_KEY": "leak-canary-openai",
    "ANTHROPIC_API_KEY": "leak-canary-anthropic",
    "HERMES_BATCH_LEAK_CANARY": "leak-canary-hermes",
}

OpenSandbox = Callable[..., Awaitable[Sandbox]]

RUNNER_SECRET = b"RUNNER-ONLY-CONTENT"
_markers = itertools.count()


def unique_marker() -> str:
    """A word no other process of the machine has on its command line."""
    return f"hb-contract-{os.getpid()}-{time.monotonic_ns() % 10**9}-{next(_markers)}"


async def make_huge_files(sandbox: Sandbox, line: str, text_bytes: int) -> None:
    """``sparse``, a 1 GiB file of zeros that takes no disk, and ``text``, ``line`` repeated to ``text_bytes``."""
    made = await sandbox.exec(
        "dd if=/dev/zero of=sparse bs=1 count=0 seek=1073741824 2>/dev/null && "
        f"yes '{line}' | head -c {text_bytes} > text && echo made",
        120,
    )
    assert made.output == "made\n", made


def peak_rss_reset() -> Optional[int]:
    """Reset this process's peak resident size and return the current one (bytes); None if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")


def peak_rss() -> Optional[int]:
    """Peak resident size of this process since the last reset (bytes)."""
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class SandboxContract:
    """Shared tests of the sandbox contract; subclass it and provide a ``backend`` fixture."""

    #: Image the sandboxes are opened with (None: the backend's default).
    image: Optional[str] = None
    #: What ``/etc/hermes-image`` holds in the sandboxes of ``image`` and of the backend's default (None: not checked).
    image_marker: Optional[str] = None
    #: Seconds a timed-out ``exec`` may take beyond its timeout (container backends are slower).
    timeout_slack: float = 2.0
    #: Longest output, in characters, a command that prints forever may return.
    max_output_chars: int = 4_000_000
    #: Seconds a refused file call (FIFO, device) may take.
    refusal_slack: float = 10.0
    #: File calls made while a command swaps a link in a loop.
    race_reads: int = 400
    #: Most the runner's peak memory may grow while reading a 1 GiB file with a bound.
    max_read_growth: int = 64 * 1024 * 1024
    #: The limits the ``limited_backend`` fixture's sandboxes run with: bytes of memory (per process or per
    #: sandbox), processes, bytes a file and the sandbox's files in all may take; None where the backend has no such limit (say why in
    #: ``not_applicable``).
    limits: dict = {"memory": None, "pids": None, "disk": None}
    #: Whether ``Sandbox.stop_processes`` ends what the commands left running (False: it must say it cannot;
    #: None: the test is skipped when it says so).
    stops_processes: Optional[bool] = None
    #: Boundary classes that do not apply to this backend, with the reason: "neighbours", "home", "run_folder",
    #: "write_outside", "setuid", "memory", "pids", "disk", "network", "groups", "keyring", "ipc",
    #: "network_isolation", "first_process", "deep_tree", "init_kill".
    not_applicable: dict = {}

    async def sandbox_exists(self, sandbox: Sandbox) -> bool:
        """Whether the backend still holds the sandbox (its folder, container, instance)."""
        raise NotImplementedError(f"{type(self).__name__} must implement sandbox_exists()")

    async def processes_with(self, marker: str) -> list:
        """Pids of live processes whose command line holds ``marker`` (this machine's ``/proc``)."""
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                cmdline = Path(entry.path, "cmdline").read_bytes()
                state = Path(entry.path, "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if marker.encode() in cmdline and state not in (b"Z", b"X"):
                found.append(int(entry.name))
        return found

    # --- fixtures ----------------------------------------------------------------

    @pytest.fixture(autouse=True)
    def _leak_canaries(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # autouse, so set before the backend fixture: a backend that copies os.environ at start is caught too
        for name, value in LEAK_CANARIES.items():
            monkeypatch.setenv(name, value)

    @pytest.fixture
    async def open_sandbox(self, backend: SandboxBackend):
        """A factory ``await open_sandbox(cwd=None, env=None)`` whose sandboxes are closed after the test."""
        opened: list[Sandbox] = []
        prepared: set = set()

        async def open_(cwd: Optional[str] = None, env: Optional[dict] = None) -> Sandbox:
            if self.image not in prepared:
                await backend.prepare_image(self.image)
                prepared.add(self.image)
            index = len(opened)
            spec = SandboxSpec(
                run_name=backend.run.run_name,
                prompt_index=index,
                content_key=content_key(f"contract prompt {index}", self.image, cwd),
                image=self.image,
                cwd=cwd,
                env=dict(env or {}),
            )
            sandbox = await backend.open(spec)
            opened.append(sandbox)
            return sandbox

        yield open_
        for sandbox in opened:
            await sandbox.close()

    @pytest.fixture
    async def sandbox(self, open_sandbox: OpenSandbox) -> Sandbox:
        """One sandbox with default settings."""
        return await open_sandbox()

    @pytest.fixture
    async def limited_backend(self):
        """A started backend whose sandboxes run with :attr:`limits`; skipped unless the subclass gives one."""
        pytest.skip(self.not_applicable.get("memory", f"{type(self).__name__} gives no limited_backend"))
        yield None

    @pytest.fixture
    async def offline_backend(self):
        """A started backend whose sandboxes have no network (network=none); skipped unless the subclass gives one."""
        pytest.skip(self.not_applicable.get("network", f"{type(self).__name__} gives no offline_backend"))
        yield None

    @pytest.fixture
    def home_marker(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
        """A marker file in a temporary ``HOME`` of the invoking user, set before the backend starts."""
        home = tmp_path / "invoking-home"
        home.mkdir()
        marker = home / "hb-home-marker.txt"
        marker.write_bytes(RUNNER_SECRET)
        # what the user's cache held stays where it was (a backend may have built a program there)
        monkeypatch.setenv("XDG_CACHE_HOME", os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"))
        monkeypatch.setenv("HOME", str(home))
        return marker

    def _applies(self, name: str) -> None:
        if name in self.not_applicable:
            pytest.skip(f"not applicable to {type(self).__name__}: {self.not_applicable[name]}")

    async def group_only_file(self, sandbox: Sandbox) -> Optional[str]:
        """The path, as the sandbox's commands see it, of a file holding :data:`RUNNER_SECRET` that only a group of
        the invoking user may read (owned by another user), placed for ``sandbox``; None where the test cannot place
        one (say why in ``not_applicable["groups"]``)."""
        return None

    async def setuid_program(self, sandbox: Sandbox) -> Optional[str]:
        """The path, as the sandbox's commands see it, of a setuid-root program that prints the effective uid
        (a copy of ``id``) placed in ``sandbox``; None where the test cannot place one (say why in
        ``not_applicable["setuid"]``)."""
        return None

    # --- the image -------------------------------------------------------------------

    async def test_the_image_recorded_is_the_one_the_sandbox_runs(self, backend: SandboxBackend):
        # metadata.image is backend.image_for(spec): the row's image, else the backend's default, "" for none
        for index, image in enumerate((self.image, None)):
            spec = SandboxSpec(run_name=backend.run.run_name, prompt_index=900 + index,
                               content_key=content_key(f"image prompt {index}", image, None), image=image)
            await backend.prepare_image(image)
            sandbox = await backend.open(spec)
            try:
                recorded = backend.image_for(spec)
                assert sandbox.image == recorded
                if backend.ignores_images:
                    assert recorded == ""
                else:
                    default = getattr(backend.config, "image", None)
                    assert recorded and recorded == (image or default or recorded), (image, default)
                if self.image_marker is not None and recorded:
                    done = await sandbox.exec("cat /etc/hermes-image", 60)
                    assert done.output.strip() == self.image_marker
            finally:
                await sandbox.close()

    # --- exec ----------------------------------------------------------------------

    async def test_echo_output(self, sandbox: Sandbox):
        result = await sandbox.exec("echo hello", 30)
        assert result == ExecResult("hello\n", 0, False)

    async def test_exit_codes(self, sandbox: Sandbox):
        assert (await sandbox.exec("true", 30)).exit_code == 0
        assert (await sandbox.exec("false", 30)).exit_code == 1
        assert (await sandbox.exec("exit 3", 30)).exit_code == 3
        assert (await sandbox.exec("hb-no-such-command-xyz", 30)).exit_code == 127

    async def test_stderr_is_captured_with_stdout(self, sandbox: Sandbox):
        result = await sandbox.exec("echo to-stdout; echo to-stderr >&2; exit 2", 30)
        assert "to-stdout" in result.output
        assert "to-stderr" in result.output
        assert result.exit_code == 2

    async def test_output_is_utf8_with_replacement(self, sandbox: Sandbox):
        result = await sandbox.exec(r"printf '\303\251t\303\251 \377\n'", 30)
        assert result.output == "été \ufffd\n"

    async def test_shell_is_non_login_and_non_interactive(self, open_sandbox: OpenSandbox):
        # The startup files are written through the file API into the working directory and HOME
        # points there, so no shell command ever writes through a HOME the backend may have leaked.
        sandbox = await open_sandbox(env={"HOME": "hb-home", "ENV": "hb-home/.shrc"})
        for name in (".profile", ".bash_profile", ".bash_login", ".bashrc", ".shrc", ".kshrc"):
            await sandbox.write_file(f"hb-home/{name}", f"echo SOURCED-{name}\n".encode())
        control = await sandbox.exec('cat "$HOME/.profile" "$ENV"', 30)
        assert control.output == "echo SOURCED-.profile\necho SOURCED-.shrc\n"
        result = await sandbox.exec("case $- in *i*) echo interactive;; *) echo non-interactive;; esac", 30)
        assert result.output == "non-interactive\n"
        assert (await sandbox.exec("test -t 0 || echo no-tty", 30)).output == "no-tty\n"

    async def test_commands_run_concurrently(self, sandbox: Sandbox):
        started = time.monotonic()
        results = await asyncio.gather(*(sandbox.exec(f"sleep 1; echo {i}", 30) for i in range(8)))
        assert [r.output for r in results] == [f"{i}\n" for i in range(8)]
        assert time.monotonic() - started < 1 + 4 * self.timeout_slack

    # --- timeouts --------------------------------------------------------------------

    async def test_timeout_kills_the_whole_process_tree(self, sandbox: Sandbox):
        # A control started in the background by a command that ended proves that markers do get written.
        control = await sandbox.exec("(sleep 2; touch control-marker) > /dev/null 2>&1 &", 30)
        assert control.exit_code == 0 and not control.timed_out
        started = time.monotonic()
        result = await sandbox.exec("echo before; (sleep 2; touch killed-marker) & sleep 30", 1)
        elapsed = time.monotonic() - started
        assert result.timed_out
        assert result.exit_code is None
        assert "before" in result.output
        assert 1 <= elapsed < 1 + self.timeout_slack
        await asyncio.sleep(max(0.0, 1 + 3 - (time.monotonic() - started)))
        listing = await sandbox.exec("ls", 30)
        assert "control-marker" in listing.output
        assert "killed-marker" not in listing.output

    async def test_background_child_holding_output_does_not_hang(self, sandbox: Sandbox):
        started = time.monotonic()
        result = await sandbox.exec("sleep 30 & echo started", 1)
        elapsed = time.monotonic() - started
        assert "started" in result.output
        assert elapsed < 1 + self.timeout_slack

    async def test_endless_output_is_bounded(self, sandbox: Sandbox):
        result = await sandbox.exec("yes hermes-batch", 1)
        assert result.timed_out
        assert result.output.startswith("hermes-batch\nhermes-batch\n")
        assert len(result.output) <= self.max_output_chars

    async def test_huge_output_keeps_its_start_and_end(self, sandbox: Sandbox):
        result = await sandbox.exec("echo FIRST; yes filler | head -c 12000000; echo LAST", 60)
        assert result.exit_code == 0
        assert result.output.startswith("FIRST\n")
        assert result.output.endswith("LAST\n")
        assert "bytes of output omitted" in result.output
        assert len(result.output) <= self.max_output_chars

    async def test_cancelled_exec_kills_the_command(self, sandbox: Sandbox):
        task = asyncio.ensure_future(sandbox.exec("echo $$ > pid; exec sleep 60", 60))
        pid = None
        for _ in range(200):
            await asyncio.sleep(0.05)
            try:
                pid = int(await sandbox.read_file("pid"))
                break
            except (FileNotFoundError, ValueError):
                continue
        assert pid is not None, "the command never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(40):
            state = (await sandbox.exec(f"kill -0 {pid} 2>/dev/null && echo alive || echo gone", 10)).output
            if state == "gone\n":
                break
            await asyncio.sleep(0.05)
        assert state == "gone\n"

    # --- files -------------------------------------------------------------------------

    async def test_write_and_read_nested_binary_file(self, sandbox: Sandbox):
        data = bytes(range(256)) * 64
        await sandbox.write_file("nested/deeper/data.bin", data)
        assert await sandbox.read_file("nested/deeper/data.bin") == data
        result = await sandbox.exec("wc -c < nested/deeper/data.bin", 30)
        assert result.output.strip() == str(len(data))

    async def test_write_file_replaces_content(self, sandbox: Sandbox):
        await sandbox.write_file("notes.txt", b"a long first version\n")
        await sandbox.write_file("notes.txt", b"short\n")
        assert await sandbox.read_file("notes.txt") == b"short\n"

    async def test_relative_paths_are_relative_to_the_working_directory(self, sandbox: Sandbox):
        await sandbox.write_file("from-api.txt", b"written by write_file\n")
        assert (await sandbox.exec("cat from-api.txt", 30)).output == "written by write_file\n"
        await sandbox.exec("mkdir -p sub && printf 'written by exec' > sub/from-exec.txt", 30)
        assert await sandbox.read_file("sub/from-exec.txt") == b"written by exec"
        assert await sandbox.read_file("./sub/../sub/from-exec.txt") == b"written by exec"

    async def test_workdir_is_where_commands_start(self, sandbox: Sandbox):
        pwd = (await sandbox.exec("pwd", 30)).output.strip()
        assert pwd == sandbox.workdir
        await sandbox.write_file(f"{sandbox.workdir}/absolute.txt", b"abs")
        assert (await sandbox.exec("cat absolute.txt", 30)).output == "abs"

    async def test_missing_file_raises_file_not_found(self, sandbox: Sandbox):
        with pytest.raises(FileNotFoundError):
            await sandbox.read_file("no-such-file.txt")

    async def test_cwd_is_honoured_and_created(self, open_sandbox: OpenSandbox):
        sandbox = await open_sandbox(cwd="/hb-contract/project")
        assert sandbox.workdir.endswith("/hb-contract/project")
        assert (await sandbox.exec("pwd", 30)).output.strip() == sandbox.workdir
        await sandbox.write_file("main.txt", b"in cwd")
        assert (await sandbox.exec("cat main.txt", 30)).output == "in cwd"

    # --- environment -----------------------------------------------------------------------

    async def test_runner_environment_does_not_leak(self, open_sandbox: OpenSandbox):
        sandbox = await open_sandbox(env={"HB_CONTRACT_VAR": "hello world"})
        result = await sandbox.exec("env", 30)
        assert result.exit_code == 0
        assert "HB_CONTRACT_VAR=hello world" in result.output
        for value in LEAK_CANARIES.values():
            assert value not in result.output
        assert (await sandbox.exec('printf %s "$HB_CONTRACT_VAR"', 30)).output == "hello world"

    # --- lifecycle -----------------------------------------------------------------------

    async def test_close_is_idempotent_and_final(self, open_sandbox: OpenSandbox):
        sandbox = await open_sandbox()
        await sandbox.write_file("keep-me.txt", b"x")
        assert await self.sandbox_exists(sandbox)
        await sandbox.close()
        await sandbox.close()
        assert not await self.sandbox_exists(sandbox)
        with pytest.raises(SandboxError):
            await sandbox.exec("echo after close", 30)

    async def test_sandboxes_do_not_see_each_others_files(self, open_sandbox: OpenSandbox):
        first = await open_sandbox()
        second = await open_sandbox()
        await first.write_file("secret-of-first.txt", b"first")
        await first.exec("echo first > made-by-exec.txt", 30)
        with pytest.raises(FileNotFoundError):
            await second.read_file("secret-of-first.txt")
        listing = (await second.exec("ls -a", 30)).output
        assert "secret-of-first.txt" not in listing
        assert "made-by-exec.txt" not in listing
        assert await first.read_file("made-by-exec.txt") == b"first\n"

    # --- hostile files ----------------------------------------------------------------------

    async def _refused(self, call: Awaitable) -> OSError:
        started = time.monotonic()
        with pytest.raises(OSError) as info:
            await asyncio.wait_for(call, self.refusal_slack * 2)
        assert time.monotonic() - started < self.refusal_slack
        return info.value

    async def test_fifos_are_refused_without_blocking(self, sandbox: Sandbox):
        assert (await sandbox.exec("mkfifo pipe && ln -s pipe pipe-link", 30)).exit_code == 0
        for path in ("pipe", "pipe-link"):
            assert (await self._refused(sandbox.read_file(path))).errno == errno.EINVAL
            assert (await self._refused(sandbox.read_file(path, max_bytes=10))).errno == errno.EINVAL
            assert (await self._refused(sandbox.write_file(path, b"x"))).errno == errno.EINVAL
        assert (await sandbox.exec("[ -p pipe ] && echo still-a-fifo", 30)).output == "still-a-fifo\n"

    async def test_devices_are_refused_without_blocking(self, sandbox: Sandbox):
        await sandbox.exec("ln -s /dev/zero zero-link; ln -s /dev/null null-link", 30)
        for path in ("zero-link", "/dev/zero", "/dev/urandom"):
            await self._refused(sandbox.read_file(path))
        for path in ("null-link", "/dev/null"):
            await self._refused(sandbox.write_file(path, b"x"))

    async def test_reads_are_bounded_by_max_bytes(self, sandbox: Sandbox):
        await sandbox.exec("printf 0123456789 > ten; : > empty; mkdir folder", 30)
        assert await sandbox.read_file("ten", max_bytes=4) == b"0123"
        assert await sandbox.read_file("ten", max_bytes=100) == b"0123456789"
        assert await sandbox.read_file("ten", max_bytes=0) == b""
        assert await sandbox.read_file("ten") == b"0123456789"
        assert await sandbox.read_file("empty", max_bytes=10) == b""
        with pytest.raises(IsADirectoryError):
            await sandbox.read_file("folder", max_bytes=10)
        with pytest.raises(FileNotFoundError):
            await sandbox.read_file("missing", max_bytes=10)

    async def test_huge_files_keep_the_runners_memory_bounded(self, sandbox: Sandbox):
        await make_huge_files(sandbox, "a line of text", 40_000_000)
        baseline = peak_rss_reset()
        if baseline is None:
            pytest.skip("this kernel cannot reset the peak resident size (/proc/self/clear_refs)")
        assert await sandbox.read_file("sparse", max_bytes=65536) == bytes(65536)
        assert await sandbox.read_file("text", max_bytes=1000) == (b"a line of text\n" * 100)[:1000]
        assert await sandbox.read_file("text", max_bytes=4_000_000) == (b"a line of text\n" * 266_667)[:4_000_000]
        assert peak_rss() - baseline < self.max_read_growth

    async def test_links_never_lead_to_the_runners_files(self, sandbox: Sandbox, tmp_path: Path):
        secret = tmp_path / "runner-secret.txt"
        secret.write_bytes(RUNNER_SECRET)
        folder = tmp_path / "runner-folder"
        folder.mkdir()
        await sandbox.exec(f"ln -s '{secret}' file-link; ln -s '{folder}' dir-link; ln -s / root-link", 30)
        for path in ("file-link", f"root-link{secret}", "dir-link/../runner-secret.txt", str(secret)):
            try:
                data = await sandbox.read_file(path)
            except OSError:
                continue
            assert RUNNER_SECRET not in data, path
        for path in ("file-link", "dir-link/new.txt", f"root-link{folder}/new.txt", str(folder / "new.txt")):
            try:
                await sandbox.write_file(path, b"overwritten")
            except OSError:
                continue
        assert secret.read_bytes() == RUNNER_SECRET
        assert list(folder.iterdir()) == []

    async def test_a_folder_swapped_for_a_link_never_leads_out(self, sandbox: Sandbox, tmp_path: Path):
        # The race of a path check followed by an open: a folder of the sandbox, checked, then
        # replaced by a link to the runner's files before the open.
        outside = tmp_path / "runner-folder"
        outside.mkdir()
        (outside / "f").write_bytes(RUNNER_SECRET)
        await sandbox.write_file("real/f", b"inside")
        await sandbox.write_file("swap/f", b"inside")
        swapper = asyncio.ensure_future(sandbox.exec(
            f"while :; do mv swap held; mv real swap; mv swap real; ln -s '{outside}' swap; rm swap; "
            f"mv held swap; ln -sfn real link; ln -sfn '{outside}' link; done",
            300,
        ))
        try:
            reads = 0
            for _ in range(self.race_reads):
                for path in ("swap/f", "link/f"):
                    try:
                        data = await sandbox.read_file(path)
                    except OSError:
                        continue
                    reads += 1
                    assert data == b"inside", path
                    try:
                        await sandbox.write_file(path, b"inside")
                    except OSError:
                        pass
            assert reads, "every read failed: the race was not exercised"
        finally:
            swapper.cancel()
            await asyncio.gather(swapper, return_exceptions=True)
        assert (outside / "f").read_bytes() == RUNNER_SECRET
        assert sorted(p.name for p in outside.iterdir()) == ["f"]

    # --- processes that try to outlive their prompt ------------------------------------------------

    async def _leave_processes(self, sandbox: Sandbox, first: str) -> list:
        """Start, and see running, three processes that outlive their command: ``first`` (a shell's code) out of its
        session; one forked twice and in another folder like a daemon; an ordinary background job.  Their markers."""
        markers = [unique_marker() for _ in range(3)]
        started = await sandbox.exec(
            f"setsid sh -c '{first}; :' {markers[0]} > /dev/null 2>&1 & "
            f"(cd / && setsid sh -c 'sleep 600; :' {markers[1]} > /dev/null 2>&1 &) ; "
            f"sh -c 'sleep 600; :' {markers[2]} > /dev/null 2>&1 & echo started",
            30,
        )
        assert started.output == "started\n"
        for marker in markers:
            assert await self._eventually(lambda m=marker: self.processes_with(m)), f"{marker} never started"
        return markers

    async def test_processes_that_left_the_session_die_at_close(self, open_sandbox: OpenSandbox):
        sandbox = await open_sandbox()
        markers = await self._leave_processes(sandbox, "sleep 600")
        await sandbox.close()
        for marker in markers:
            assert await self._eventually(lambda m=marker: self._gone(m)), f"{marker} outlived close"

    async def test_stop_processes_ends_what_the_commands_left_and_keeps_the_rest(self, open_sandbox: OpenSandbox):
        sandbox = await open_sandbox()
        markers = await self._leave_processes(sandbox, "while :; do echo x >> ticks; sleep 0.02; done")  # writes on
        await sandbox.write_file("kept.txt", b"kept")
        stopped = await sandbox.stop_processes()
        if self.stops_processes is None and stopped is False:
            await sandbox.close()
            pytest.skip("the backend cannot stop a sandbox's processes (stop_processes returned False)")
        assert stopped is bool(self.stops_processes)  # False: said, so that verification warns
        if not stopped:
            await sandbox.close()
            return
        for marker in markers:
            assert await self._eventually(lambda m=marker: self._gone(m)), f"{marker} outlived stop_processes"
        ticks = await sandbox.read_file("ticks")
        await asyncio.sleep(0.3)
        assert await sandbox.read_file("ticks") == ticks  # nothing writes on
        assert await sandbox.read_file("kept.txt") == b"kept"
        assert (await sandbox.exec("echo alive", 30)).output == "alive\n"
        await sandbox.close()

    async def _gone(self, marker: str) -> bool:
        return not await self.processes_with(marker)

    async def _eventually(self, condition, timeout: float = 10.0):
        """``await condition()`` once it is truthy, or its last value at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            value = await condition()
            if value or time.monotonic() >= deadline:
                return value
            await asyncio.sleep(0.05)

    # --- the boundary: what a hostile model cannot reach ----------------------------------------------

    async def test_a_neighbours_files_cannot_be_read(self, open_sandbox: OpenSandbox):
        self._applies("neighbours")
        first = await open_sandbox()
        second = await open_sandbox()
        await first.write_file("neighbour-secret.txt", RUNNER_SECRET)
        await first.exec("echo $$ > neighbour-pid; sleep 300 > /dev/null 2>&1 &", 30)
        folder = first.workdir
        seen = await second.exec(
            f"cat '{folder}/neighbour-secret.txt' ../*/neighbour-secret.txt ../../*/*/neighbour-secret.txt "
            f"/proc/*/cwd/neighbour-secret.txt 2>/dev/null; ls -a '{folder}' .. 2>/dev/null",
            30,
        )
        assert RUNNER_SECRET.decode() not in seen.output
        assert "neighbour-pid" not in seen.output
        assert await first.read_file("neighbour-secret.txt") == RUNNER_SECRET

    async def test_a_marker_in_the_invoking_users_home_cannot_be_read(self, home_marker: Path, open_sandbox: OpenSandbox):
        self._applies("home")
        sandbox = await open_sandbox()
        seen = await sandbox.exec(  # errors would name the paths tried: only what was read counts
            f"cat '{home_marker}' ~/hb-home-marker.txt 2>/dev/null; ls -a '{home_marker.parent}' 2>/dev/null", 30)
        assert RUNNER_SECRET.decode() not in seen.output
        assert home_marker.name not in seen.output

    async def test_a_marker_in_the_run_folder_cannot_be_read(self, backend: SandboxBackend, open_sandbox: OpenSandbox):
        self._applies("run_folder")
        sandbox = await open_sandbox()
        marker = Path(backend.run.run_dir) / "hb-run-marker.txt"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_bytes(RUNNER_SECRET)
        seen = await sandbox.exec(f"cat '{marker}' 2>/dev/null; ls -a '{marker.parent}' 2>/dev/null", 30)
        assert RUNNER_SECRET.decode() not in seen.output
        assert marker.name not in seen.output

    async def test_nothing_is_written_outside_the_folder(
        self, backend: SandboxBackend, home_marker: Path, open_sandbox: OpenSandbox, tmp_path: Path
    ):
        self._applies("write_outside")
        sandbox = await open_sandbox()
        name = unique_marker()
        targets = [tmp_path / name, Path(backend.run.run_dir) / name, home_marker.parent / name]
        for target in targets:
            await sandbox.exec(f"echo hostile > '{target}'; mkdir '{target}.d'", 30)
        await sandbox.exec(f"echo hostile > '{home_marker}'", 30)
        written = [str(target) for target in targets if target.exists() or Path(f"{target}.d").exists()]
        for target in targets:  # this test's own folders only
            shutil.rmtree(f"{target}.d", ignore_errors=True)
            if target.exists():
                target.unlink()
        assert written == []
        assert home_marker.read_bytes() == RUNNER_SECRET

    async def test_a_setuid_program_grants_nothing(self, open_sandbox: OpenSandbox):
        self._applies("setuid")
        sandbox = await open_sandbox()
        program = await self.setuid_program(sandbox)
        if program is None:
            pytest.skip(f"{type(self).__name__} places no setuid program")
        before = (await sandbox.exec("id -u", 30)).output.strip()
        after = await sandbox.exec(f"'{program}' -u", 30)
        assert after.output.strip() == before != "0", after

    async def _limited(self, name: str, limited_backend: SandboxBackend) -> tuple:
        self._applies(name)
        limit = self.limits.get(name)
        if limit is None:
            pytest.skip(f"{type(self).__name__} sets no {name} limit")
        sandboxes = []
        for index in range(2):
            spec = SandboxSpec(limited_backend.run.run_name, 800 + index,
                               content_key(f"limited {name} {index}", self.image, None), image=self.image)
            await limited_backend.prepare_image(self.image)
            sandboxes.append(await limited_backend.open(spec))
        return limit, sandboxes

    async def _after_limit(self, hit: ExecResult, sandboxes: list) -> None:
        """The command that hit a limit failed; the other sandbox, and the one that hit it, still work."""
        try:
            assert hit.exit_code != 0 or hit.timed_out, hit
            assert (await sandboxes[1].exec("echo unaffected", 60)).output == "unaffected\n"
        finally:
            for sandbox in sandboxes:
                await sandbox.close()

    async def test_memory_beyond_the_limit_fails_the_command(self, limited_backend: SandboxBackend):
        limit, sandboxes = await self._limited("memory", limited_backend)
        # the shell holds the whole substitution in memory
        hit = await sandboxes[0].exec(f"x=$(head -c {2 * limit} /dev/zero | tr '\\0' a); echo ${{#x}}", 120)
        assert hit.output.strip() != str(2 * limit), hit
        await self._after_limit(hit, sandboxes)

    async def test_processes_beyond_the_limit_fail_the_command(self, limited_backend: SandboxBackend):
        limit, sandboxes = await self._limited("pids", limited_backend)
        hit = await sandboxes[0].exec(
            f"i=0; while [ $i -lt {2 * limit} ]; do sleep 60 > /dev/null 2>&1 & i=$((i+1)); done; echo spawned $i", 60
        )
        assert f"spawned {2 * limit}" not in hit.output, hit
        assert any(word in hit.output.lower() for word in ("fork", "resource", "unavailable")), hit
        await self._after_limit(hit, sandboxes)

    async def test_a_file_beyond_the_disk_limit_fails_the_command(self, limited_backend: SandboxBackend):
        limit, sandboxes = await self._limited("disk", limited_backend)
        megabytes = limit // 1048576
        hit = await sandboxes[0].exec(f"dd if=/dev/zero of=big bs=1048576 seek={megabytes} count=2 2>&1", 60)
        size = (await sandboxes[0].exec("wc -c < big", 30)).output.strip()
        assert not size.isdigit() or int(size) <= limit, size
        await self._after_limit(hit, sandboxes)

    async def test_many_files_beyond_the_disk_limit_stop_the_command(self, limited_backend: SandboxBackend):
        limit, sandboxes = await self._limited("disk", limited_backend)
        # each file a sixteenth of the limit, eight times the limit in all, written over seconds
        count, size = 128, limit // 16
        hit = await sandboxes[0].exec(
            f"i=0; while [ $i -lt {count} ]; do head -c {size} /dev/zero > f$i || exit 1; i=$((i+1)); sleep 0.05; "
            "done; echo wrote $i", 120,
        )
        written = (await sandboxes[0].exec("ls | grep -c '^f'", 30)).output.split()
        assert f"wrote {count}" not in hit.output and int(written[0]) < count, (hit, written)
        await self._after_limit(hit, sandboxes)

    async def test_with_network_none_the_hosts_loopback_cannot_be_reached(self, offline_backend: SandboxBackend):
        self._applies("network")
        connections = []

        async def accept(reader, writer):
            connections.append(True)
            writer.close()

        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        spec = SandboxSpec(offline_backend.run.run_name, 850, content_key("offline", self.image, None), image=self.image)
        await offline_backend.prepare_image(self.image)
        sandbox = await offline_backend.open(spec)
        try:
            tried = await sandbox.exec(
                f"nc -w 2 127.0.0.1 {port} < /dev/null; "
                f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 2)'; "
                f"wget -q -T 2 -O - http://127.0.0.1:{port}/; echo tried; "
                "for tool in nc python3 wget; do command -v $tool > /dev/null && echo has-$tool; done",
                60,
            )
            assert "tried" in tried.output
            assert "has-" in tried.output, f"the image has none of nc, python3 and wget to try with: {tried}"
            await asyncio.sleep(0.5)
            assert connections == [], tried
        finally:
            await sandbox.close()
            server.close()
            await server.wait_closed()

    # --- the boundary, second round: groups, keyrings, IPC, sockets, the first process, deep trees -------------

    async def _python_probe(self, sandbox: Sandbox, *arguments: str) -> Optional[str]:
        """The output of :data:`PROBE` run with ``arguments`` by the image's ``python3``; None when it has none."""
        if not await self._has_python(sandbox):
            return None
        await sandbox.write_file("hb-probe.py", PROBE.encode())
        done = await sandbox.exec("python3 hb-probe.py " + " ".join(f"'{a}'" for a in arguments), 60)
        return done.output

    @staticmethod
    async def _has_python(sandbox: Sandbox) -> bool:
        found = await sandbox.exec("command -v python3 > /dev/null && python3 -c 'import ctypes' && echo has-python", 30)
        return found.output.strip() == "has-python"

    async def test_no_group_of_the_invoking_user_reaches_a_command(self, open_sandbox: OpenSandbox):
        self._applies("groups")
        sandbox = await open_sandbox()
        path = await self.group_only_file(sandbox)
        if path is None:
            pytest.skip(f"{type(self).__name__} places no file only a group of the invoking user may read")
        seen = await sandbox.exec(f"cat '{path}' 2>&1; id", 30)
        assert RUNNER_SECRET.decode() not in seen.output, seen

    async def test_the_runners_keyring_is_out_of_reach_and_prompts_share_none(self, open_sandbox: OpenSandbox):
        # A key in the runner's session keyring (a Kerberos cache, an fscrypt key) must not reach a command, and no
        # keyring may carry what one prompt writes to another.
        self._applies("keyring")
        description = unique_marker()
        secret = add_session_key(description, RUNNER_SECRET)
        first, second = await open_sandbox(), await open_sandbox()
        seen = await self._python_probe(first, "keys", description)
        if seen is None:
            pytest.skip("the image has no python3 (with ctypes) to call keyctl with")
        assert "searched" in seen, seen
        assert RUNNER_SECRET.decode() not in seen and (secret is None or f"found {secret}" not in seen), seen
        await self._python_probe(first, "add-key", description + "-prompt")
        crossed = await self._python_probe(second, "keys", description + "-prompt")
        assert "searched" in crossed and "PROMPT-KEY" not in crossed, crossed

    async def test_ipc_objects_are_the_prompts_own_and_end_with_it(self, open_sandbox: OpenSandbox):
        self._applies("ipc")
        first, second = await open_sandbox(), await open_sandbox()
        key = 0x4842000 + os.getpid() % 0x1000 * 0x10 + next(_markers) % 0x10
        made = await self._python_probe(first, "ipc-make", str(key))
        if made is None:
            pytest.skip("the image has no python3 (with ctypes) to make IPC objects with")
        assert "made shm" in made and "made msg" in made, made
        crossed = await self._python_probe(second, "ipc-find", str(key))
        assert "missing shm" in crossed and "missing msg" in crossed, crossed
        await first.close()
        for table in ("shm", "msg"):  # the machine's own tables: what a prompt made is not left there
            try:
                lines = Path(f"/proc/sysvipc/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            assert all(int(line.split()[0]) != key for line in lines), (table, hex(key))

    async def test_abstract_sockets_and_the_machines_network_tables_stay_out_of_reach(self, open_sandbox: OpenSandbox):
        self._applies("network_isolation")
        import socket

        marker = unique_marker()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            abstract.bind("\0" + marker)
            abstract.listen()
            port = f":{listener.getsockname()[1]:04X} "
            first, second = await open_sandbox(), await open_sandbox()
            tables = await first.exec("cat /proc/net/tcp /proc/net/tcp6 /proc/net/unix 2>/dev/null", 30)
            assert port not in tables.output and marker not in tables.output, "the machine's sockets are listed"
            served = await self._python_probe(first, "abstract-serve", marker + "-prompt")
            if served is not None:
                assert "serving" in served, served
                reached = await self._python_probe(second, "abstract-connect", marker + "-prompt")
                assert "refused" in reached and "PROMPT-SOCKET" not in reached, reached
                assert "refused" in await self._python_probe(second, "abstract-connect", marker), "the machine's"
        finally:
            listener.close()
            abstract.close()

    async def test_the_first_process_names_nothing_hidden(self, home_marker: Path, open_sandbox: OpenSandbox):
        # What /proc shows of the sandbox's first process (pid 1) names none of the folders hidden from the commands.
        self._applies("first_process")
        import hermes_batch
        import sys

        sandbox = await open_sandbox()
        seen = (await sandbox.exec("cat /proc/1/cmdline /proc/1/environ 2>/dev/null | tr '\\0' ' '", 30)).output
        hidden = [str(home_marker.parent), os.path.dirname(hermes_batch.__file__), os.environ["XDG_CACHE_HOME"]]
        if sys.prefix != sys.base_prefix:
            hidden.append(sys.prefix)
        assert [path for path in hidden if path in seen] == [], seen

    async def test_a_deep_and_locked_tree_goes_at_close(self, open_sandbox: OpenSandbox):
        # 3,000 folders deep (past PATH_MAX, and a recursion of any remover that recurses), some no longer writable
        # or readable by their owner.
        self._applies("deep_tree")
        sandbox = await open_sandbox()
        made = await sandbox.exec(
            "p=$(printf 'd/%.0s' $(seq 1000)); for i in 1 2 3; do mkdir -p $p && cd -P $p || exit 1; done; "
            "head -c 1048576 /dev/zero > deep; mkdir locked && echo x > locked/f && chmod 000 locked; "
            "mkdir ../ro && echo y > ../ro/f && chmod 500 ../ro; echo made", 120)
        assert made.output.startswith("made\n"), made  # (a backend may then say it cannot measure a locked folder)
        await sandbox.close()
        assert not await self.sandbox_exists(sandbox)

    async def test_signalling_the_first_process_is_survived_or_an_error_that_says_so(self, open_sandbox: OpenSandbox):
        # A command that signals pid 1 of its sandbox: the sandbox goes on, or the command fails with an error that
        # says what happened; never a result without an exit status or a timeout, which reads as nothing wrong.
        self._applies("init_kill")
        sandbox = await open_sandbox()
        try:
            done = await sandbox.exec("for s in TERM INT HUP USR1 USR2 QUIT; do kill -$s 1; done; sleep 1; echo after", 30)
        except SandboxError as exc:
            assert str(exc), "an error with no reason"
            return
        assert done.exit_code is not None or done.timed_out, done
        try:
            after = await sandbox.exec("echo next", 30)
        except SandboxError as exc:
            assert str(exc), "an error with no reason"
            return
        assert after.output == "next\n", after


def add_session_key(description: str, payload: bytes) -> Optional[int]:
    """Add a ``user`` key, for a minute, to this thread's session keyring and to the user session keyring (which a
    process without a session keyring of its own uses as one), as a runner's session may hold one; its id, None
    where the kernel has no keyrings."""
    import ctypes
    import platform

    calls = _KEY_CALLS.get(platform.machine())
    if calls is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    found = None
    for ring in (-5, -3):  # KEY_SPEC_USER_SESSION_KEYRING, KEY_SPEC_SESSION_KEYRING
        key = libc.syscall(calls[0], b"user", description.encode(), payload, len(payload), ctypes.c_int(ring))
        if key > 0:
            libc.syscall(calls[2], 15, ctypes.c_long(key), 60)  # KEYCTL_SET_TIMEOUT: gone in a minute
            found = key
    return found


_KEY_CALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}  # add_key, request_key, keyctl

# Run by the image's python3 in a sandbox (the hostile commands of the second round of boundary classes).
PROBE = r'''
import ctypes, errno, os, platform, socket, sys, time
CALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
what, arg = sys.argv[1], sys.argv[2]

def call(*args):
    result = libc.syscall(*args)
    return result if result >= 0 else "error " + errno.errorcode.get(ctypes.get_errno(), "?")

if what == "keys":
    add_key, request_key, keyctl = CALLS.get(platform.machine(), (-1, -1, -1))
    for ring in (-3, -4, -5):  # session, user, user session
        found = call(keyctl, 10, ctypes.c_int(ring), b"user", arg.encode(), 0)  # KEYCTL_SEARCH
        print("searched", ring, found)
        if isinstance(found, int):
            payload = ctypes.create_string_buffer(256)
            print("found", found, call(keyctl, 11, ctypes.c_long(found), payload, 256), payload.value.decode(errors="replace"))
    print("requested", call(request_key, b"user", arg.encode(), None, 0))
elif what == "add-key":
    add_key = CALLS.get(platform.machine(), (-1,))[0]
    for ring in (-3, -4, -5):
        print("added", ring, call(add_key, b"user", arg.encode(), b"PROMPT-KEY", 10, ctypes.c_int(ring)))
elif what == "ipc-make":
    key = int(arg)
    print("made shm" if libc.shmget(key, 1 << 20, 0o1666) >= 0 else "no shm", "made msg" if libc.msgget(key, 0o1666) >= 0 else "no msg")
elif what == "ipc-find":
    key = int(arg)
    print("missing shm" if libc.shmget(key, 0, 0) < 0 else "found shm", "missing msg" if libc.msgget(key, 0) < 0 else "found msg")
elif what == "abstract-serve":
    if os.fork() == 0:
        os.setsid()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind("\0" + arg)
        server.listen()
        print("serving", flush=True)
        os.close(1); os.close(2)
        server.settimeout(60)
        try:
            while True:
                connection, _ = server.accept()
                connection.sendall(b"PROMPT-SOCKET")
                connection.close()
        except OSError:
            os._exit(0)
    time.sleep(0.5)
elif what == "abstract-connect":
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect("\0" + arg)
        print("reached", client.recv(100))
    except OSError as exc:
        print("refused", exc)
'''
