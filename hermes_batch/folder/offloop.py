"""Run-folder work off the event loop that Ctrl-C stops: the run folder's own threads and the stop flag.

Reading or rewriting a big run folder (a resume's scan, the merge) runs in
:func:`run_off_loop`; the work calls :func:`check_stop` as it goes, so a
Ctrl-C stops it between records, with its files left whole.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")


_IO_THREADS = 4

_io_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_io_pool_lock = threading.Lock()


def io_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that write the run folder, apart from the pool sandboxes and tools use.

    A tool blocked for ever (a FIFO, a hung mount) can take every thread of that
    pool; the records of the prompts that do finish must still be written.
    """
    global _io_pool
    with _io_pool_lock:
        if _io_pool is None:
            _io_pool = concurrent.futures.ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="hermes-batch-io")
        return _io_pool


class Stopped(Exception):
    """Work started by :func:`run_off_loop` was cancelled (Ctrl-C) and stopped, its files as they were."""


_off_loop = threading.local()


def check_stop() -> None:
    """Raise Stopped if the :func:`run_off_loop` call running in this thread was cancelled; cheap, call it often."""
    stop = getattr(_off_loop, "stop", None)
    if stop is not None and stop.is_set():
        raise Stopped()


async def run_off_loop(fn, *args):
    """``fn(*args)`` on the run folder's threads, where the event loop does not wait for it.

    Cancelling it (Ctrl-C) makes :func:`check_stop` raise Stopped in ``fn``'s thread
    (``read_records`` and the merge call it as they go) and still waits for ``fn``
    to end, so whatever it was replacing is left whole and its temporary file
    removed; the process could not exit before that thread ends anyway.  The
    cancellation is then raised.
    """
    stop = threading.Event()

    def call():
        _off_loop.stop = stop
        try:
            return fn(*args)
        finally:
            _off_loop.stop = None

    future = asyncio.get_running_loop().run_in_executor(io_executor(), call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        stop.set()
        while not future.done():
            try:
                await asyncio.wait((future,))
            except asyncio.CancelledError:  # a second Ctrl-C: still wait, the files come first
                pass
        if not future.cancelled():
            future.exception()  # retrieved: Stopped is expected
        raise


def stoppable(items: Iterable[T], every: int = 1024) -> Iterator[T]:
    """``items``, calling :func:`check_stop` every ``every`` of them."""
    for count, item in enumerate(items):
        if count % every == 0:
            check_stop()
        yield item
