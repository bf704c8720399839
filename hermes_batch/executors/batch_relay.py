"""``--batch_api`` under an executor with workers: the driver submits and collects, the workers run the sessions.

The driver holds the run's one Batcher (``hermes_batch.model.batching``), with
the one batch journal of the run folder, so the requests of every worker's
sessions share batches and a ``--resume`` collects what any of them left at
the provider.  A worker's BatchingClient has a ``BatchRelay`` instead: each
call of its Batcher goes to the driver as ``("batch", id, op, args)``, which
``BatchService`` runs on the Batcher and answers with ``("batched", id,
outcome)``: the answer, None, or the error to raise (pickled with its fields).

The ops: ``send`` (``(messages, tools, prompt)``: the answer through a batch;
the driver marks it ``SENT`` when its batch goes out, and writes its ``sent``
line of calls.jsonl then),
``earlier`` (``(messages, tools)``: the answer a batch of an earlier session
holds, or None), ``forget`` (the replay journal answered this call; no answer
is sent back) and ``cancel`` (the session stopped waiting, at its
``--prompt_timeout`` or the worker's stop: the request leaves the batch being
filled).  Everything else of a call stays with the worker, as with the local
executor: its retries and limits, its ``done`` lines of calls.jsonl (relayed
like any other), its record.

A worker that is lost leaves its requests in their batches: the dispatcher
leases its prompts to other workers, which run them again from their first
turn, and a request sent again with the same body takes the lost session's
answer (``Batcher.adopt``) instead of being paid again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
from typing import Callable

from ..errors import ModelCallError
from ..model.batching import BatchCounts
from .dispatch import WorkerLink, WorkerLost

log = logging.getLogger("hermes_batch.executors.batch_relay")

LEFT_IN_BATCH = "left in batch"
"""The outcome the driver sends for a request its stop left in a batch at the provider: not an answer, but the
mark the worker's session, cut off next, gives its CancelledError (``left_in_batch``, see CallJournal.complete)."""
SENT = "sent"
"""What the driver sends when a request's batch goes out (the driver writes its ``sent`` line): a session cut off
before it had sent nothing (``never_sent``: no end line either)."""


class BatchRelay:
    """A worker's stand-in for the Batcher: its calls are made by the driver's (see the module docstring)."""

    api = None  # the driver checks the endpoint
    journal = None  # the driver's

    def __init__(self, emit: Callable[[tuple], None]):
        self._emit = emit
        self._ids = itertools.count()
        self._waiting: dict = {}  # id -> the future of its outcome
        self._left: set = set()  # ids of requests the driver's stop left in a batch (LEFT_IN_BATCH)
        self._sent: set = set()  # ids of requests whose batch went out (SENT)
        self.counts = BatchCounts()  # the driver's counts are the run's; a worker's stay empty

    async def send(self, messages: tuple, tools: tuple, prompt: int = -1):
        return await self._ask("send", (messages, tools, prompt))

    async def earlier(self, messages: tuple, tools: tuple):
        return await self._ask("earlier", (messages, tools))

    def forget(self, messages: tuple, tools: tuple) -> None:
        self._emit(("batch", next(self._ids), "forget", (messages, tools)))

    async def _ask(self, op: str, args: tuple):
        key = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        self._emit(("batch", key, op, args))
        try:
            outcome = await future
        except asyncio.CancelledError as exc:
            if self._waiting.pop(key, None) is not None:
                self._emit(("batch", key, "cancel", ()))
            if key in self._left:
                self._left.discard(key)
                exc.left_in_batch = True
            elif op == "send" and key not in self._sent:
                exc.never_sent = True
            raise
        finally:
            self._sent.discard(key)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def answer(self, key: int, outcome) -> None:
        """The driver's ``("batched", key, outcome)``."""
        if isinstance(outcome, str):  # a mark, not an answer: the session is still waiting
            if key in self._waiting:
                (self._sent if outcome == SENT else self._left).add(key)
            return
        future = self._waiting.pop(key, None)
        if future is not None and not future.done():
            future.set_result(outcome)

    def summary(self) -> dict:
        return {}

    async def aclose(self) -> None:
        for future in self._waiting.values():
            future.cancel()
        self._waiting.clear()


class BatchService:
    """The driver's end: runs the workers' batch calls on the run's Batcher and sends each outcome back."""

    def __init__(self, batcher):
        self.batcher = batcher
        self._pending: dict = {}  # (link, id) -> (the task waiting for its outcome, op, args)
        self._orphans: set = set()  # the tasks of lost workers' requests, whose answers are adopted
        self._marks: set = set()  # the tasks sending SENT marks
        self._closing = False

    def handle(self, link: WorkerLink, message: tuple) -> None:
        _kind, key, op, args = message
        if op == "forget":
            self.batcher.forget(*args)
        elif op == "cancel":
            pending = self._pending.pop((link, key), None)
            if pending is not None:
                pending[0].cancel()  # Batcher.send drops the request from the batch being filled
        else:
            task = asyncio.ensure_future(self._answer(link, key, op, args))
            self._pending[(link, key)] = (task, op, args)

    async def _answer(self, link: WorkerLink, key: int, op: str, args: tuple):
        try:
            if op == "send":
                outcome = await self.batcher.send(*args, on_sent=lambda: self._mark(link, key, SENT))
            else:
                outcome = await self.batcher.earlier(*args)
        except asyncio.CancelledError as exc:
            # the run stops (aclose): the mark goes before the worker's stop, which comes after on its channel
            if self._closing and getattr(exc, "left_in_batch", False):
                try:
                    await link.send(("batched", key, LEFT_IN_BATCH))
                except WorkerLost:
                    pass
            raise
        except Exception as exc:  # noqa: BLE001 - the worker's session raises it, as the local one would
            outcome = _picklable(exc)
        finally:
            if self._pending.get((link, key), (None,))[0] is asyncio.current_task():
                del self._pending[(link, key)]
        try:
            await link.send(("batched", key, outcome))
        except WorkerLost:
            pass  # its sessions went with it; the dispatcher re-leases its prompts
        return outcome

    def _mark(self, link: WorkerLink, key: int, mark: str) -> None:
        async def send():
            try:
                await link.send(("batched", key, mark))
            except WorkerLost:
                pass

        task = asyncio.ensure_future(send())
        self._marks.add(task)
        task.add_done_callback(self._marks.discard)

    def drop(self, link: WorkerLink) -> None:
        """``link``'s worker is gone: its requests stay in their batches, their answers for the sessions that run
        its prompts again (``Batcher.adopt``)."""
        for found in [k for k in self._pending if k[0] is link]:
            task, op, args = self._pending.pop(found)
            if op != "send":
                task.cancel()
                continue
            answer = asyncio.get_running_loop().create_future()
            task.add_done_callback(lambda done, answer=answer: _hand_over(done, answer))
            self._orphans.add(task)
            task.add_done_callback(self._orphans.discard)
            messages, tools, _prompt = args
            self.batcher.adopt(messages, tools, answer)

    async def aclose(self) -> None:
        """The workers are being stopped: their sessions stop waiting (batches in flight stay at the provider)."""
        self._closing = True
        tasks = [task for task, _op, _args in self._pending.values()] + list(self._orphans) + list(self._marks)
        self._pending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _hand_over(task: asyncio.Task, answer: asyncio.Future) -> None:
    """``answer`` gets the answer a finished task of BatchService._answer brought, else None."""
    if answer.done():  # the session waiting for it was cancelled, and this with it
        return
    outcome = None
    if not task.cancelled() and task.exception() is None and not isinstance(task.result(), BaseException):
        outcome = task.result()
    answer.set_result(outcome)


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an SDK's error with a client in it: its text goes instead
        return ModelCallError(f"{type(exc).__name__}: {exc}", status=getattr(exc, "status", None))
    return exc
