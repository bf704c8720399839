"""The batch endpoints of the scripted model server: OpenAI's Files + Batches, Anthropic's Message Batches.

OpenAI: ``POST /v1/files`` (a JSONL upload, purpose ``batch``), ``POST /v1/batches``,
``GET /v1/batches[/{id}]``, ``POST /v1/batches/{id}/cancel`` and ``GET
/v1/files/{id}/content`` for the output and error files.  Anthropic: ``POST
/v1/messages/batches``, ``GET /v1/messages/batches[/{id}]``, ``POST
.../{id}/cancel`` and ``GET .../{id}/results`` (JSONL).

A batch is processed ``BatchSettings.delay`` seconds after it was created: each
of its requests is then answered by the server's script like a synchronous
request (counted, recorded, error rules applied), its answer kept in the output
(a success) or error file.  A batch that ``BatchSettings.expire`` picks ends
expired at that time with none of its requests processed; one cancelled before
then ends cancelled, likewise.  ``processed`` counts the requests processed, by
the SHA-256 of their body, so a test can see that none was paid for twice.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import hashlib
import json
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Union

import attrs
from aiohttp import web

from .wire import error_body

if TYPE_CHECKING:
    from .server import ScriptedModelServer


@attrs.frozen
class BatchSettings:
    """How the scripted server processes batches.

    ``delay``: seconds from a batch's creation to its end (a number, or a callable of the batch's number,
    1 for the first batch the server received).  ``expire``: a callable of the batch's number, True for a
    batch that ends expired, none of its requests processed.  ``enabled=False``: the endpoint has no batch
    API (every batch route answers 404, as an endpoint without it does).  Faults: ``max_bytes`` refuses an
    upload (OpenAI) or a create call (Anthropic) larger than that with 413; ``results(kind, data)`` rewrites
    a results file before it is served (``kind``: ``"output"`` or ``"errors"`` for OpenAI's files,
    ``"results"`` for Anthropic's), returning its bytes or ``(bytes, headers)`` (a ``Content-Encoding``
    header says the bytes are compressed so); ``list_status`` answers the listing of batches (the check a
    run makes at start) with that error status.
    """

    delay: Union[float, Callable[[int], float]] = 0.0
    expire: Optional[Callable[[int], bool]] = None
    enabled: bool = True
    max_bytes: Optional[int] = None
    results: Optional[Callable[[str, bytes], Union[bytes, tuple]]] = None
    list_status: Optional[int] = None


@attrs.define
class _Batch:
    api: str
    id: str
    number: int
    lines: list  # (custom_id, body) of each request
    created: float
    status: str = "in_progress"  # in_progress, canceling, ended (completed / expired / cancelled)
    outcome: str = ""  # "completed", "expired", "cancelled" once ended
    ended: Optional[float] = None
    results: dict = attrs.field(factory=dict)  # custom_id -> (status, body) of the requests processed
    output_file: Optional[str] = None
    error_file: Optional[str] = None
    task: Optional[asyncio.Task] = None


def _iso(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


def body_digest(body) -> str:
    """The SHA-256 of a request body as ``processed`` counts it (its JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class BatchEndpoints:
    """The batch routes of one ScriptedModelServer, and what they hold."""

    def __init__(self, server: "ScriptedModelServer", settings: BatchSettings):
        self.server = server
        self.settings = settings
        self._lock = threading.Lock()
        self._files: dict = {}  # id -> bytes
        self._batches: dict = {}  # id -> _Batch
        self._count = 0
        self.processed: collections.Counter = collections.Counter()  # body digest -> times processed
        self.created = 0  # batches created
        self.cancelled = 0  # cancel calls
        self.too_large = 0  # uploads and create calls refused with 413 (BatchSettings.max_bytes)
        self._kinds: dict = {}  # file id -> "output" or "errors"

    async def aclose(self) -> None:
        """Stop processing the batches still in progress (the server is stopping)."""
        tasks = [b.task for b in self._batches.values() if b.task is not None and not b.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        guard = self._guarded
        router.add_post("/v1/files", guard(self._upload))
        router.add_get("/v1/files/{id}/content", guard(self._file_content))
        router.add_post("/v1/batches", guard(self._openai_create))
        router.add_get("/v1/batches", guard(self._list))
        router.add_get("/v1/batches/{id}", guard(self._retrieve))
        router.add_post("/v1/batches/{id}/cancel", guard(self._cancel))
        router.add_post("/v1/messages/batches", guard(self._anthropic_create))
        router.add_get("/v1/messages/batches", guard(self._list))
        router.add_get("/v1/messages/batches/{id}", guard(self._retrieve))
        router.add_post("/v1/messages/batches/{id}/cancel", guard(self._cancel))
        router.add_get("/v1/messages/batches/{id}/results", guard(self._anthropic_results))

    # --- observing ---------------------------------------------------------------------------

    @property
    def requests_processed(self) -> int:
        with self._lock:
            return sum(self.processed.values())

    @property
    def batch_sizes(self) -> list:
        """The number of requests of each batch created, in order."""
        with self._lock:
            return [len(b.lines) for b in sorted(self._batches.values(), key=lambda b: b.number)]

    # --- common ----------------------------------------------------------------------------------

    @staticmethod
    def _api(http: web.Request) -> str:
        return "anthropic" if http.path.startswith("/v1/messages/") else "openai"

    def _guarded(self, handler: Callable) -> Callable:
        """``handler`` behind what every batch route answers first: 404 without a batch API, 401 for a bad key."""

        async def guarded(http: web.Request) -> web.Response:
            refused = self._refuse(http)
            return refused if refused is not None else await handler(http)

        return guarded

    def _refuse(self, http: web.Request) -> Optional[web.Response]:
        api = self._api(http)
        if not self.settings.enabled:
            return web.json_response(error_body(api, 404, f"Not found: {http.path}"), status=404)
        if not self.server._authorized(http):
            message = "invalid x-api-key" if api == "anthropic" else "Incorrect API key provided."
            return web.json_response(error_body(api, 401, message), status=401)
        return None

    def _bad(self, api: str, message: str, status: int = 400) -> web.Response:
        return web.json_response(error_body(api, status, message), status=status)

    def _new_id(self, prefix: str) -> str:
        with self._lock:
            self._count += 1
            return f"{prefix}{self._count:06d}"

    def _start(self, api: str, lines: list) -> _Batch:
        with self._lock:
            self.created += 1
            number = self.created
        batch = _Batch(api, self._new_id("batch_hb" if api == "openai" else "msgbatch_hb"), number, lines, time.time())
        self._batches[batch.id] = batch
        batch.task = asyncio.get_running_loop().create_task(self._process(batch))
        return batch

    def _batch(self, http: web.Request) -> Optional[_Batch]:
        batch = self._batches.get(http.match_info["id"])
        return batch if batch is not None and batch.api == self._api(http) else None

    async def _process(self, batch: _Batch) -> None:
        delay = self.settings.delay
        delay = delay(batch.number) if callable(delay) else delay
        if delay > 0:
            await asyncio.sleep(delay)
        if self.settings.expire is not None and self.settings.expire(batch.number):
            self._end(batch, "expired")
            return
        headers = {"anthropic-version": "2023-06-01"} if batch.api == "anthropic" else {}
        for custom_id, body in batch.lines:
            if batch.status != "in_progress":
                break  # cancelled meanwhile
            with self._lock:
                self.processed[body_digest(body)] += 1
            response, _reply = await self.server.answer(batch.api, body, headers, in_batch=True)
            try:
                answer = json.loads(response.body)
            except ValueError:
                answer = {"error": {"message": "unreadable answer"}}
            batch.results[custom_id] = (response.status, answer)
        self._end(batch, "cancelled" if batch.status == "canceling" else "completed")

    def _end(self, batch: _Batch, outcome: str) -> None:
        batch.status, batch.outcome, batch.ended = "ended", outcome, time.time()
        if batch.api == "openai":
            output, errors = [], []
            for custom_id, _body in batch.lines:
                line = {"id": f"batch_req_{self._new_id('')}", "custom_id": custom_id, "response": None, "error": None}
                if custom_id in batch.results:
                    status, answer = batch.results[custom_id]
                    line["response"] = {"status_code": status, "request_id": f"req_{custom_id}", "body": answer}
                    (output if status == 200 else errors).append(line)
                else:
                    code = "batch_expired" if outcome == "expired" else "batch_cancelled"
                    line["error"] = {"code": code, "message": f"This request could not be executed: the batch {outcome}."}
                    errors.append(line)
            if output:
                batch.output_file = self._store(output)
                self._kinds[batch.output_file] = "output"
            if errors:
                batch.error_file = self._store(errors)
                self._kinds[batch.error_file] = "errors"

    def _store(self, lines: list) -> str:
        file_id = self._new_id("file-hb")
        self._files[file_id] = "".join(json.dumps(line) + "\n" for line in lines).encode()
        return file_id

    def _served(self, kind: str, data: bytes, content_type: str) -> web.Response:
        headers = {}
        if self.settings.results is not None:
            data = self.settings.results(kind, data)
            if isinstance(data, tuple):
                data, headers = data
        return web.Response(body=data, content_type=content_type, headers=headers)

    def _too_large(self, api: str, size: int) -> Optional[web.Response]:
        limit = self.settings.max_bytes
        if limit is None or size <= limit:
            return None
        with self._lock:
            self.too_large += 1
        return self._bad(api, f"Request of {size} bytes is larger than the {limit} bytes allowed.", 413)

    async def _list(self, http: web.Request) -> web.Response:
        api = self._api(http)
        if self.settings.list_status is not None:
            return self._bad(api, f"Scripted error {self.settings.list_status}.", self.settings.list_status)
        data = [self._render(b) for b in self._batches.values() if b.api == api]
        if api == "anthropic":
            return web.json_response({"data": data, "has_more": False, "first_id": None, "last_id": None})
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def _retrieve(self, http: web.Request) -> web.Response:
        batch = self._batch(http)
        if batch is None:
            return self._bad(self._api(http), f"No batch {http.match_info['id']}.", 404)
        return web.json_response(self._render(batch))

    async def _cancel(self, http: web.Request) -> web.Response:
        batch = self._batch(http)
        if batch is None:
            return self._bad(self._api(http), f"No batch {http.match_info['id']}.", 404)
        with self._lock:
            self.cancelled += 1
        if batch.status == "in_progress":
            batch.status = "canceling"
            if batch.task is not None and not batch.results:  # not yet processing: it ends now
                batch.task.cancel()
                self._end(batch, "cancelled")
        return web.json_response(self._render(batch))

    def _render(self, batch: _Batch) -> dict:
        if batch.api == "anthropic":
            counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
            if batch.status != "ended":
                counts["processing"] = len(batch.lines)
            else:
                for custom_id, _body in batch.lines:
                    counts[self._anthropic_kind(batch, custom_id)] += 1
            ended = batch.status == "ended"
            return {
                "id": batch.id, "type": "message_batch",
                "processing_status": batch.status,
                "request_counts": counts,
                "created_at": _iso(batch.created),
                "expires_at": _iso(batch.created + 86400),
                "ended_at": _iso(batch.ended) if ended else None,
                "cancel_initiated_at": None,
                "archived_at": None,
                "results_url": f"{self.server.url}/v1/messages/batches/{batch.id}/results" if ended else None,
            }
        status = {"in_progress": "in_progress", "canceling": "cancelling"}.get(batch.status, batch.outcome)
        done = sum(1 for s, _a in batch.results.values() if s == 200)
        return {
            "id": batch.id, "object": "batch", "endpoint": "/v1/chat/completions", "completion_window": "24h",
            "input_file_id": "file-hb-input", "created_at": int(batch.created), "status": status,
            "output_file_id": batch.output_file, "error_file_id": batch.error_file,
            "request_counts": {"total": len(batch.lines), "completed": done, "failed": len(batch.results) - done},
            "completed_at": int(batch.ended) if batch.outcome == "completed" else None,
            "expired_at": int(batch.ended) if batch.outcome == "expired" else None,
            "cancelled_at": int(batch.ended) if batch.outcome == "cancelled" else None,
        }

    # --- OpenAI ------------------------------------------------------------------------------------

    async def _upload(self, http: web.Request) -> web.Response:
        if http.content_length is not None and (refused := self._too_large("openai", http.content_length)):
            return refused
        form = await http.post()
        upload = form.get("file")
        if not hasattr(upload, "file") or form.get("purpose") != "batch":
            return self._bad("openai", "Upload a file with purpose 'batch'.")
        data = upload.file.read()
        file_id = self._new_id("file-hb")
        self._files[file_id] = data
        return web.json_response({
            "id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
            "filename": upload.filename or "batch.jsonl", "purpose": "batch", "status": "processed",
        })

    async def _openai_create(self, http: web.Request) -> web.Response:
        try:
            body = await http.json()
            data = self._files[body["input_file_id"]]
            if body.get("endpoint") != "/v1/chat/completions":
                raise ValueError(f"endpoint {body.get('endpoint')!r} is not served here")
            lines = []
            for text in data.decode().splitlines():
                if text.strip():
                    line = json.loads(text)
                    if line.get("method") != "POST" or line.get("url") != "/v1/chat/completions":
                        raise ValueError("each line must POST to /v1/chat/completions")
                    lines.append((line["custom_id"], line["body"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            return self._bad("openai", f"Invalid batch: {exc}")
        if len({c for c, _b in lines}) != len(lines):
            return self._bad("openai", "custom_id values must be unique within a batch.")
        return web.json_response(self._render(self._start("openai", lines)))

    async def _file_content(self, http: web.Request) -> web.Response:
        data = self._files.get(http.match_info["id"])
        if data is None:
            return self._bad("openai", f"No such File object: {http.match_info['id']}", 404)
        kind = self._kinds.get(http.match_info["id"])
        if kind is None:
            return web.Response(body=data, content_type="application/octet-stream")
        return self._served(kind, data, "application/octet-stream")

    # --- Anthropic ---------------------------------------------------------------------------------

    async def _anthropic_create(self, http: web.Request) -> web.Response:
        if http.content_length is not None and (refused := self._too_large("anthropic", http.content_length)):
            return refused
        try:
            body = await http.json()
            lines = [(r["custom_id"], r["params"]) for r in body["requests"]]
        except (ValueError, KeyError, TypeError) as exc:
            return self._bad("anthropic", f"Invalid batch: {exc}")
        if not lines or len({c for c, _b in lines}) != len(lines):
            return self._bad("anthropic", "requests must be a non-empty list with unique custom_id values.")
        return web.json_response(self._render(self._start("anthropic", lines)))

    @staticmethod
    def _anthropic_kind(batch: _Batch, custom_id: str) -> str:
        if custom_id in batch.results:
            return "succeeded" if batch.results[custom_id][0] == 200 else "errored"
        return "expired" if batch.outcome == "expired" else "canceled"

    async def _anthropic_results(self, http: web.Request) -> web.Response:
        batch = self._batch(http)
        if batch is None or batch.status != "ended":
            return self._bad("anthropic", "No results: the batch has not ended.", 404)
        out = []
        for custom_id, _body in batch.lines:
            kind = self._anthropic_kind(batch, custom_id)
            result: dict = {"type": kind}
            if kind == "succeeded":
                result["message"] = batch.results[custom_id][1]
            elif kind == "errored":
                result["error"] = batch.results[custom_id][1]
            out.append(json.dumps({"custom_id": custom_id, "result": result}) + "\n")
        return self._served("results", "".join(out).encode(), "application/binary")
