"""Harbor tasks through Apptainer: each environment built with the Docker engine and converted to a SIF once per
content, a failed build's log tail, and a task row graded in a real instance."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid

import pytest

from hermes_batch import RunContext, SandboxError, task_folders
from hermes_batch.testing import ToolLoopScript
from hermes_batch_singularity import SingularityBackend, SingularityConfig
from hermes_batch_singularity.task_images import sif_name

from singularity_rig import IMAGE_A, singularity_runner

read_task = task_folders.read_task


def make_task(root, name, extra="", test=None):
    """A task whose environment is unique to this test (so its Docker image is this test's to remove)."""
    folder = root / name
    for part in ("environment", "tests", "solution"):
        (folder / part).mkdir(parents=True)
    (folder / "task.toml").write_text('[metadata]\nkind = "hello"\n[verifier]\ntimeout_sec = 60\n')
    (folder / "instruction.md").write_text(f"Write hello.txt ({name}).\n")
    (folder / "environment" / "Dockerfile").write_text(f"FROM {IMAGE_A}\nLABEL test={root.name}\n{extra}")
    (folder / "tests" / "test.sh").write_text(test or (
        "if [ -f hello.txt ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"))
    (folder / "solution" / "solve.sh").write_text("echo hi > hello.txt\n")
    return folder


@pytest.fixture
def task_images(images):
    """The Docker images a test builds, removed after it (``images``: the busybox base is on the engine)."""
    made: list = []
    yield made
    if made:
        subprocess.run(["docker", "rmi", "-f", *made], capture_output=True)


def make_backend(tmp_path, run_name, **options) -> SingularityBackend:
    options.setdefault("cache_dir", str(tmp_path / "cache"))
    return SingularityBackend(SingularityConfig(**options), RunContext(run_name, tmp_path / "run", seed=0))


async def test_each_environment_is_built_and_converted_once(tmp_path, run_name, task_images):
    suite = tmp_path / f"s{uuid.uuid4().hex[:8]}"
    a, b = (read_task(make_task(suite, n)) for n in ("a", "b"))
    d = read_task(make_task(suite, "d", extra="RUN echo other > /etc/other\nWORKDIR /srv/d\n"))
    task_images.extend({a.image, d.image})
    assert a.image == b.image != d.image
    backend = make_backend(tmp_path, run_name, max_builds=2)
    await backend.start()
    try:
        await asyncio.gather(*(backend.build_image(t.image, t.environment, t.context_digest) for t in (a, b, d, a, d)))
        assert set(backend.builder.made) == {a.image, d.image}  # two builds and conversions for five asks
        sif = tmp_path / "cache" / "sif" / sif_name(d.context_digest)
        assert await backend.images.path(d.image) == str(sif) and sif.is_file()
        assert not list((tmp_path / "cache" / "sif").glob("*.tar"))  # the saved archives are gone
        sandbox = await backend.open(spec_of(run_name, d.image))
        try:
            # the built image runs, in its Dockerfile's WORKDIR (where Harbor's tests look), which a SIF does not keep
            assert (await sandbox.exec("cat /etc/other; pwd", 30)).output.split() == ["other", "/srv/d"]
        finally:
            await sandbox.close()
    finally:
        await backend.shutdown()
    again = make_backend(tmp_path, run_name)
    await again.start()
    try:
        await again.build_image(d.image, d.environment, d.context_digest)
        assert again.builder.made == {}  # its SIF is in the cache already: nothing built or converted
        assert again.builder.workdirs == {d.image: "/srv/d"}  # and its WORKDIR noted beside it
    finally:
        await again.shutdown()


def spec_of(run_name, image):
    from hermes_batch import SandboxSpec

    return SandboxSpec(run_name, 0, "00000000c0ffee", image=image)


async def test_a_failed_build_fails_with_the_tail_of_its_log_once(tmp_path, run_name, task_images):
    task = read_task(make_task(tmp_path / f"s{uuid.uuid4().hex[:8]}", "bad",
                               extra="RUN echo the-last-words-of-the-build && exit 7\n"))
    task_images.append(task.image)
    backend = make_backend(tmp_path, run_name)
    await backend.start()
    try:
        for _ in range(2):  # every prompt of it gets the same error, from the one build
            with pytest.raises(SandboxError) as caught:
                await backend.build_image(task.image, task.environment, task.context_digest)
            assert "could not be built" in str(caught.value) and "the-last-words-of-the-build" in str(caught.value)
        with pytest.raises(SandboxError):
            await backend.prepare_image(task.image)  # the same failure, not a pull of a name no registry has
    finally:
        await backend.shutdown()


def test_a_task_row_is_built_and_graded_through_apptainer(tmp_path, run_name, model_server, task_images):
    suite = tmp_path / f"s{uuid.uuid4().hex[:8]}"
    make_task(suite, "hello")
    make_task(suite, "broken", extra="RUN exit 3\n")
    task_images.extend(read_task(suite / n).image for n in ("hello", "broken"))
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(f'{{"task": "{suite.name}/hello"}}\n{{"task": "{suite.name}/broken"}}\n')
    server = model_server(ToolLoopScript(tool_calls=1, command="echo hi > hello.txt"))
    runner = singularity_runner(tmp_path, run_name)

    result = runner.invoke(dataset, "--verifier", "command", server=server)

    assert result.exit_code == 3, result.output  # the broken task's prompt failed; the other went on
    (record,) = runner.records("trajectories.jsonl")
    meta = record["metadata"]
    assert meta["reward"] == 1.0 and meta["verified"] is True, meta
    assert json.loads(meta["row"])["task"] == "hello" and meta["image"] == read_task(suite / "hello").image
    (failure,) = runner.records("failed.jsonl")
    assert "could not be built" in failure["message"] and server.calls_for("Write hello.txt (broken).\n") == 0


# The interfaces of the command's own network namespace (/sys/class/net may show the host's).
INTERFACES = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '"


async def test_a_task_without_internet_gets_an_instance_without_a_network(tmp_path, run_name, images):
    from hermes_batch import SandboxSpec

    backend = make_backend(tmp_path, run_name, image=images.sif_a, pool=1)  # a pooled instance has the network
    await backend.start()
    try:
        await backend.prepare_image(None)
        offline = task_folders.TaskOptions(allow_internet=False)
        closed = await backend.open(SandboxSpec(run_name, 0, "00000000c0ffee", limits=offline))
        online = await backend.open(SandboxSpec(run_name, 1, "00000001c0ffee"))
        try:
            assert (await closed.exec(INTERFACES, 30)).output.split() == ["lo"]
            assert len((await online.exec(INTERFACES, 30)).output.split()) > 1
        finally:
            await closed.close()
            await online.close()
    finally:
        await backend.shutdown()
    with pytest.raises(SandboxError, match="network=none"):  # shared instances cannot drop one prompt's network
        reusing = make_backend(tmp_path, run_name, image=images.sif_a, reuse="namespace")
        await reusing.start()
        try:
            await reusing.open(SandboxSpec(run_name, 2, "00000002c0ffee", limits=offline))
        finally:
            await reusing.shutdown()
