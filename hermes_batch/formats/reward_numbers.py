"""Rewards as numbers: read strictly from text a verifier is handed, checked where a verifier returns one,
and read back from records that may hold anything.

A reward decides what a team trains on, and its text often comes from somewhere
the graded agent could reach (a reward file, a judge's reply quoting the
transcript).  Python's ``float`` reads far more than a reward: ``1_0`` is 10.0,
``١`` (Arabic-Indic one) is 1.0, ``1e308`` and 256 digits are finite, ``nan``
and ``inf`` are numbers.  So a reward's text is plain ASCII decimal only:
digits with an optional fraction (``1``, ``0.75``, ``.5``, ``1.``), no sign, no
exponent, no underscores, at most ``MAX_REWARD_CHARS`` characters, with ASCII
spaces, tabs and line ends around it; its value lies in [0, 1].  A sign is not
taken at all, as no reward below 0 exists and ``+1`` is no plainer than ``1``.
"""

from __future__ import annotations

import numbers
import re
from decimal import Decimal
from typing import Any, Optional, Union

MAX_REWARD_CHARS = 40
"""Most characters of a reward's text (spaces around it aside): 0.1 has 17 digits in Python's repr."""

_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+", re.ASCII)
_SPACE = " \t\r\n"


class RewardTextError(ValueError):
    """A reward's text is not a plain decimal number in [0, 1]; its message says why, as a clause."""


def _shown(text: str) -> str:
    shown = text if len(text) <= 24 else text[:21] + "..."
    return repr(shown).encode("ascii", "backslashreplace").decode("ascii")


def parse_reward(text: Union[str, bytes]) -> float:
    """The reward ``text`` spells: plain ASCII decimal in [0, 1] (see the module); RewardTextError says why not.

    The error's message is a clause to follow what was read ("the reward file holds " + message).
    """
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("ascii")
        except UnicodeDecodeError:
            raise RewardTextError("bytes that are not ASCII, not a plain decimal number") from None
    if not isinstance(text, str):
        raise RewardTextError(f"a {type(text).__name__}, not text")
    stripped = text.strip(_SPACE)
    if not stripped:
        raise RewardTextError("nothing, not a number")
    if len(stripped) > MAX_REWARD_CHARS:
        raise RewardTextError(f"{len(stripped)} characters, more than a reward's {MAX_REWARD_CHARS}")
    if not _DECIMAL.fullmatch(stripped):
        if stripped[0] in "+-" and _DECIMAL.fullmatch(stripped[1:]):
            raise RewardTextError(f"{_shown(stripped)}: a reward is written without a sign")
        raise RewardTextError(f"{_shown(stripped)}, not a plain decimal number (ASCII digits and a decimal point)")
    if Decimal(stripped) > 1:  # exactly: 1.00000000000000000001 is a float of 1.0
        raise RewardTextError(f"{_shown(stripped)}, more than 1 (a reward lies in [0, 1])")
    return float(stripped)


def checked_reward(value: Any) -> float:
    """``value`` as a float when it is a real number (not a bool) in [0, 1]; ValueError says why not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"a {type(value).__name__}, not a number")
    # compared before any conversion: 10**400 or a Fraction stay exact, NaN fails both comparisons
    if not 0 <= value <= 1:
        shown = f"an integer of {value.bit_length()} bits" if isinstance(value, int) and value.bit_length() > 64 \
            else repr(value)
        raise ValueError(f"{shown[:40]}, not a number in [0, 1]")
    return float(value)


def stored_reward(value: Any) -> Optional[float]:
    """A reward read back from a record: the float when it is a number (int or float) in [0, 1], else None.

    Records are untrusted (an older version, a hand edit, another tool): NaN, ``1e308``, ``-1e308``, a
    huge int or a string is no reward, so the sample reads as not verified and no sum of rewards can
    overflow.
    """
    if type(value) not in (int, float) or not 0 <= value <= 1:
        return None
    return float(value)
