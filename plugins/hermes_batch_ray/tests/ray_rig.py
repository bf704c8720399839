"""A real local Ray cluster for the tests: a head node and a second node on this machine, started once per session.

Both nodes are ``ray start`` processes of this virtualenv with a temporary
folder of their own; at the end every process whose command line names that
folder (GCS, raylets, workers, actors) is stopped by its id, so nothing else
on the machine is touched.  The fixture is imported by the test modules (no
conftest.py: a second one would shadow the core tests' helpers).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import pytest

RAY = str(Path(sys.executable).with_name("ray"))
NODE_CPUS = 2


@attrs.frozen
class RayCluster:
    address: str  # HOST:PORT of the head's GCS
    temp_dir: Path

    def processes(self, name: str = "") -> list[int]:
        """Ids of this cluster's processes whose command line holds ``name`` (all of them with "").

        They are the processes that name the cluster's temporary folder (GCS, raylets,
        monitors) and everything they started (workers, actors, agents, whose
        command lines Ray rewrites), found through their parents.
        """
        parents, cmdlines = {}, {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                cmdlines[int(entry.name)] = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            except OSError:
                continue
            state, parent = stat.rsplit(")", 1)[1].split()[:2]
            if state != "Z":  # a zombie is gone already, waiting for its parent to read its status
                parents[int(entry.name)] = int(parent)
        ours = {pid for pid, cmdline in cmdlines.items() if str(self.temp_dir).encode() in cmdline} - {os.getpid()}
        grew = True
        while grew:
            more = {pid for pid, parent in parents.items() if parent in ours} - ours
            ours |= more
            grew = bool(more)
        return sorted(pid for pid in ours if pid in parents and name.encode() in cmdlines.get(pid, b""))


_GIVEN: set = set()  # ports handed out already: a port closed at once may come back at the next call


def _free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def _node_ports() -> tuple:
    """Free ports for what a node would otherwise listen on at fixed defaults, so two clusters can share a machine
    (the suite under pytest-xdist starts one per test process that runs these tests)."""
    names = ("--metrics-export-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
             "--runtime-env-agent-port")
    return tuple(part for name in names for part in (name, str(_free_port())))


def _ray(*args: str, env: dict) -> None:
    proc = subprocess.run([RAY, *args], capture_output=True, text=True, env=env, timeout=180)
    if proc.returncode != 0:
        pytest.fail(f"ray {' '.join(args[:2])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


@pytest.fixture(scope="session")
def ray_cluster():
    # short: Ray's unix sockets live below it, and their paths may not exceed 107 bytes
    temp_dir = Path(tempfile.mkdtemp(prefix="hb13-ray-", dir="/tmp"))
    port = _free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    cluster = RayCluster(f"127.0.0.1:{port}", temp_dir)
    common = ("--num-cpus", str(NODE_CPUS), "--object-store-memory", str(80 * 1024 * 1024), "--disable-usage-stats")
    try:
        _ray("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--temp-dir", str(temp_dir),
             "--include-dashboard", "false", "--dashboard-port", str(_free_port()),
             *_node_ports(), *common, env=env)
        _ray("start", "--address", cluster.address, "--node-ip-address", "127.0.0.1", *_node_ports(), *common, env=env)
        _wait_for_nodes(cluster, 2, env)
        yield cluster
    finally:
        _stop(cluster)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_nodes(cluster: RayCluster, count: int, env: dict) -> None:
    script = (
        "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(1 for n in ray.nodes() if n['Alive']))"
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        out = subprocess.run([sys.executable, "-c", script, cluster.address], capture_output=True, text=True, env=env)
        if out.stdout.strip().isdigit() and int(out.stdout.strip()) >= count:
            return
        time.sleep(1)
    pytest.fail(f"the Ray cluster at {cluster.address} did not show {count} nodes")


def _stop(cluster: RayCluster) -> None:
    """SIGTERM, then SIGKILL, to every process of this cluster (found by its temporary folder)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = cluster.processes()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while cluster.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
