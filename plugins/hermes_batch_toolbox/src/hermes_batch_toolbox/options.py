"""What the toolsets' option classes share."""

from __future__ import annotations


def positive(_instance, attribute, value) -> None:
    """attrs validator: the option must be more than 0."""
    if value <= 0:
        raise ValueError(f"{attribute.name} must be more than 0, got {value!r}")
