"""The local sandbox's network: a namespace per prompt with user-mode NAT (pasta or slirp4netns), its fallback.

Traffic goes only to a server of the test on this machine's loopback, which the NAT maps to the namespace's
gateway address when asked (-S host_loopback=true)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_batch.contract.run_context import RunContext
from hermes_batch.errors import ConfigError
from hermes_batch.formats.records import SandboxSpec
from hermes_batch.local_sandbox import launchers, namespace_init, nat
from hermes_batch.local_sandbox.backend import LocalSandboxBackend, LocalSandboxConfig

# The gateway of the namespace's default route, from /proc/net/route (little-endian hex), then a fetch there.
FETCH = (
    "gw=$(awk '$2 == \"00000000\" { print $3 }' /proc/net/route | head -n 1); "
    "gw=$(printf '%d.%d.%d.%d' 0x${gw#??????} 0x$(echo $gw | cut -c5-6) 0x$(echo $gw | cut -c3-4) 0x${gw%??????}); "
    "echo gateway=$gw; curl -s -m 5 http://$gw:{port}/ || echo unreachable-gateway; "
    "curl -s -m 5 http://127.0.0.1:{port}/ || echo unreachable-loopback"
)
SERVED = b"HB-NAT-SERVED"


def spec(index: int = 0) -> SandboxSpec:
    return SandboxSpec("nat-test", index, f"{index:08d}feedface", commands=True)


@pytest.fixture(params=nat.PROGRAMS)
def program(request, monkeypatch):
    """Each NAT program in turn, as the only one found."""
    if shutil.which(request.param) is None:
        pytest.skip(f"{request.param} is not installed (scripts/test.sh --all installs it)")
    if namespace_init.compiler() is None or shutil.which("curl") is None:
        pytest.skip("the compiled helper takes a C compiler; the fetch takes curl")
    monkeypatch.setattr(nat, "PROGRAMS", (request.param,))
    monkeypatch.setattr(launchers, "_nats", {})
    return request.param


@pytest.fixture
async def server():
    """The port of an HTTP server on this machine's loopback that answers SERVED."""

    async def answer(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(SERVED), SERVED))
        await writer.drain()
        writer.close()

    listening = await asyncio.start_server(answer, "127.0.0.1", 0)
    yield listening.sockets[0].getsockname()[1]
    listening.close()
    await listening.wait_closed()


async def started(tmp_path: Path, **options) -> LocalSandboxBackend:
    backend = LocalSandboxBackend(LocalSandboxConfig(**options), RunContext("nat-test", tmp_path / "run", seed=0))
    await backend.start()
    return backend


async def test_a_prompt_reaches_the_machines_loopback_through_the_nat_only_when_asked(tmp_path, program, server):
    for loopback in (True, False):
        backend = await started(tmp_path / str(loopback), host_loopback=loopback)
        try:
            assert backend.isolation_details["network"] == "nat" and backend.isolation_details["nat"] == program
            sandbox = await backend.open(spec())
            fetched = await sandbox.exec(FETCH.replace("{port}", str(server)), 60)
            await sandbox.close()
        finally:
            await backend.shutdown()
        assert fetched.output.startswith("gateway=") and "unreachable-loopback" in fetched.output, fetched
        if loopback:  # through the NAT, from the namespace's gateway address to this machine's 127.0.0.1
            assert SERVED.decode() in fetched.output, fetched
        else:  # as with Docker's bridge, a listener of the machine on its loopback is out of reach
            assert SERVED.decode() not in fetched.output and "unreachable-gateway" in fetched.output, fetched


async def test_the_nat_program_ends_with_its_sandbox(tmp_path, program):
    backend = await started(tmp_path)
    try:
        sandbox = await backend.open(spec())
        assert (await sandbox.exec("echo up", 30)).output == "up\n"
        child = sandbox._namespace._attached._child
        assert child.exited.done() is False and Path(f"/proc/{child.pid}").exists()
        await sandbox.close()
        for _ in range(100):
            if child.exited.done() and not Path(f"/proc/{child.pid}").exists():
                break
            await asyncio.sleep(0.05)
        assert child.exited.done() and not Path(f"/proc/{child.pid}").exists()  # ended and reaped
    finally:
        await backend.shutdown()


async def test_without_a_nat_program_auto_says_so_and_nat_refuses(tmp_path, monkeypatch, caplog):
    if namespace_init.compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(nat, "PROGRAMS", ("hb-no-such-nat",))
    monkeypatch.setattr(launchers, "_nats", {})
    with caplog.at_level("WARNING", logger="hermes_batch.local_sandbox.backend"):
        backend = await started(tmp_path / "auto")
    await backend.shutdown()
    if not backend.launcher.boundary:
        pytest.skip(f"no namespaces here: {backend.launcher.reason}")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "without a network of their own" in warnings[0], warnings
    assert "neither pasta nor slirp4netns is installed (apt-get install passt" in warnings[0]
    details = backend.isolation_details  # what run.json records
    assert details["network"] == "host" and "nat" not in details
    assert any("neither pasta nor slirp4netns" in gap for gap in details["missing"]), details
    with pytest.raises(ConfigError, match=r"^-S network=nat cannot work on this machine \(neither pasta"):
        await started(tmp_path / "nat", network="nat")
    host = await started(tmp_path / "host", network="host")  # asked for: nothing said, nothing missing
    await host.shutdown()
    assert host.isolation_details["network"] == "host" and host.isolation_details["missing"] == []


async def test_a_resolver_on_the_machines_loopback_leaves_auto_on_the_host_network(tmp_path, monkeypatch):
    # systemd-resolved's 127.0.0.53 in resolv.conf: a namespace of its own would resolve no name
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("# made by the test\nnameserver 127.0.0.53\noptions edns0\n")
    monkeypatch.setattr(nat, "RESOLV_CONF", str(resolv))
    monkeypatch.setattr(launchers, "_nats", {})
    backend = await started(tmp_path)
    await backend.shutdown()
    if not backend.launcher.boundary:
        pytest.skip(f"no namespaces here: {backend.launcher.reason}")
    assert backend.isolation_details["network"] == "host"
    assert any("resolver is on its loopback (127.0.0.53)" in gap for gap in backend.isolation_details["missing"])
    resolv.write_text("nameserver 127.0.0.53\nnameserver 10.0.0.2\n")  # one the namespace reaches through the NAT
    assert nat.loopback_resolver() == ""


async def test_abstract_sockets_of_the_machine_and_of_other_prompts_are_out_of_reach(tmp_path, program):
    # What the hostile prompt did: serve on @hbabs in one prompt and read it from another, and read the
    # machine's unix and tcp tables.
    import socket

    own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    own.bind(f"\0hb-runner-{os.getpid()}")
    own.listen()
    backend = await started(tmp_path)
    try:
        first, second = await backend.open(spec(0)), await backend.open(spec(1))
        served = await first.exec("(printf SECRET | nc -lU @hbabs > /dev/null 2>&1 &) ; "
                                  "python3 -c 'import socket,time; s=socket.socket(socket.AF_UNIX); "
                                  "s.bind(\"\\0hbabs2\"); s.listen(); time.sleep(30)' > /dev/null 2>&1 & sleep 0.5; "
                                  "grep -c hbabs2 /proc/net/unix", 30)
        seen = await second.exec("grep -c -e hbabs2 -e hb-runner /proc/net/unix; echo; "
                                 "python3 -c 'import socket; socket.socket(socket.AF_UNIX).connect(\"\\0hbabs2\")' "
                                 "2>&1 | tail -n 1", 30)
        await first.close()
        await second.close()
    finally:
        await backend.shutdown()
        own.close()
    assert served.output.strip() == "1", served  # it listens, in its own namespace
    assert seen.output.startswith("0\n") and "ConnectionRefusedError" in seen.output, seen


SHARED_MOUNTS = r"""
import asyncio, os, subprocess, sys
from pathlib import Path
from hermes_batch.contract.run_context import RunContext
from hermes_batch.formats.records import SandboxSpec
from hermes_batch.local_sandbox import nat
from hermes_batch.local_sandbox.backend import LocalSandboxBackend, LocalSandboxConfig

base = Path(sys.argv[1])
nat.PROGRAMS = (sys.argv[2],)
# in this process's own mount namespace: a shared mount with a mount beneath it, as Docker's /var/lib/docker holds
# each running container's root file system
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(base / "shared")], check=True)
subprocess.run(["mount", "--make-shared", str(base / "shared")], check=True)
(base / "shared" / "container").mkdir()
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(base / "shared" / "container")], check=True)

async def main():
    backend = LocalSandboxBackend(LocalSandboxConfig(network="nat"), RunContext("r", base / "run", seed=0))
    await backend.start()
    sandbox = await backend.open(SandboxSpec("r", 0, "0123456789abcdef", commands=True))
    await sandbox.exec("true", 30)
    await sandbox.close()
    await backend.shutdown()

asyncio.run(main())
mounted = [line.split()[4] for line in open("/proc/self/mountinfo")]
print("still mounted" if str(base / "shared" / "container") in mounted else "gone")
"""


def test_the_nat_program_leaves_the_machines_shared_mounts_alone(tmp_path, program):
    # slirp4netns's sandbox detached its old root with only "/" made private: as root, every mount shared with the
    # machine's namespace went with it (Docker's running containers lost their root file systems).
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a mount namespace of the test's own takes root and util-linux unshare")
    (tmp_path / "shared").mkdir()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", SHARED_MOUNTS, str(tmp_path), program],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("still mounted"), done.stdout + done.stderr[-2000:]
