"""As an ordinary user: Apptainer with user namespaces and no setuid helper, the way clusters run it."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from hermes_batch import RunContext, SandboxSpec
from hermes_batch_singularity import SingularityBackend, SingularityConfig
from singularity_rig import IMAGE_B, instances_of

INTERFACES = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '"


@pytest.fixture
def shared_dir(apptainer_bin):
    """A folder the user can read and write (pytest's tmp_path is root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="unprivileged-", dir=Path(apptainer_bin).parent))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def test_an_ordinary_user_converts_images_and_runs_prompts_in_instances(
    tmp_path, shared_dir, run_name, images, user_apptainer_bin
):
    archive = shared_dir / "busybox-b.tar"
    shutil.copyfile(images.archive_b.removeprefix("docker-archive://"), archive)
    archive.chmod(0o644)
    (shared_dir / "cache" / "sif").mkdir(parents=True)
    (shared_dir / "cache" / "sif").chmod(0o777)  # the user's build writes the SIF there
    config = SingularityConfig(
        binary=f"{user_apptainer_bin}/apptainer",
        cache_dir=str(shared_dir / "cache"),
        image=f"docker-archive://{archive}",
        network="none",
        no_privs=False,  # what an ordinary user gets by default
    )
    backend = SingularityBackend(config, RunContext(run_name, tmp_path / "run", seed=0))
    await backend.start()
    try:
        await backend.prepare_image(None)  # converted by the user, without root
        [sif] = (shared_dir / "cache" / "sif").glob("*.sif")
        sandbox = await backend.open(SandboxSpec(run_name, 0, "0c0ffee", cwd="/work/project", env={"GREETING": "hi"}))
        [name] = instances_of(user_apptainer_bin, run_name)
        assert name == sandbox.name
        result = await sandbox.exec('id -u; cat /etc/hermes-image; pwd; echo "$GREETING"', 30)
        uid, marker, pwd, greeting = result.output.split()
        assert uid != "0" and marker == IMAGE_B and pwd == "/work/project" and greeting == "hi"
        assert (await sandbox.exec(INTERFACES, 30)).output.split() == ["lo"]
        assert (await sandbox.exec("echo changed > /etc/hermes-image && cat /etc/hermes-image", 30)).output == "changed\n"
        await sandbox.write_file("notes/a.txt", b"written")
        assert await sandbox.read_file("notes/a.txt") == b"written"
        started = time.monotonic()
        result = await sandbox.exec("(sleep 3; touch killed-marker) & sleep 60", 1)
        assert result.timed_out and time.monotonic() - started < 15
        await sandbox.exec("setsid sh -c 'sleep 600' > /dev/null 2>&1 &", 30)
        await asyncio.sleep(3)
        assert "killed-marker" not in (await sandbox.exec("ls", 30)).output
        await sandbox.close()
        assert instances_of(user_apptainer_bin, run_name) == []
        assert sif.stat().st_uid != 0  # made by the user's own build
    finally:
        await backend.shutdown()
