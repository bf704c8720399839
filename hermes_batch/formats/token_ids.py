"""Token ids and logprobs of assistant turns (--logprobs): read from an endpoint's answer, kept beside the record.

Everything here comes from a model server or from a side file anyone may have edited, so it is bounded and
type-checked where it enters: token ids are ints in ``[0, MAX_TOKEN_ID]``, logprobs finite floats no greater
than 0, a turn at most ``MAX_TURN_TOKENS`` tokens with at most ``MAX_TOP_LOGPROBS`` alternatives each.  A turn
whose data breaks a bound keeps no tokens at all (None), never a part that would not match its text.
"""

from __future__ import annotations

import array
import math
import re
from typing import Any, Optional

import attrs

MAX_TOKEN_ID = 2**31 - 1  # vocabularies are far smaller; ids past int32 are no token of any tokenizer
MAX_TURN_TOKENS = 262_144  # one answer; a server claiming more is not believed
MAX_TOP_LOGPROBS = 20  # what OpenAI's API allows per token; --top_logprobs stays within it
MAX_SEQUENCE_TOKENS = 4 * MAX_TURN_TOKENS  # a whole conversation as the endpoint's tokenizer encodes it
MAX_PIECE_CHARS = 256  # a token's text, where the endpoint gives no id
_TOKEN_ID_TEXT = re.compile(r"token_id:(-?\d{1,40})")  # vLLM's return_tokens_as_token_ids


# What a sample's check found (Metadata.token_check, session/token_check.py)
MATCH, DRIFT, UNCHECKED, REDACTED = "match", "drift", "unchecked", "redacted"


@attrs.frozen
class TurnTokens:
    """One assistant turn's sampled tokens: their ids (None when the endpoint gave only their text), their
    logprobs, and for each the ``top`` alternatives as ``(id or text, logprob)`` pairs (() when not asked)."""

    ids: Optional[tuple[int, ...]]
    logprobs: tuple[float, ...]
    top: tuple = ()  # per token, a tuple of (id or text, logprob)
    pieces: Optional[tuple[str, ...]] = None  # the tokens' text, only when the endpoint gave no ids


@attrs.frozen
class TokenSide:
    """What the side file keeps of one sample: the check, the tokenizer's encoding, and per assistant turn
    its index in ``conversations``, where it starts in ``sequence`` (-1: not found or not checked) and its tokens."""

    check: str
    sequence: Optional[tuple[int, ...]]
    turns: tuple  # of (turn index, start, TurnTokens or None)

    def redacted(self) -> "TokenSide":
        """Without any token: the record had a secret redacted, which its ids would still spell."""
        return TokenSide(REDACTED, None, tuple((turn, -1, None) for turn, _start, _tokens in self.turns))


def _logprob(value: Any) -> Optional[float]:
    if type(value) not in (int, float) or not math.isfinite(value) or value > 0 or value < -1e6:
        return None
    return float(value)


def _token_id(value: Any) -> Optional[int]:
    if type(value) is int and 0 <= value <= MAX_TOKEN_ID:
        return value
    return None


_BAD = -1  # an id the entry gives that no tokenizer has: the whole turn is refused


def _entry_id(entry: dict) -> Optional[int]:
    """A logprobs entry's token id: llama.cpp's ``id``, or vLLM's ``token_id:N`` token text; None when it gives
    none, ``_BAD`` when what it gives is no token id."""
    for name in ("id", "token_id"):
        if name in entry and entry[name] is not None:
            found = _token_id(entry[name])
            return _BAD if found is None else found
    if isinstance(entry.get("token"), str):
        match = _TOKEN_ID_TEXT.fullmatch(entry["token"])
        if match:
            found = _token_id(int(match.group(1)))
            return _BAD if found is None else found
    return None


def _piece(entry: dict) -> Optional[str]:
    token = entry.get("token")
    return token if isinstance(token, str) and len(token) <= MAX_PIECE_CHARS else None


def from_openai_logprobs(logprobs: Any, top_wanted: int = 0) -> Optional[TurnTokens]:
    """The tokens of a chat completion choice's ``logprobs`` (``{"content": [entry, ...]}``), or None when it
    holds none or breaks a bound.  Each entry: ``token``, ``logprob``, maybe ``id`` (llama.cpp) and
    ``top_logprobs``.  Ids come from ``id`` or from tokens written ``token_id:N``; when not every entry has
    one, the turn keeps the tokens' text instead."""
    if not isinstance(logprobs, dict):
        return None
    content = logprobs.get("content")
    if not isinstance(content, list) or not content or len(content) > MAX_TURN_TOKENS:
        return None
    ids: list = []
    values: list = []
    pieces: list = []
    top: list = []
    for entry in content:
        if not isinstance(entry, dict):
            return None
        value = _logprob(entry.get("logprob"))
        if value is None:
            return None
        values.append(value)
        token_id = _entry_id(entry)
        if token_id == _BAD:
            return None
        ids.append(token_id)
        pieces.append(_piece(entry))
        if top_wanted:
            alternatives = entry.get("top_logprobs")
            if not isinstance(alternatives, list):
                alternatives = []
            kept = []
            for alternative in alternatives[:top_wanted]:
                if not isinstance(alternative, dict):
                    return None
                alt_value = _logprob(alternative.get("logprob"))
                alt_token = _entry_id(alternative)
                if alt_token == _BAD:
                    return None
                if alt_token is None:
                    alt_token = _piece(alternative)
                if alt_value is None or alt_token is None:
                    return None
                kept.append((alt_token, alt_value))
            top.append(tuple(kept))
    if all(i is not None for i in ids):
        return TurnTokens(tuple(ids), tuple(values), tuple(top))
    if any(p is None for p in pieces):
        return None
    return TurnTokens(None, tuple(values), tuple(top), tuple(pieces))


def to_json(tokens: TurnTokens) -> dict:
    """The turn as JSON types (the replay journal and the side file keep it so)."""
    data: dict = {"ids": list(tokens.ids) if tokens.ids is not None else None, "logprobs": list(tokens.logprobs)}
    if tokens.top:
        data["top"] = [[list(pair) for pair in alternatives] for alternatives in tokens.top]
    if tokens.pieces is not None:
        data["pieces"] = list(tokens.pieces)
    return data


def from_json(data: Any) -> Optional[TurnTokens]:
    """A turn :func:`to_json` wrote, read back from a file anyone may have edited; None when it is not one."""
    if not isinstance(data, dict):
        return None
    values = data.get("logprobs")
    if not isinstance(values, list) or len(values) > MAX_TURN_TOKENS:
        return None
    logprobs = tuple(_logprob(v) for v in values)
    if None in logprobs:
        return None
    ids = data.get("ids")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) != len(logprobs):
            return None
        ids = tuple(_token_id(i) for i in ids)
        if None in ids:
            return None
    pieces = data.get("pieces")
    if pieces is not None:
        if not isinstance(pieces, list) or len(pieces) != len(logprobs) or not all(
                isinstance(p, str) and len(p) <= MAX_PIECE_CHARS for p in pieces):
            return None
        pieces = tuple(pieces)
    if ids is None and pieces is None:
        return None
    top: list = []
    raw_top = data.get("top", [])
    if not isinstance(raw_top, list) or (raw_top and len(raw_top) != len(logprobs)):
        return None
    for alternatives in raw_top:
        if not isinstance(alternatives, list) or len(alternatives) > MAX_TOP_LOGPROBS:
            return None
        kept = []
        for pair in alternatives:
            if not isinstance(pair, list) or len(pair) != 2:
                return None
            token, value = pair
            token = _token_id(token) if type(token) is int else token if isinstance(token, str) and len(token) <= MAX_PIECE_CHARS else None
            value = _logprob(value)
            if token is None or value is None:
                return None
            kept.append((token, value))
        top.append(tuple(kept))
    return TurnTokens(ids, logprobs, tuple(top), pieces)


def token_ids(value: Any, limit: int = MAX_SEQUENCE_TOKENS) -> Optional[tuple[int, ...]]:
    """A list of token ids from an endpoint (a tokenizer's answer) or a file, or None when it is not one."""
    if not isinstance(value, list) or len(value) > limit:
        return None
    ids = []
    for item in value:
        if isinstance(item, dict):  # llama.cpp's /tokenize with_pieces: {"id": N, "piece": ...}
            item = item.get("id")
        found = _token_id(item)
        if found is None:
            return None
        ids.append(found)
    return tuple(ids)


def find_turns(sequence: tuple[int, ...], turns: list) -> list:
    """Where each turn's ids begin in ``sequence``, in order, each after the one before (-1: not found there,
    the drift of a re-tokenization; the turns after it are looked for after the last one found).

    Searched as bytes (``bytes.find`` is linear), so no sequence an endpoint sends makes it quadratic."""
    haystack = array.array("I", sequence).tobytes()
    starts = []
    position = 0
    for ids in turns:
        at = _find(haystack, array.array("I", ids).tobytes(), position) if ids else -1
        starts.append(at)
        if at >= 0:
            position = at + len(ids)
    return starts


def _find(haystack: bytes, needle: bytes, start: int) -> int:
    offset = haystack.find(needle, start * 4)
    while offset >= 0 and offset % 4:  # a match across token boundaries is none
        offset = haystack.find(needle, offset + 1)
    return offset // 4 if offset >= 0 else -1


# --- the side file: batch_N.tokens.jsonl ------------------------------------------------------------------------


def record_digest(conversations) -> str:
    """What ties a side entry to its record: a hash of the saved conversation (turns' ``from`` and ``value``), so
    the entry follows its record wherever a refilter, a renumbering or a merge puts it."""
    import hashlib
    import json

    blob = json.dumps([[turn.from_, turn.value] for turn in conversations], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def side_entry(key: str, digest: str, prompt_index: int, sample_index: int, side: TokenSide) -> dict:
    """The side file's line for one sample, as JSON types."""
    turns = []
    for turn, start, tokens in side.turns:
        entry = {"turn": turn, "start": start}
        entry.update(to_json(tokens) if tokens is not None else {"ids": None, "logprobs": []})
        turns.append(entry)
    return {"key": key, "digest": digest, "prompt_index": prompt_index, "sample_index": sample_index,
            "check": side.check, "sequence": list(side.sequence) if side.sequence is not None else None,
            "turns": turns}


def read_side_entry(data: Any) -> Optional[tuple[tuple[str, str], TokenSide]]:
    """``((key, digest), TokenSide)`` of a side file's decoded line, or None when it is not one."""
    if not isinstance(data, dict):
        return None
    key, digest, check = data.get("key"), data.get("digest"), data.get("check")
    if not all(isinstance(v, str) and len(v) <= 64 for v in (key, digest, check)):
        return None
    if check not in (MATCH, DRIFT, UNCHECKED, REDACTED):
        return None
    sequence = data.get("sequence")
    if sequence is not None:
        sequence = token_ids(sequence)
        if sequence is None:
            return None
    raw_turns = data.get("turns")
    if not isinstance(raw_turns, list) or len(raw_turns) > 100_000:
        return None
    turns = []
    for entry in raw_turns:
        if not isinstance(entry, dict):
            return None
        turn, start = entry.get("turn"), entry.get("start")
        if type(turn) is not int or type(start) is not int or turn < 0 or start < -1:
            return None
        tokens = None if entry.get("ids") is None and entry.get("pieces") is None else from_json(entry)
        if tokens is None and (entry.get("ids") is not None or entry.get("pieces") is not None):
            return None
        if tokens is not None and start >= 0 and (sequence is None or start + len(tokens.logprobs) > len(sequence)):
            return None
        turns.append((turn, start, tokens))
    return (key, digest), TokenSide(check, sequence, tuple(turns))
