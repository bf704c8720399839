"""How many of the run's prompts each image still has to serve, as far as the scheduler has read ahead.

The scheduler reads the dataset a window ahead of the prompts it hands out
(``run/image_order.py``); each prompt it reads is expected here under its image
(``expect``).  A prompt stops counting when its sandbox is opened (the backend's
``opened``) or when it ends without one (the scheduler's ``done``).  A backend
that keeps sandboxes started ahead of need (``WarmPool``) keeps no more of an
image than ``left(image)``, so an image whose prompts have all started has none
waiting, and one whose prompts are all done can be removed (``-S image_cache=``).

Everything runs on the run's event loop; ``listen`` callbacks are called there,
with the image whose count went down.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional


class ImageDemand:
    """Prompts read but not yet started, per image (``None``, a row without one, counts as ``default``)."""

    def __init__(self, default: str = ""):
        self.default = default
        self._waiting: collections.Counter = collections.Counter()  # (image, prompt index) -> prompts (samples) not started
        self._opened: collections.Counter = collections.Counter()  # (image, prompt index) -> started, not done
        self._left: collections.Counter = collections.Counter()  # image -> prompts not started
        self._listeners: list[Callable[[str], None]] = []

    def image(self, image: Optional[str]) -> str:
        return image or self.default

    def left(self, image: Optional[str]) -> int:
        """Prompts of ``image`` read ahead that have neither opened a sandbox nor ended."""
        return self._left.get(self.image(image), 0)

    def images(self) -> list[str]:
        """The images with prompts left, in the order their first prompt was read."""
        return [image for image, count in self._left.items() if count > 0]

    def listen(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(image)`` each time ``image``'s count goes down."""
        self._listeners.append(callback)

    def expect(self, image: Optional[str], key: int, count: int = 1) -> None:
        """``count`` prompts (a row's samples) of ``image``, of the row ``key`` (its prompt index), were read."""
        if count <= 0:
            return
        name = self.image(image)
        self._waiting[name, key] += count
        self._left[name] += count

    def opened(self, image: Optional[str], key: int) -> None:
        """A prompt of the row ``key`` opens its sandbox (a second one, for a clean verification, counts no more
        unless another sample of the row is still waiting: then that one waits in the pool's queue instead)."""
        name = self.image(image)
        if self._waiting.get((name, key), 0) <= 0:
            return
        self._opened[name, key] += 1
        self._take(name, key)

    def done(self, image: Optional[str], key: int) -> None:
        """A prompt of the row ``key`` ended: if it never opened a sandbox it counts no more now."""
        name = self.image(image)
        if self._opened.get((name, key), 0) > 0:
            self._opened[name, key] -= 1
            if not self._opened[name, key]:
                del self._opened[name, key]
            return
        if self._waiting.get((name, key), 0) > 0:
            self._take(name, key)

    def clear(self) -> None:
        """No more prompts will start (the run was halted): nothing is left of any image."""
        images = self.images()
        self._waiting.clear()
        self._left.clear()
        for image in images:
            self._tell(image)

    def _take(self, name: str, key: int) -> None:
        self._waiting[name, key] -= 1
        if not self._waiting[name, key]:
            del self._waiting[name, key]
        self._left[name] -= 1
        if not self._left[name]:
            del self._left[name]
        self._tell(name)

    def _tell(self, name: str) -> None:
        for callback in self._listeners:
            callback(name)
