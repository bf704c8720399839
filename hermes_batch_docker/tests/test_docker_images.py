"""Image-aware scheduling on a real engine: several images, pools sized to each image's prompts left, the run's
own images removed under -S image_cache=, the images found on the engine never."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import docker
import pytest

from hermes_batch import ImageDemand
from hermes_batch.testing import ToolLoopScript, tool_outputs, write_dataset
from hermes_batch_docker import DockerBackend, DockerConfig
from hermes_batch_docker.engine import LABEL_RUN

from docker_rig import IMAGE_A, SESSION, containers_of, make_backend, spec


@pytest.fixture
def images(docker_api):
    """Names of images of this test, made as tags of the busybox test image; removed after the test."""
    made = []

    def name(part: str) -> str:
        made.append(f"hermes-batch-test/sched-{SESSION}-{part}:1")
        return made[-1]

    yield name
    for image in made:
        try:
            docker_api.remove_image(image)
        except docker.errors.NotFound:
            pass


def tag(docker_api, image: str) -> None:
    repository, _, version = image.rpartition(":")
    docker_api.tag(IMAGE_A, repository, version)


def present(docker_api, image: str) -> bool:
    try:
        docker_api.inspect_image(image)
        return True
    except docker.errors.NotFound:
        return False


class Creations:
    """The images of the containers a run creates, one per creation, from the engine's event stream (its history
    holds the last 256 events of every user of the engine, too few on a shared one)."""

    def __init__(self, docker_api, run_name: str):
        self.images: list = []
        self._stream = docker_api.events(decode=True, filters={
            "event": "create", "type": "container", "label": f"{LABEL_RUN}={run_name}"})
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._stream:
                self.images.append(event["Actor"]["Attributes"]["image"])
        except Exception:  # closed
            pass

    def stop(self) -> list:
        time.sleep(0.5)  # the last events on their way
        self._stream.close()
        self._thread.join(5)
        return self.images


def test_a_run_over_four_images_starts_one_container_per_prompt_and_keeps_the_order(
        tmp_path, runner, model_server, docker_api, images, run_name):
    names = [images(f"run{k}") for k in range(4)]
    for image in names:
        tag(docker_api, image)
    rows = [{"prompt": f"task {i}", "image": names[i % 4]} for i in range(12)]  # interleaved
    dataset = write_dataset(tmp_path / "data.jsonl", rows)
    server = model_server(ToolLoopScript(tool_calls=1, command="cat /etc/hermes-image"))
    creations = Creations(docker_api, run_name)

    result = runner.invoke(dataset, "--num_workers", "4", "--batch_size", "2", "-S", "pool=auto", server=server)

    made = creations.stop()
    assert result.exit_code == 0, result.output
    # main started --num_workers (4) containers ahead for each of the 4 images, 16 before any prompt took one
    # and a replacement after each: with pools sized to each image's prompts left, one container per prompt
    assert sorted(made) == sorted(row["image"] for row in rows)
    trajectories = runner.records("trajectories.jsonl")
    assert [t["prompt_index"] for t in trajectories] == list(range(12))  # merged in the dataset's order
    assert all(t["metadata"]["image"] == rows[t["prompt_index"]]["image"] for t in trajectories)
    assert all(tool_outputs(t) == ["hermes-batch-test/busybox-a:1\n"] for t in trajectories)
    checkpoint = json.loads((runner.folder() / "checkpoint.json").read_text())
    assert checkpoint["completed_batches"] == [0, 1, 2, 3, 4, 5]  # each batch complete, though handed out by image


async def test_a_pool_never_holds_more_containers_than_its_images_prompts_left(tmp_path, run_name, docker_api, images):
    first, second = images("pool0"), images("pool1")
    for image in (first, second):
        tag(docker_api, image)
    backend = make_backend(tmp_path, run_name, pool=8)
    demand = ImageDemand(IMAGE_A)
    for i in range(3):
        demand.expect(first, i)
    demand.expect(second, 3)
    backend.follow_demand(demand)
    await backend.start()

    def warm(image: str) -> int:
        return sum(1 for c in containers_of(docker_api, run_name) if c["Image"] == image) - sum(
            1 for s in backend._open if s.image == image)

    try:
        await backend.prepare_image(first)
        await backend.prepare_image(second)
        await asyncio.sleep(3)  # the pools fill
        assert (warm(first), warm(second)) == (3, 1)  # -S pool=8, but 3 and 1 prompts to come
        opened = []
        for i in range(3):
            opened.append(await backend.open(spec(run_name, i, image=first)))
            assert warm(first) <= demand.left(first) == 2 - i
        for sandbox in opened:
            await sandbox.close()
        await asyncio.sleep(1)
        assert warm(first) == 0
        assert not any(key[0] == first for key in backend._pools), [(k, p.ready, len(p._creating), len(p._waiters), p._returning) for k, p in backend._pools.items()]
        demand.done(second, 3)  # ended without a sandbox
        await asyncio.sleep(1)
        assert warm(second) == 0
    finally:
        await backend.shutdown()


class BuildingBackend(DockerBackend):
    """Makes a missing image by tagging the test image, as a builder would build it."""

    def obtain_image(self, name: str) -> dict:
        tag(self.api, name)
        return self.api.inspect_image(name)


async def test_the_image_cache_removes_only_the_runs_own_images_least_recently_used_first(
        tmp_path, run_name, docker_api, images):
    found = images("found")
    tag(docker_api, found)
    own = [images(f"own{k}") for k in range(3)]
    size = docker_api.inspect_image(IMAGE_A)["Size"]
    backend = make_backend(tmp_path, run_name, image_cache=str(int(size * 1.5)))
    backend = BuildingBackend(backend.config, backend.run)
    demand = ImageDemand(IMAGE_A)
    for i, image in enumerate([found, *own]):
        demand.expect(image, i)
    backend.follow_demand(demand)
    await backend.start()
    try:
        for i, image in enumerate([found, *own]):
            await backend.prepare_image(image)
            sandbox = await backend.open(spec(run_name, i, image=image))
            assert (await sandbox.exec("cat /etc/hermes-image", 10)).output == "hermes-batch-test/busybox-a:1\n"
            # the next image is obtained while this one is in use: it stays
            if i + 1 < len(own) + 1:
                await backend.prepare_ahead(own[i] if i < len(own) else found)
            assert present(docker_api, image)
            await sandbox.close()
            demand.done(image, i)
        await asyncio.gather(*list(backend._background), return_exceptions=True)
        assert present(docker_api, found)  # found on the engine: never removed
        assert backend.removed_images == own[:2]
        assert [present(docker_api, image) for image in own] == [False, False, True]
        assert present(docker_api, IMAGE_A)
    finally:
        await backend.shutdown()


def test_the_image_cache_option_takes_a_size_or_none():
    assert DockerConfig(image_cache="2g").image_cache_bytes == 2 << 30
    assert DockerConfig().image_cache_bytes is None and DockerConfig(image_cache="none").image_cache_bytes is None
    with pytest.raises(ValueError, match="image_cache must be a size"):
        DockerConfig(image_cache="big")


def test_a_run_ordered_by_image_resumes_by_content(tmp_path, runner, model_server, docker_api, images):
    names = [images(f"resume{k}") for k in range(3)]
    for image in names:
        tag(docker_api, image)
    rows = [{"prompt": f"task {i}", "image": names[i % 3]} for i in range(9)]
    dataset = write_dataset(tmp_path / "data.jsonl", rows)
    server = model_server(ToolLoopScript(tool_calls=1, command="echo fine"))

    first = runner.invoke(dataset, "--num_workers", "3", "--batch_size", "2", "--max_samples", "5", server=server)
    assert first.exit_code == 0, first.output
    assert [t["prompt_index"] for t in runner.records("trajectories.jsonl")] == list(range(5))
    again = runner.invoke(dataset, "--resume", "--max_samples", "all", server=server)

    assert again.exit_code == 0, again.output
    assert [t["prompt_index"] for t in runner.records("trajectories.jsonl")] == list(range(9))
    assert all(server.calls_for(row["prompt"]) == 2 for row in rows)  # no finished prompt ran again
    checkpoint = json.loads((runner.folder() / "checkpoint.json").read_text())
    assert checkpoint["prompts_finished"] == 9
