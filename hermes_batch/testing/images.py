"""Images for tests: small real PNG files made without any imaging library."""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
import zlib
from typing import Optional


def solid_png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A valid PNG of ``width`` x ``height`` pixels, all of colour ``rgb``."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    row = b"\x00" + bytes(rgb) * width  # filter type 0, then the pixels
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(row * height)) + chunk(b"IEND", b"")


def png_for(text: str, width: int = 16, height: int = 16) -> bytes:
    """A PNG whose colour is derived from ``text``, so different prompts give different images."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return solid_png(width, height, (digest[0], digest[1], digest[2]))


def png_size(data: bytes) -> Optional[tuple[int, int]]:
    """(width, height) of a PNG, None for anything else."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", data[16:24])


def data_url_bytes(url: str) -> Optional[bytes]:
    """The bytes of a base64 ``data:`` URL, None for anything else."""
    header, comma, payload = url.partition(",")
    if not url.startswith("data:") or not comma or ";base64" not in header:
        return None
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None
