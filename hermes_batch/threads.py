"""Blocking calls that can never hold up the process's exit."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


async def in_daemon_thread(function: Callable[..., Any], *args: Any, name: str = "hermes-batch-blocking") -> Any:
    """Await ``function(*args)`` run in a daemon thread of its own.

    For calls a hostile sandbox could make block (a file on a hung mount, a
    pipe): unlike a ThreadPoolExecutor's workers, which the interpreter joins at
    exit and ``asyncio.run`` joins on Ctrl-C, an abandoned daemon thread lets
    the process end, and it never takes a slot other work needs.
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result = function(*args)
        except BaseException as exc:  # handed to the awaiting task, whatever it is
            _tell(loop, _set_exception, future, exc)
        else:
            _tell(loop, _set_result, future, result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


def _tell(loop: asyncio.AbstractEventLoop, *call) -> None:
    try:
        loop.call_soon_threadsafe(*call)
    except RuntimeError:  # the event loop is closed: nobody waits any more
        pass


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
