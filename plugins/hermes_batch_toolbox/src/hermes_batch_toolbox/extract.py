"""Readable text from a fetched page: trafilatura for HTML, text types as they are."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .net import Fetched

HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
TEXT_TYPES = frozenset({
    "text/plain", "text/markdown", "text/csv", "text/xml", "application/xml", "application/json",
    "application/ld+json", "text/x-markdown",
})
_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)


def readable(page: "Fetched") -> tuple[str, str]:
    """(title, text) of ``page``; raises ValueError for content that is not text.  CPU-bound: call in a thread."""
    kind = page.content_type.lower()
    if kind in HTML_TYPES or (not kind and page.body.lstrip()[:15].lower().startswith((b"<!doctype html", b"<html"))):
        return _html(page)
    if kind in TEXT_TYPES or kind.startswith("text/"):
        return "", page.text()
    raise ValueError(f"its content type is {kind or 'unknown'}, which is not text")


def _html(page: "Fetched") -> tuple[str, str]:
    import trafilatura  # imported on first use: it loads lxml and its language data

    html = page.text()
    text = trafilatura.extract(
        html, url=page.url, output_format="markdown", include_links=True, include_tables=True,
        include_comments=False, favor_recall=True,
    )
    if not text:  # no main content found (a form, a list of links): all visible text then
        text = trafilatura.html2txt(html) or ""
    metadata = trafilatura.extract_metadata(html, default_url=page.url)
    title = metadata.title if metadata is not None and metadata.title else _raw_title(page.body)
    return title or "", text


def _raw_title(body: bytes) -> Optional[str]:
    match = _TITLE.search(body[:200_000])
    return match.group(1).decode("utf-8", "replace").strip() if match else None


def cut(text: str, limit: int) -> tuple[str, bool]:
    """``text`` shortened to ``limit`` characters at a line or word break, and whether it was cut."""
    if len(text) <= limit:
        return text, False
    head = text[:limit]
    for sep in ("\n", " "):
        at = head.rfind(sep)
        if at > limit * 0.8:
            head = head[:at]
            break
    return head, True
