"""Reasoning in every form providers return it, reduced to one string."""

from __future__ import annotations

import re
from typing import Any, Optional

_INLINE = re.compile(
    r"<(think|thinking|REASONING_SCRATCHPAD)>(.*?)(?:</\1>|\Z)",
    re.DOTALL,
)


def split_inline_reasoning(content: str) -> tuple[Optional[str], str]:
    """Take ``<think>``/``<REASONING_SCRATCHPAD>`` blocks out of ``content``: (reasoning, rest)."""
    if "<" not in content:
        return None, content
    parts = [m.group(2).strip() for m in _INLINE.finditer(content)]
    if not parts:
        return None, content
    rest = _INLINE.sub("", content).strip()
    return "\n\n".join(p for p in parts if p) or None, rest


def _from_details(details: Any) -> Optional[str]:
    """OpenRouter's ``reasoning_details``: a list of text, summary and encrypted entries."""
    if not isinstance(details, list):
        return None
    texts = []
    for item in details:
        if not isinstance(item, dict):
            continue
        text = item.get("text") or item.get("summary")
        if isinstance(text, str) and text.strip():
            texts.append(text.strip())
    return "\n\n".join(texts) or None


def extract_reasoning(fields: dict, content: Optional[str]) -> tuple[Optional[str], str]:
    """Reasoning from a message's provider fields and its content: (reasoning, content without inline blocks).

    ``fields`` are the message's extra fields (``reasoning``, ``reasoning_content``,
    ``reasoning_details``).  Inline blocks are always removed from the content
    so they are not duplicated when the trajectory adds its own ``<think>``.
    """
    found = []
    for key in ("reasoning", "reasoning_content"):
        value = fields.get(key)
        if isinstance(value, str) and value.strip():
            found.append(value.strip())
            break
    if not found:
        details = _from_details(fields.get("reasoning_details"))
        if details:
            found.append(details)
    inline, rest = split_inline_reasoning(content or "")
    if inline and inline not in found:
        found.append(inline)
    return ("\n\n".join(found) or None), rest
