"""The ``image_gen`` toolset: ``image_generate(prompt, aspect_ratio)``.

Providers: ``openai``, any OpenAI-compatible ``POST /images/generations`` (the
run's endpoint by default), and ``fal``, FAL's synchronous ``POST
https://fal.run/<model>``.  An answer with an image URL is returned as that URL;
an answer with the image's bytes (``b64_json``) is saved as a file in the
prompt's sandbox and its path is returned (``download=true`` saves URL answers
too).  The result is ``{"success": true, "image": URL or path}`` as in the
Hermes agent.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
from typing import Optional

import attrs

from hermes_batch import Tool, ToolContext, ToolsetRuntime

from .endpoint import call_error_text, read_secret
from .images import ImageError, image_filename, load_image, sniff
from .options import positive
from .urls import AddressPolicy

ASPECT_RATIOS = ("landscape", "square", "portrait")
# OpenAI sizes: gpt-image-* and dall-e-3 differ in their wide and tall sizes
_GPT_IMAGE_SIZES = {"landscape": "1536x1024", "square": "1024x1024", "portrait": "1024x1536"}
_DALLE_SIZES = {"landscape": "1792x1024", "square": "1024x1024", "portrait": "1024x1792"}
_FAL_SIZES = {"landscape": "landscape_16_9", "square": "square_hd", "portrait": "portrait_16_9"}
PROVIDERS = {"openai": (None, None), "fal": ("https://fal.run", "FAL_KEY")}  # name -> (default URL, key variable)
FAL_DEFAULT_MODEL = "fal-ai/flux/schnell"


@attrs.frozen
class ImageGenConfig:
    """Options of the image_gen toolset (``-T image_gen.KEY=VALUE``)."""

    provider: str = attrs.field(default="openai", validator=attrs.validators.in_(tuple(PROVIDERS)))
    model: Optional[str] = None  # openai: required (gpt-image-1, dall-e-3, ...); fal: fal-ai/flux/schnell
    base_url: Optional[str] = None  # openai: the run's --base_url; fal: https://fal.run
    api_key_env: Optional[str] = None  # openai: the run's key; fal: FAL_KEY
    download: bool = False  # also save images answered by URL into the sandbox
    folder: str = "generated_images"  # sandbox folder of saved images
    max_image_bytes: int = attrs.field(default=25_000_000, validator=positive)
    timeout: float = attrs.field(default=180.0, validator=positive)


class ImageGenRuntime(ToolsetRuntime):
    """The images endpoint of a run."""

    def __init__(self, config: ImageGenConfig, model):
        super().__init__(config, model)
        default_url, key_variable = PROVIDERS[config.provider]
        self.key_variable = config.api_key_env or key_variable
        self.base_url = config.base_url or default_url
        self.model_name = config.model or (FAL_DEFAULT_MODEL if config.provider == "fal" else None)
        self.endpoint = None  # an Endpoint, made at start
        self.downloads = None

    def unavailable_reason(self) -> Optional[str]:
        if self.model_name is None:
            return (
                "no image model is configured; pass -T image_gen.model=MODEL for an OpenAI-compatible images "
                "endpoint, or -T image_gen.provider=fal with the key in FAL_KEY."
            )
        if self.key_variable and not read_secret(self.key_variable):
            return f"the {self.config.provider} images provider needs a key, but {self.key_variable} is not set."
        return None

    async def start(self, run, client) -> None:
        from .endpoint import Endpoint
        from .net import client_session

        await super().start(run, client)
        cfg = self.config
        if cfg.provider == "fal":
            self.endpoint = Endpoint(self.base_url, read_secret(self.key_variable), None, cfg.timeout, auth_scheme="Key")
        elif self.base_url is None:  # the run's endpoint, key and limiter
            self.endpoint = Endpoint(self.model.base_url, self.model.api_key, client.limiter, cfg.timeout)
        else:
            self.endpoint = Endpoint(self.base_url, read_secret(self.key_variable), None, cfg.timeout)
        self.downloads = client_session(AddressPolicy(allow_private=True))  # URLs the provider itself handed us

    async def shutdown(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.aclose()
        if self.downloads is not None:
            await self.downloads.close()

    def request(self, prompt: str, aspect_ratio: str) -> tuple[str, dict]:
        """(path, body) of the provider's request."""
        if self.config.provider == "fal":
            return f"/{self.model_name}", {"prompt": prompt, "image_size": _FAL_SIZES[aspect_ratio], "num_images": 1}
        sizes = _GPT_IMAGE_SIZES if self.model_name.startswith("gpt-image") else _DALLE_SIZES
        return "/images/generations", {"model": self.model_name, "prompt": prompt, "n": 1, "size": sizes[aspect_ratio]}


def first_image(answer: dict) -> tuple[Optional[str], Optional[bytes]]:
    """(url, bytes) of the first image of an OpenAI (``data``) or FAL (``images``) answer."""
    items = answer.get("data") or answer.get("images") or []
    item = items[0] if isinstance(items, list) and items and isinstance(items[0], dict) else {}
    if isinstance(item.get("b64_json"), str):
        try:
            return None, base64.b64decode(item["b64_json"], validate=True)
        except (binascii.Error, ValueError):
            return None, None
    url = item.get("url")
    if isinstance(url, str) and url.startswith("data:"):
        try:
            return None, base64.b64decode(url.partition(",")[2], validate=True)
        except (binascii.Error, ValueError):
            return None, None
    return (url if isinstance(url, str) and url else None), None


class ImageGenerateTool(Tool):
    name = "image_generate"
    description = (
        "Generate a high-quality image from a text prompt. Returns the image in the `image` field: a URL, or "
        "the path of the file saved in your sandbox. Show it to the user with markdown: ![description](image)."
    )
    parameters = {
        "type": "object",
        "properties": {
            "prompt": {"type": "string", "description": "The text prompt describing the desired image. Be detailed and descriptive."},
            "aspect_ratio": {
                "type": "string",
                "enum": list(ASPECT_RATIOS),
                "description": "The aspect ratio of the image: 'landscape' is wide, 'portrait' is tall, 'square' is 1:1.",
                "default": "landscape",
            },
        },
        "required": ["prompt"],
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        runtime: ImageGenRuntime = ctx.session("image_gen").runtime
        cfg = runtime.config
        prompt = arguments["prompt"].strip()
        if not prompt:
            return {"success": False, "image": None, "error": "The prompt is empty."}
        path, body = runtime.request(prompt, arguments.get("aspect_ratio", "landscape"))
        try:
            answer, usage = await runtime.endpoint.post(path, body)
        except Exception as exc:  # a refusal or an endpoint that stayed down fails this call, not the prompt
            return {"success": False, "image": None, "error": f"The image could not be generated: {call_error_text(exc)}"}
        ctx.report_usage(usage)
        url, data = first_image(answer)
        if url is None and data is None:
            return {"success": False, "image": None, "error": "The images endpoint answered without an image."}
        if data is None and not cfg.download:
            return {"success": True, "image": url}
        if data is None:
            try:
                data, _mime = await load_image(
                    url, ctx, runtime.downloads, max_bytes=cfg.max_image_bytes, timeout=cfg.timeout, policy=AddressPolicy(allow_private=True)
                )
            except ImageError as exc:
                return {"success": False, "image": url, "error": f"The image could not be downloaded: {exc}"}
        mime = sniff(data)
        if mime is None:
            return {"success": False, "image": url, "error": "The images endpoint answered with bytes that are not an image."}
        saved = posixpath.join(cfg.folder, image_filename(prompt, data, mime))
        await ctx.sandbox.write_file(saved, data)
        result = {"success": True, "image": saved}
        if url:
            result["url"] = url
        return result


IMAGE_GEN_TOOLS = (ImageGenerateTool,)
