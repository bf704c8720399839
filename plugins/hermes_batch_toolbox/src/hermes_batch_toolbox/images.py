"""Images a tool receives: loaded from a URL, a data: URL or a file in the sandbox, checked to be an image."""

from __future__ import annotations

import base64
import binascii
import hashlib
import inspect
from typing import Optional

from hermes_batch import ToolContext


_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


class ImageError(Exception):
    """The image could not be had; the message is one sentence for the model."""


def sniff(data: bytes) -> Optional[str]:
    """The MIME type of an image format vision models take, from its first bytes; None otherwise."""
    for signature, mime in _SIGNATURES:
        if data.startswith(signature):
            return mime
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


async def load_image(source: str, ctx: ToolContext, session, *, max_bytes: int, timeout: float, policy):
    """(bytes, MIME type) of the image at ``source``: an http(s) URL, a data: URL, or a path in the sandbox."""
    source = (source or "").strip()
    if not source:
        raise ImageError("The image_url is empty.")
    if source.startswith("data:"):
        data = _decode_data_url(source, max_bytes)
    elif source.startswith(("http://", "https://")):
        from .net import FetchError, fetch

        try:
            page = await fetch(
                session, source, max_bytes=max_bytes + 1, timeout=timeout, policy=policy,
                accept="image/*,*/*;q=0.5",
            )
        except FetchError as exc:
            raise ImageError(str(exc)) from None
        if page.status >= 400:
            raise ImageError(f"{source} answered HTTP {page.status}.")
        data = page.body
    elif "://" in source:
        raise ImageError("image_url must be an http(s) URL, a data: URL or a file path in your sandbox.")
    else:
        data = await _read_sandbox_file(ctx, source, max_bytes)
    if len(data) > max_bytes:
        raise ImageError(f"The image is larger than {max_bytes} bytes.")
    mime = sniff(data)
    if mime is None:
        raise ImageError("That is not a PNG, JPEG, GIF, WebP or BMP image.")
    return data, mime


def _decode_data_url(source: str, max_bytes: int) -> bytes:
    header, comma, payload = source.partition(",")
    if not comma or ";base64" not in header:
        raise ImageError("A data: URL must be base64-encoded (data:image/png;base64,...).")
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise ImageError(f"The image is larger than {max_bytes} bytes.")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("The data: URL is not valid base64.") from None


async def _read_sandbox_file(ctx: ToolContext, path: str, max_bytes: int) -> bytes:
    read = ctx.sandbox.read_file
    try:
        if "max_bytes" in inspect.signature(read).parameters:
            data = await read(path, max_bytes=max_bytes + 1)  # one byte more tells "too large" from "just fits"
        else:  # a sandbox written before read_file took max_bytes
            data = await read(path)
    except FileNotFoundError:
        raise ImageError(f"There is no file {path} in your sandbox.") from None
    except IsADirectoryError:
        raise ImageError(f"{path} is a folder, not an image file.") from None
    except (OSError, ValueError) as exc:
        raise ImageError(f"{path} cannot be read: {exc}") from None
    return data


def image_filename(prompt: str, data: bytes, mime: str) -> str:
    """A file name for a generated image: a slug of the prompt, a digest of the bytes, the type's extension."""
    slug = "-".join("".join(c if c.isalnum() else " " for c in prompt.lower()).split())[:40].strip("-") or "image"
    ext = {"image/png": "png", "image/jpeg": "jpg", "image/gif": "gif", "image/webp": "webp"}.get(mime, "bmp")
    return f"{slug}-{hashlib.sha256(data).hexdigest()[:10]}.{ext}"
