"""Blocking calls that can never hold up the process's exit."""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
from typing import Any, Callable

IDLE_S = 10.0  # an idle daemon thread waits this long for more work before it ends


async def in_daemon_thread(function: Callable[..., Any], *args: Any, name: str = "hermes-batch-blocking") -> Any:
    """Await ``function(*args)`` run in a daemon thread.

    For calls a hostile sandbox could make block (a file on a hung mount, a
    pipe): unlike a ThreadPoolExecutor's workers, which the interpreter joins at
    exit and ``asyncio.run`` joins on Ctrl-C, an abandoned daemon thread lets
    the process end, and it never takes a slot other work needs: a call that
    finds no idle thread gets a new one.  Idle threads are kept a while for the
    next calls (starting a thread held the event loop about 0.1 ms, a twentieth
    of its time at 256 prompts at once).
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> Callable[[], None]:
        try:
            result = function(*args)
        except BaseException as exc:  # handed to the awaiting task, whatever it is
            return functools.partial(_tell, loop, _set_exception, future, exc)
        return functools.partial(_tell, loop, _set_result, future, result)

    _DAEMONS.submit(run, name)
    return await future


class _DaemonThreads:
    """Daemon threads that each run one call at a time and wait a while for the next."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: collections.deque = collections.deque()  # (event, box) of threads waiting for work

    def submit(self, call: Callable[[], Callable[[], None]], name: str) -> None:
        """Run ``call`` in an idle thread, or a new one; what it returns is called once the thread is idle again."""
        with self._lock:
            if self._idle:
                wake, box = self._idle.pop()
                box.append(call)
                wake.set()
                return
        threading.Thread(target=self._serve, args=(call,), name=name, daemon=True).start()

    def _serve(self, call: Callable[[], Callable[[], None]]) -> None:
        wake, box = threading.Event(), []
        while True:
            deliver = call()
            with self._lock:
                self._idle.append((wake, box))
            try:
                deliver()  # idle first: the awaiting task's next call finds this thread
            except Exception:  # noqa: BLE001 - a thread on the idle list must live to take its next call
                pass
            if not wake.wait(IDLE_S):
                with self._lock:
                    try:
                        self._idle.remove((wake, box))
                    except ValueError:  # handed a call just as the wait ended
                        pass
                    else:
                        return
            wake.clear()
            call = box.pop()


_DAEMONS = _DaemonThreads()


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
