"""The run's model client under ``--batch_api``: each model call through a provider batch (``model/batching.py``).

It wraps the client the run chose (``openai`` or ``anthropic``): requests are
built by it exactly as a synchronous call would send them, answers read by it,
errors classified by it, and its limiter (retries, budgets) and the run's call
journal see every call as they would see a synchronous one.  Only ``send``
differs: it waits for the call's batch.  Tools that consult a model
(``for_model``) call it synchronously.

Under an executor with workers the driver holds the run's one Batcher (and its
journal); each worker's client is a BatchingClient whose batcher is a relay to
the driver's (``hermes_batch.executors.batch_relay``).
"""

from __future__ import annotations

from typing import Optional

from ..contract.interfaces import ModelClient
from ..errors import ConfigError
from ..folder.batch_journal import BatchJournal, batch_journal_path, read_batches
from ..folder.journal import current_prompt
from ..formats.records import CallRecord
from ..model.batching import Batcher, BatchOptions
from .config import RunConfig


def batch_options(config: RunConfig) -> BatchOptions:
    return BatchOptions(
        max_requests=config.batch_api_max_requests,
        max_wait=config.batch_api_max_wait,
        poll_interval=config.batch_api_poll_interval,
    )


def has_batch_api(client_class: type) -> bool:
    """True when ``client_class`` offers a batch API (overrides ``ModelClient.batch_api``)."""
    return getattr(client_class, "batch_api", None) is not ModelClient.batch_api


class BatchingClient(ModelClient):
    """``inner`` with every call sent in a batch; see the module docstring."""

    def __init__(self, inner: ModelClient, options: BatchOptions, batcher=None):
        super().__init__(inner.settings)
        if batcher is None:  # else a worker's relay to the driver's Batcher, with the same methods
            api = inner.batch_api()
            if api is None:
                raise ConfigError(f"The model client {inner.name!r} has no batch API; run without --batch_api.")
            batcher = Batcher(api, options)
        self.inner = inner
        self.name = inner.name
        self.packages = inner.packages
        self.batcher = batcher

    @property
    def limiter(self):
        return self.inner.limiter

    # the call journal's ``sent`` line of a request is written when its batch goes out (Batcher.on_sent), not
    # while it waits in the queue: a run killed or stopped meanwhile sent nothing (CallJournal.complete)
    sends_later = True

    async def send(self, messages, tools):
        return await self.batcher.send(messages, tools, current_prompt.get())

    async def complete(self, messages, tools, *, calls=None):
        """An answer an earlier session's batch holds is taken without a request: that session journaled it as
        sent (calls.jsonl), this one journals its end, with its usage, so it counts once; else as any call."""
        response = await self.batcher.earlier(messages, tools)
        if response is None:
            return await super().complete(messages, tools, calls=calls)
        call = CallRecord(response.provider, 0.0, 200)
        if calls is not None:
            calls.append(call)
        if self.journal is not None:
            self.journal.done(call, response.usage)
        return response

    def replayed(self, messages, tools) -> None:
        """The replay journal answered this call (``session.replay``): no earlier batch's answer is handed out for it."""
        self.batcher.forget(messages, tools)

    async def preflight(self) -> None:
        await self.inner.preflight()

    async def tokenize(self, messages, tools):
        return await self.inner.tokenize(messages, tools)  # --logprobs: not a model call, so never batched

    async def check_batch_api(self) -> None:
        """FatalModelError (exit 2) when the endpoint has no batch API; before any prompt runs."""
        await self.batcher.check()

    def for_model(self, model: str) -> ModelClient:
        other = self.inner.for_model(model)
        other.journal = self.journal
        return other

    def batch_api(self):
        return self.batcher.api

    def open_journal(self, run_dir, session: int, unfinished: Optional[set]) -> BatchJournal:
        """Journal this session's batches in the run folder, and collect those of earlier sessions that hold
        requests of prompts not finished (``unfinished``: their indexes, None for all)."""
        path = batch_journal_path(run_dir)
        for submitted in read_batches(path):
            if unfinished is None or submitted.prompts & unfinished:
                self.batcher.expect(submitted.batch, list(submitted.custom_ids))
        self.batcher.journal = BatchJournal(path, session)
        if self.journal is not None:  # calls.jsonl: each request counts as sent when its batch goes out
            self.batcher.on_sent = self.journal.sent
        return self.batcher.journal

    def statistics(self) -> dict:
        return self.batcher.counts.as_dict()

    async def aclose(self) -> None:
        try:
            await self.batcher.aclose()
        finally:
            if self.batcher.journal is not None:
                self.batcher.journal.close()
            await self.inner.aclose()
