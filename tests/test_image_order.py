"""Image-aware scheduling: the order prompts are handed out in, batches sealed, each image's demand and the
warm pools sized to it."""

from __future__ import annotations

import asyncio

import pytest

from hermes_batch import ImageDemand, WarmPool
from hermes_batch.formats.records import PromptRow
from hermes_batch.run.checkpoint import BatchTracker
from hermes_batch.run.image_order import ImageOrder, window_size


def rows(images: list) -> list[PromptRow]:
    return [PromptRow(prompt_index=i, prompt=f"p{i}", line_number=i + 1, image=image) for i, image in enumerate(images)]


def order(images: list, batch_size: int = 100, window: int = 100, **kwargs) -> list:
    return list(ImageOrder(rows(images), batch_size, window, **kwargs))


def test_an_images_prompts_go_together_the_earliest_image_first():
    handed = [row.prompt_index for row, _ in order(["a", "b", "a", "c", "b", "a"])]
    assert handed == [0, 2, 5, 1, 4, 3]


def test_one_image_or_a_window_of_one_keeps_the_datasets_order():
    assert [r.prompt_index for r, _ in order(["a"] * 5)] == list(range(5))
    assert [r.prompt_index for r, _ in order(["a", "b", "a", "b"], window=1)] == [0, 1, 2, 3]
    assert window_size(16, uses_images=False) == 1
    assert window_size(16, uses_images=True) == 256


def test_the_window_bounds_how_far_ahead_rows_are_taken():
    images = ["a", "b", "b", "b", "a"]
    assert [r.prompt_index for r, _ in order(images, window=100)] == [0, 4, 1, 2, 3]
    # a window of 2: the a row at 4 is read only once the b rows before it are handed out
    assert [r.prompt_index for r, _ in order(images, window=2)] == [0, 1, 2, 3, 4]


def test_every_row_once_and_each_batch_sealed_once_after_its_last_row():
    images = [f"i{(i * 7) % 5}" for i in range(53)]
    seen, sealed_at = [], {}
    for row, sealed in ImageOrder(rows(images), 4, 20):
        seen.append(row.prompt_index)
        for batch in sealed:
            assert batch not in sealed_at
            sealed_at[batch] = len(seen)
    assert sorted(seen) == list(range(53))
    for batch, at in sealed_at.items():
        # sealed only once every row of the batch was handed out
        assert all(i in seen[:at] for i in range(batch * 4, min(53, batch * 4 + 4)))
    # every batch but those still open at the end (completed by the end of the jobs) was sealed
    assert len(sealed_at) >= 53 // 4 - 3


def test_the_window_holds_rows_of_at_most_max_batches():
    read = []
    items = iter(ImageOrder(rows(["a", "b"] * 10), 1, 100, max_batches=3, on_read=read.append))
    next(items)
    assert len(read) == 3  # batch size 1: three batches, three rows


def test_upcoming_names_the_current_image_then_the_next_ones():
    it = ImageOrder(rows(["a", "b", "c", "a", "d"]), 100, 100)
    items = iter(it)
    next(items)
    assert it.upcoming(2) == ["a", "b", "c"]


def test_the_tracker_completes_a_batch_once_sealed_and_its_prompts_ended():
    done = []
    tracker = BatchTracker(lambda batch, failed: done.append((batch, failed)))
    tracker.dispatched(0)
    tracker.dispatched(1)
    tracker.finished(0)
    assert done == []  # batch 0 is not sealed: a row of it may still come (ordered by image)
    tracker.dispatched(0)
    tracker.seal(0)
    assert done == []
    tracker.finished(0, failed=True)
    assert done == [(0, 1)]
    tracker.finished(1)
    tracker.end_of_jobs()
    assert done == [(0, 1), (1, 0)]


def test_demand_counts_prompts_read_until_they_open_a_sandbox_or_end():
    demand, fell = ImageDemand("default:1"), []
    demand.listen(fell.append)
    demand.expect(None, 0)
    demand.expect("x", 1, count=3)  # a row's three samples
    demand.expect("x", 2)
    assert demand.left(None) == demand.left("default:1") == 1
    assert demand.left("x") == 4
    demand.opened("x", 1)
    demand.opened("x", 1)
    assert demand.left("x") == 2
    demand.done("x", 1)  # one that opened: counted already
    demand.done("x", 2)  # one that never opened
    assert demand.left("x") == 1 and fell == ["x", "x", "x"]
    demand.opened("x", 2)  # a second sandbox of a prompt already counted
    assert demand.left("x") == 1
    demand.clear()
    assert demand.left("x") == demand.left(None) == 0 and demand.images() == []


class Pool:
    """A WarmPool over a fake creation whose starts wait for the test."""

    def __init__(self, size: int, demand: ImageDemand):
        self.made = 0
        self.discarded = []
        self.gate = asyncio.Event()

        async def create():
            await self.gate.wait()
            self.made += 1
            return self.made

        self.pool = WarmPool("x", "/w", size, create, self.discarded.append, wanted=lambda: demand.left("x"))
        demand.listen(lambda image: self.pool.trim())

    @property
    def warm(self) -> int:
        return self.pool.ready + len(self.pool._creating)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize("size", [1, 16])
def test_a_pool_never_holds_more_than_the_images_prompts_left(size):
    async def main():
        demand = ImageDemand()
        for i in range(5):
            demand.expect("x", i)
        pool = Pool(size, demand)
        pool.pool.fill()
        assert pool.warm == min(size, 5)
        pool.gate.set()
        await settle()
        taken = []
        for i in range(5):
            taken.append(await pool.pool.take(lambda i=i: demand.opened("x", i)))
            await settle()
            assert pool.warm <= demand.left("x")
            pool.pool.release()
            await settle()
            assert pool.warm <= demand.left("x")
        assert None not in taken and pool.warm == 0 and pool.pool.idle
        assert pool.made <= 5 + (size == 1) * 0  # never one more than the prompts

    asyncio.run(main())


def test_prompts_that_end_without_a_sandbox_shrink_the_pool():
    async def main():
        demand = ImageDemand()
        for i in range(4):
            demand.expect("x", i)
        pool = Pool(8, demand)
        pool.pool.fill()
        pool.gate.set()
        await settle()
        assert pool.pool.ready == 4
        demand.done("x", 0)
        demand.done("x", 1)
        assert pool.pool.ready == 2 and len(pool.discarded) == 2
        demand.clear()  # halted: none will start
        assert pool.pool.ready == 0 and pool.pool.idle

    asyncio.run(main())


def test_creations_beyond_the_demand_are_stopped_before_they_start():
    async def main():
        demand = ImageDemand()
        for i in range(6):
            demand.expect("x", i)
        pool = Pool(6, demand)
        pool.pool.fill()
        await settle()
        assert len(pool.pool._creating) == 6
        for i in range(4):
            demand.done("x", i)
        assert len(pool.pool._creating) == 2
        pool.gate.set()
        await settle()
        assert pool.made == 2 and pool.pool.ready == 2

    asyncio.run(main())


def test_a_prompt_waiting_for_one_gets_it_whatever_the_demand():
    async def main():
        demand = ImageDemand()  # a prompt nobody read ahead (a later sample of --stop_on_success)
        pool = Pool(4, demand)
        pool.pool.fill()
        assert pool.warm == 0
        waiting = asyncio.ensure_future(pool.pool.take())
        await settle()
        pool.gate.set()
        assert await waiting == 1

    asyncio.run(main())
