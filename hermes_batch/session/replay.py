"""Replay of recorded model answers: what the agent loop asks before each model call.

The answers come from the run folder's replay journal (responses.jsonl, see
:mod:`hermes_batch.folder.replay_journal`) for a prompt whose session was cut off,
then from ``--response_cache`` when it is given.  A request is found by the hash of
its canonical form (:class:`RequestHasher`); the first request of a session that
is not found sends the session live for good.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional

from ..folder.replay_journal import canonical_json, decode_response, message_form
from ..formats.records import ModelResponse
from ..model.model_http import WireCache

# The settings that change what a request's body says (not how it travels: timeouts, retries, budgets).
BODY_SETTINGS = ("model", "base_url", "max_tokens", "reasoning_effort", "reasoning_disabled",
                 "providers_allowed", "providers_ignored", "providers_order", "provider_sort")


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class RequestHasher:
    """The hash of the canonical request a client sends: the client's kind, its body settings, tools and messages.

    Each message (and tool) is hashed once while it lives (found by identity), so a
    call hashes what the last turn added and 16 bytes per earlier message.
    """

    def __init__(self, client):
        settings = getattr(client, "settings", None)
        head = [getattr(client, "name", type(client).__qualname__)]
        head += [getattr(settings, name, None) for name in BODY_SETTINGS]
        self._head = _digest(canonical_json(head))
        self._messages = WireCache(lambda message: _digest(canonical_json(message_form(message))))
        self._tools = WireCache(lambda tool: _digest(canonical_json([tool.name, tool.description, tool.parameters])))

    def digest(self, messages, tools) -> str:
        """The request's hash, 32 hex digits."""
        state = self.start(tools)
        state.update(b"".join(map(self._messages, messages)))
        return state.hexdigest()

    def start(self, tools):
        """The hash state of a request with ``tools`` before its messages (``update`` it with ``message``)."""
        return hashlib.blake2b(b"".join([self._head, *map(self._tools, tools), b"|"]), digest_size=16)

    def message(self, message) -> bytes:
        """What one message adds to a request's hash."""
        return self._messages(message)


class SessionReplay:
    """One session's lookups: ``lookup`` before each model call, ``record`` with a live answer."""

    __slots__ = ("key", "recorded", "hasher", "sink", "cache", "sample", "replayed", "_request", "_state", "_count",
                 "_last", "_tools", "on_replayed")

    def __init__(self, key: str, recorded: Optional[dict], hasher: RequestHasher,
                 sink: Callable[[str, str, ModelResponse], None], cache=None, sample: int = 0,
                 on_replayed: Optional[Callable] = None):
        self.key = key
        self.on_replayed = on_replayed  # told of each answer replayed from the journal (--batch_api: not collected)
        self.sample = sample  # --samples_per_prompt: each sample has answers of its own in the cache
        self.recorded = recorded or None  # {hash: answer} of the cut-off session; None once live
        self.hasher, self.sink, self.cache = hasher, sink, cache
        self.replayed = 0  # answers used without a call
        self._request: Optional[str] = None  # the hash of the request looked up last
        # The hash of the conversation so far, carried on: a request is the last one and what the turn added.
        self._state, self._count, self._last, self._tools = None, 0, None, None

    def digest(self, messages, tools) -> str:
        """``hasher.digest(messages, tools)``, hashing only the messages added since the last request."""
        count = self._count
        if (self._state is None or count == 0 or tools is not self._tools or len(messages) < count
                or messages[count - 1] is not self._last):
            self._state, count = self.hasher.start(tools), 0
        state = self._state
        for message in messages[count:]:
            state.update(self.hasher.message(message))
        self._count, self._last, self._tools = len(messages), messages[-1] if messages else None, tools
        return state.copy().hexdigest()

    def lookup(self, messages, tools) -> Optional[ModelResponse]:
        """The recorded answer to this request (journal, then cache), or None: send it, then ``record``."""
        request = self._request = self.digest(messages, tools)
        if self.recorded is not None:
            answer = self.recorded.pop(request, None)
            if answer is not None:
                try:
                    response = decode_response(answer)
                except ValueError:
                    response = None
                if response is not None:
                    self.replayed += 1
                    if self.on_replayed is not None:
                        self.on_replayed(messages, tools)
                    return response
            self.recorded = None  # the first request that differs: live from here on
        if self.cache is not None:
            response = self.cache.get(self._cache_key(request))
            if response is not None:
                self.sink(self.key, request, response)  # journaled: a resume replays it like a paid answer
                self.replayed += 1
                return response
        return None

    def record(self, response: ModelResponse) -> None:
        """Keep the live answer to the request looked up last, before the session acts on it."""
        request, self._request = self._request, None
        if request is None:
            return
        self.sink(self.key, request, response)
        if self.cache is not None:
            self.cache.put(self._cache_key(request), response)

    def _cache_key(self, request: str) -> str:
        return f"{request}/{self.sample}" if self.sample else request


def replay_key(job) -> str:
    """The key a prompt's answers are kept under in the replay journal: its sample's content key (a resume
    finds a sample by it), so the samples of a row in flight at once keep their answers apart."""
    return job.content_key


class Replayer:
    """The run's (or a worker's) maker of SessionReplays: ``journal.write`` receives every live answer."""

    def __init__(self, journal, client, cache=None):
        self.journal = journal  # a ResponseJournal, or a worker's relay with the same ``write``
        self.hasher = RequestHasher(client)
        self.cache = cache
        self.on_replayed = getattr(client, "replayed", None)  # the --batch_api client's

    def session(self, key: str, recorded: Optional[dict] = None, sample: int = 0) -> SessionReplay:
        return SessionReplay(key, recorded, self.hasher, self.journal.write, self.cache, sample, self.on_replayed)
