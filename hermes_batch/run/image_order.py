"""The order prompts are handed out in: an image's prompts together, within a window read ahead.

A sandbox backend that runs an image per prompt pays per image (a pull or a
build, a pool of containers started ahead, disk) more than per prompt.  Rows of
many images interleaved in the dataset would keep every image busy at once; so
the scheduler reads up to ``window`` rows ahead and hands out the rows of one
image before moving on to the image whose first row waiting comes earliest in
the dataset.  With one image, or a backend that runs none (``window`` 1), the
order is the dataset's.

Nothing else depends on the order: a prompt is resumed by its content, its
journal entries by its prompt, and the outputs are merged in ``prompt_index``
order whatever order the prompts ended in.  What does depend on it is when a
batch is complete (its checkpoint saved, its file closed): only once every row
of it was handed out, which the window says (``sealed``).  So that no more than
``max_batches`` batch files are open at once, the window holds rows of at most
that many batches.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable, Iterator, Optional

from ..formats.records import PromptRow

ROWS_PER_SESSION = 16  # the window reads this many rows ahead per session run at once
MAX_ROWS = 20_000  # whatever the concurrency: a row holds its prompt in memory
MAX_BATCHES = 64  # batches with rows in the window: each may hold a batch file open


def window_size(concurrency: int, uses_images: bool) -> int:
    """Rows read ahead for ``concurrency`` sessions: 1 (the dataset's order) for a backend that runs no image."""
    return min(MAX_ROWS, max(64, ROWS_PER_SESSION * concurrency)) if uses_images else 1


class ImageOrder:
    """Iterates ``(row, sealed)``: the rows in the order to hand them out, and after each the batches no row of
    which is still to come (to complete once their prompts end).  ``on_read(row)`` is called as each row enters
    the window; ``upcoming(n)`` names the images of the next ``n`` groups after the one being handed out."""

    def __init__(self, rows: Iterable[PromptRow], batch_size: int, window: int, *,
                 max_batches: int = MAX_BATCHES, image: Callable[[PromptRow], str] = lambda row: row.image or "",
                 on_read: Optional[Callable[[PromptRow], None]] = None):
        self._rows = iter(rows)
        self._batch_size = batch_size
        self._window = max(1, window)
        self._max_batches = max(1, max_batches)
        self._image = image
        self._on_read = on_read
        # image -> its rows in the window, in dataset order (an OrderedDict: its first key is O(1) however many
        # groups were removed before it, which a dict's is not)
        self._groups: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self._held = 0  # rows in the window
        self._in_batch: collections.Counter = collections.Counter()  # batch -> rows of it in the window
        self._frontier: Optional[int] = None  # the batch of the last row read
        self._ended = False  # every row was read
        self._current: Optional[str] = None  # the image being handed out
        self._pending: Optional[PromptRow] = None  # read but not let in: its batch would be one too many
        self._to_seal: list = []  # batches found complete while reading, told with the next row

    def __iter__(self) -> Iterator[tuple[PromptRow, tuple]]:
        while True:
            self._fill()
            if not self._held:
                return
            row = self._next_row()
            batch = row.prompt_index // self._batch_size
            self._in_batch[batch] -= 1
            sealed, self._to_seal = self._to_seal, []
            if not self._in_batch[batch]:
                del self._in_batch[batch]
                if self._ended or batch != self._frontier:
                    sealed.append(batch)
            yield row, tuple(sealed)

    def upcoming(self, count: int) -> list[str]:
        """The images handed out next: the current one, then the next ``count`` by their first row in the window."""
        images = [self._current] if self._current in self._groups else []
        for image in self._groups:
            if len(images) > count:
                break
            if image != self._current:
                images.append(image)
        return images

    def _next_row(self) -> PromptRow:
        if self._current not in self._groups:
            # The image whose first waiting row comes first in the dataset is the first of _groups: rows are read
            # in dataset order and only the current image's are taken, so the other groups keep the first row
            # they were made with and stay in the order of it (a group made again comes after, as its row).
            self._current = next(iter(self._groups))
        rows = self._groups[self._current]
        row = rows.popleft()
        if not rows:
            del self._groups[self._current]
        self._held -= 1
        return row

    def _fill(self) -> None:
        while not self._ended and self._held < self._window:
            row = self._pending
            if row is None:
                row = next(self._rows, None)
                if row is None:
                    self._ended = True
                    return
            batch = row.prompt_index // self._batch_size
            if batch not in self._in_batch and len(self._in_batch) >= self._max_batches and self._held:
                self._pending = row  # let in once a batch of the window has been handed out
                return
            self._pending = None
            if self._frontier is not None and batch != self._frontier and not self._in_batch.get(self._frontier):
                self._to_seal.append(self._frontier)  # handed out while more of it could still come: no more can
            self._frontier = batch
            self._in_batch[batch] += 1
            self._groups.setdefault(self._image(row), collections.deque()).append(row)
            self._held += 1
            if self._on_read is not None:
                self._on_read(row)
