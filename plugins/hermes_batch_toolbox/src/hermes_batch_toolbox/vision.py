"""The ``vision`` toolset: ``vision_analyze(image_url, question)`` by a multimodal model.

The model is reached through an OpenAI-compatible chat-completions endpoint:
by default the run's own (``--base_url``, its key and its ``--model``), else the
one ``-T vision.base_url=`` names.  The image always travels as a data: URL, so
the model sees exactly the bytes the tool loaded (from a URL, a data: URL or a
file in the prompt's sandbox).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import attrs

from hermes_batch import Tool, ToolContext, ToolsetRuntime

from .endpoint import call_error_text, read_secret
from .images import ImageError, data_url, load_image
from .options import positive
from .urls import AddressPolicy, allowed_addresses

PROMPT = (
    "Fully describe and explain everything about this image, then answer the following question:\n\n{question}"
)


@attrs.frozen
class VisionConfig:
    """Options of the vision toolset (``-T vision.KEY=VALUE``)."""

    model: Optional[str] = None  # a multimodal model; default: the run's --model
    base_url: Optional[str] = None  # an OpenAI-compatible endpoint; default: the run's --base_url
    api_key_env: Optional[str] = None  # variable holding its key; default: the run's key (with the run's endpoint)
    max_tokens: int = attrs.field(default=2000, validator=positive)
    max_image_bytes: int = attrs.field(default=10_000_000, validator=positive)
    timeout: float = attrs.field(default=120.0, validator=positive)  # seconds per image download and per model call
    allow_private: bool = False  # let image URLs point at loopback and private addresses
    allow_addresses: Any = attrs.field(default=(), converter=allowed_addresses)  # private addresses they may


class VisionRuntime(ToolsetRuntime):
    """The endpoint and model that answer ``vision_analyze``."""

    def __init__(self, config: VisionConfig, model):
        super().__init__(config, model)
        self.endpoint = None  # an Endpoint, made at start
        self.images = None

    @property
    def model_name(self) -> str:
        return self.config.model or self.model.model

    def unavailable_reason(self) -> Optional[str]:
        cfg = self.config
        if cfg.api_key_env and not read_secret(cfg.api_key_env):
            return f"the environment variable {cfg.api_key_env} named by -T vision.api_key_env is not set."
        if cfg.base_url is None and "anthropic.com" in self.model.base_url:
            return "vision needs an OpenAI-compatible endpoint; pass -T vision.base_url=... and -T vision.api_key_env=..."
        return None

    async def start(self, run, client) -> None:
        from .endpoint import Endpoint
        from .net import client_session

        await super().start(run, client)
        cfg = self.config
        if cfg.base_url is None:  # the run's endpoint: its key and its limiter (rate limits, --max_cost)
            self.endpoint = Endpoint(self.model.base_url, self.model.api_key, client.limiter, cfg.timeout)
        else:
            self.endpoint = Endpoint(cfg.base_url, read_secret(cfg.api_key_env), None, cfg.timeout)
        self.policy = AddressPolicy.of(cfg)
        self.images = client_session(self.policy)

    async def shutdown(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.aclose()
        if self.images is not None:
            await self.images.close()


class VisionAnalyzeTool(Tool):
    name = "vision_analyze"
    description = (
        "Analyze an image with a vision model: a complete description of the image and an answer to your "
        "question about it. image_url is an http(s) URL or a path to an image file in your sandbox."
    )
    parameters = {
        "type": "object",
        "properties": {
            "image_url": {"type": "string", "description": "Image URL (http/https) or file path in your sandbox."},
            "question": {
                "type": "string",
                "description": "Your specific question or request about the image. The model also describes the whole image.",
            },
        },
        "required": ["image_url", "question"],
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        runtime: VisionRuntime = ctx.session("vision").runtime
        cfg = runtime.config
        try:
            data, mime = await load_image(
                arguments["image_url"], ctx, runtime.images,
                max_bytes=cfg.max_image_bytes, timeout=cfg.timeout, policy=runtime.policy,
            )
        except ImageError as exc:
            return {"success": False, "error": str(exc)}
        body = {
            "model": runtime.model_name,
            "max_tokens": cfg.max_tokens,
            "messages": [{
                "role": "user",
                "content": [
                    {"type": "text", "text": PROMPT.format(question=arguments["question"])},
                    {"type": "image_url", "image_url": {"url": data_url(data, mime)}},
                ],
            }],
        }
        try:
            answer, usage = await runtime.endpoint.post("/chat/completions", body)
        except Exception as exc:  # a refusal or an endpoint that stayed down fails this call, not the prompt
            return {"success": False, "error": f"The vision model could not be asked: {call_error_text(exc)}"}
        ctx.report_usage(usage)
        analysis, reasoned = chat_text(answer)
        if not analysis:
            if reasoned:
                return {"success": False, "error": (
                    "The vision model answered with reasoning only and no text; "
                    f"it may need more than -T vision.max_tokens={cfg.max_tokens}.")}
            return {"success": False, "error": "The vision model answered with no text."}
        return {"success": True, "analysis": analysis}


# reasoning written into the content, as some models do (an unclosed block runs to the end)
_INLINE_REASONING = re.compile(r"<(think|thinking|reasoning|REASONING_SCRATCHPAD)>.*?(?:</\1>|\Z)", re.DOTALL | re.IGNORECASE)
_REASONING_FIELDS = ("reasoning", "reasoning_content", "reasoning_details")


def chat_text(answer: dict) -> tuple[str, bool]:
    """(the answer's text without its reasoning, whether it had reasoning) of a chat-completions answer.

    Reasoning never becomes the tool's result: the model's thoughts are not the
    analysis, and a trajectory would show them as if the tool had said them.
    """
    try:
        message = answer["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return "", False
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    content = content if isinstance(content, str) else ""
    text = _INLINE_REASONING.sub("", content).strip()
    reasoned = text != content.strip() or any(message.get(field) for field in _REASONING_FIELDS)
    return text, reasoned


VISION_TOOLS = (VisionAnalyzeTool,)
