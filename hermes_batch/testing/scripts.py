"""What a script sees and answers (``ScriptRequest``, ``Reply``) and ready-made scripts.

A script is any callable ``(ScriptRequest) -> Reply``, sync or async, served by
:class:`~hermes_batch.testing.server.ScriptedModelServer`.
"""

from __future__ import annotations

import hashlib
from typing import Awaitable, Callable, Iterable, Mapping, Optional, Union

import attrs

from ..contract.interfaces import PREFLIGHT_PROMPT
from ..formats.records import Usage

REASONING_FORMATS = ("reasoning", "reasoning_details", "reasoning_content", "think_tags", "scratchpad", "none")


@attrs.frozen
class ScriptRequest:
    """One request as the script sees it, whichever API it came through.

    ``messages`` are normalized to the OpenAI shape (``role``, ``content`` as text,
    ``images`` for the URLs of multimodal ``image_url`` parts, ``tool_calls``,
    ``tool_call_id``); reasoning sent back by the client, in any
    format, is under ``reasoning``.  Anthropic requests become a leading ``system``
    message, ``tool`` messages for ``tool_result`` blocks (``is_error`` kept), and
    assistant messages whose thinking blocks carry ``reasoning_signature_valid``.
    """

    api: str  # "openai" or "anthropic"
    model: str
    messages: tuple  # of dict
    tools: tuple = ()  # names of the tools offered
    body: dict = attrs.field(factory=dict)
    headers: dict = attrs.field(factory=dict)
    sample: int = 0
    """Which session of this prompt the request belongs to, from 0, in the order the server saw them start:
    a run's samples of one row (--samples_per_prompt) are its sessions, so a script can fail the first
    two and pass the third.  A request without tool results starts a session; a later turn belongs to
    the session whose reply made the tool calls it answers."""

    @property
    def prompt(self) -> str:
        """Text of the first user message."""
        return next((m["content"] for m in self.messages if m["role"] == "user"), "")

    @property
    def preflight(self) -> bool:
        """True for the probe hermes-batch sends before a run (``ModelClient.preflight``)."""
        return not self.tools and self.prompt == PREFLIGHT_PROMPT

    @property
    def images(self) -> tuple:
        """URLs (often data: URLs) of the images in the last user message; see ``testing.images``."""
        for m in reversed(self.messages):
            if m["role"] == "user":
                return tuple(m.get("images", ()))
        return ()

    @property
    def turn(self) -> int:
        """Number of assistant messages already in the conversation."""
        return sum(1 for m in self.messages if m["role"] == "assistant")

    @property
    def tool_results(self) -> list:
        """Contents of the tool results sent after the last assistant message."""
        results = []
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                break
            if m["role"] == "tool":
                results.append(m["content"])
        return results[::-1]


def _to_tuple(calls: Iterable) -> tuple:
    return tuple(tuple(c) for c in calls)


@attrs.frozen
class Reply:
    """What the script answers; rendered in the format of the API that was called.

    ``tool_calls`` holds ``(name, arguments)`` pairs; a string ``arguments`` is sent
    verbatim (to test invalid JSON).  ``usage=None`` estimates tokens from text
    lengths; its numbers are sent as given, also those JSON cannot hold
    (``float("nan")`` goes out as ``NaN``).  ``raw_usage`` is JSON text sent
    verbatim as the answer's ``usage`` object instead: numbers as an endpoint
    may spell them (``1e999``, ``-1``, thirty digits) and fields of any type.
    A ``status`` other than 200 sends the provider's error body with
    ``error_message``.  With the Anthropic API any ``reasoning_format`` except
    ``"none"`` gives a signed ``thinking`` block.

    How the answer travels: ``trickle`` sends the headers at once and then the
    body one byte every ``trickle`` seconds (an endpoint that stalls); ``gzip``
    compresses the body (``Content-Encoding: gzip``); ``padding`` adds that
    many bytes of whitespace after the JSON, which JSON allows, so with ``gzip``
    a small answer expands to a big one (a decompression bomb).
    """

    content: str = ""
    reasoning: Optional[str] = None
    reasoning_format: str = attrs.field(default="reasoning", validator=attrs.validators.in_(REASONING_FORMATS))
    tool_calls: tuple = attrs.field(default=(), converter=_to_tuple)
    finish_reason: Optional[str] = None  # default: "tool_calls" with calls, else "stop"
    usage: Optional[Usage] = None
    provider: Optional[str] = None  # OpenRouter's top-level "provider" (in error replies: error.metadata.provider_name)
    status: int = 200
    headers: dict = attrs.field(factory=dict)
    error_message: Optional[str] = None
    error_type: Optional[str] = None  # default: the provider's type for ``status``
    raw_usage: Optional[str] = None
    trickle: Optional[float] = None
    gzip: bool = False
    padding: int = 0


Script = Callable[[ScriptRequest], Union[Reply, Awaitable[Reply]]]


def _prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:8]


@attrs.frozen
class ToolLoopScript:
    """Call ``tool`` while ``turn < tool_calls``, then give a final answer.

    ``command``, ``reasoning`` and ``final`` are ``str.format`` templates with the
    fields ``prompt``, ``prompt_hash`` (8 hex digits), ``turn``, ``model``,
    ``tool_calls``, ``last_result`` (content of the last tool result, "" if none)
    and, in ``command`` only, ``call`` (index of the call within the turn).  Each
    tool-calling turn makes ``calls_per_turn`` calls with arguments
    ``{"command": command}``.  ``reasoning=None`` sends no reasoning.
    """

    tool_calls: int = 2
    command: str = "echo {prompt_hash}-{turn}"
    tool: str = "terminal"
    reasoning: Optional[str] = "Let me think about step {turn}."
    reasoning_format: str = attrs.field(default="reasoning", validator=attrs.validators.in_(REASONING_FORMATS))
    final: str = "Done: {last_result}"
    calls_per_turn: int = 1

    def __call__(self, request: ScriptRequest) -> Reply:
        results = request.tool_results
        fields = dict(
            prompt=request.prompt,
            prompt_hash=_prompt_hash(request.prompt),
            turn=request.turn,
            model=request.model,
            tool_calls=self.tool_calls,
            last_result=results[-1] if results else "",
        )
        reasoning = self.reasoning.format(**fields) if self.reasoning is not None else None
        if request.turn < self.tool_calls:
            commands = (self.command.format(call=i, **fields) for i in range(self.calls_per_turn))
            calls = [(self.tool, {"command": command}) for command in commands]
            return Reply(reasoning=reasoning, reasoning_format=self.reasoning_format, tool_calls=calls)
        return Reply(content=self.final.format(**fields), reasoning=reasoning, reasoning_format=self.reasoning_format)


@attrs.frozen
class RoutedScript:
    """Dispatch on the prompt: ``routes`` maps prompt text to a script, or is a function returning one (or None).

    With ``by="model"`` the requested model is the key instead: one server then
    plays several models (the reference and aggregator models of a mixture of
    agents, a vision model beside the agent's).  With ``by="sample"`` it is
    ``ScriptRequest.sample`` (an int): each sample of a row follows its own script.
    """

    routes: Union[Mapping[str, Script], Callable[[str], Optional[Script]]]
    default: Optional[Script] = None
    by: str = attrs.field(default="prompt", validator=attrs.validators.in_(("prompt", "model", "sample")))

    def __call__(self, request: ScriptRequest) -> Union[Reply, Awaitable[Reply]]:
        routes = self.routes
        key = {"model": request.model, "sample": request.sample}.get(self.by, request.prompt)
        script = routes.get(key) if isinstance(routes, Mapping) else routes(key)
        script = script or self.default
        if script is None:
            raise LookupError(f"RoutedScript has no route for {self.by} {key[:80]!r} and no default")
        return script(request)


def draw(*parts) -> float:
    """A number in [0, 1) fixed by ``parts``: the same sample draws the same number on every run."""
    digest = hashlib.sha256("\0".join(map(str, parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:7], "big") / (1 << 56)


@attrs.frozen
class PassRateScript:
    """Answer each prompt in one turn, right with the prompt's own probability ``rates(prompt)``.

    Whether sample ``i`` of a prompt is right is fixed by ``(seed, prompt, i)``, so a resume, or the same
    rows run under another allocation, sees the same answers.  Rows carry ``right`` as their ``answer``
    for the answer verifier.  Each call reports ``prompt_tokens`` (the prompt's length / 4 + 60),
    ``completion_tokens`` (20 to 200, drawn) and their cost at ``prices`` (USD per token, prompt and
    completion), and takes ``delay`` seconds (times 0.5 to 1.5, drawn).
    """

    rates: Callable[[str], float]
    right: str = "42"
    wrong: str = "41"
    seed: int = 0
    prices: tuple = (3e-6, 15e-6)
    delay: float = 0.0

    async def __call__(self, request: ScriptRequest) -> Reply:
        import asyncio

        prompt = request.prompt
        if request.preflight:
            return Reply(content="ok")
        tokens_in = len(prompt) // 4 + 60
        tokens_out = 20 + int(180 * draw(self.seed, "tokens", prompt, request.sample))
        if self.delay:
            await asyncio.sleep(self.delay * (0.5 + draw(self.seed, "delay", prompt, request.sample)))
        right = draw(self.seed, "answer", prompt, request.sample) < self.rates(prompt)
        cost = tokens_in * self.prices[0] + tokens_out * self.prices[1]
        return Reply(content=f"The answer is {self.right if right else self.wrong}.", reasoning="Working it out.",
                     usage=Usage(tokens_in, tokens_out, 0, 0, round(cost, 9)))


@attrs.frozen
class ImageRequest:
    """A ``POST /v1/images/generations`` request as the images script sees it."""

    model: str
    prompt: str
    size: Optional[str] = None
    n: int = 1
    response_format: Optional[str] = None  # "url" or "b64_json"
    body: dict = attrs.field(factory=dict)


@attrs.frozen
class ImageReply:
    """What the images script answers.

    ``image`` is the PNG (or other) bytes; None makes a small PNG whose colour
    comes from the prompt.  The image is sent as ``b64_json`` when the request
    asks for it or the model is a ``gpt-image-*`` (which always answers so),
    else as a ``url`` the server itself serves.  A ``status`` other than 200
    sends an OpenAI error body with ``error_message``.
    """

    image: Optional[bytes] = None
    status: int = 200
    error_message: Optional[str] = None
    usage: Optional[Usage] = None  # reported as the images API's input/output tokens
    raw_usage: Optional[str] = None  # JSON text sent verbatim as the answer's usage object instead (see Reply)
