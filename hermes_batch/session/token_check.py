"""--logprobs: a sample's token ids beside its record, and whether they agree with the endpoint's tokenizer.

A trainer that re-tokenizes a conversation's text gets other ids than those sampled wherever the tokenizer
splits the text differently (or the chat template renders a turn otherwise than it was generated). So after a
session the conversation, as the record saves it, goes once through the endpoint's ``/tokenize``
(``ModelClient.tokenize``), and each assistant turn's sampled ids are looked for in that encoding, in order:
``match`` when every turn is found, ``drift`` when one is not, ``unchecked`` when the endpoint has no tokenizer
or a turn has no ids.  The encoding is kept (``sequence``) with where each turn starts in it, which is what
``export --format rollouts`` builds each turn's prompt ids and the loss mask from.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from ..contract.interfaces import ModelClient
from ..formats.records import Message, ToolSpec
from ..formats.token_ids import DRIFT, MATCH, UNCHECKED, TokenSide, TurnTokens, find_turns

log = logging.getLogger(__name__)


async def check_tokens(client: ModelClient, system_prompt: str, prompt: str, messages: tuple,
                       tools: tuple[ToolSpec, ...], conversations: tuple) -> TokenSide:
    """The side entry of a finished session: its turns' tokens, checked against the endpoint's tokenizer."""
    positions = [i for i, turn in enumerate(conversations) if turn.from_ == "gpt"]
    replies = [m for m in messages if m.role == "assistant"]
    tokens: list[Optional[TurnTokens]] = [m.tokens for m in replies]
    ids = [t.ids if t is not None else None for t in tokens]
    if not ids or any(i is None or not i for i in ids):
        return TokenSide(UNCHECKED, None, tuple((p, -1, t) for p, t in zip(positions, tokens)))
    saved = ((Message("system", system_prompt),) if system_prompt else ()) + (Message("user", prompt),) + tuple(messages)
    try:
        sequence = await client.tokenize(saved, tools)
    except Exception:  # a plugin's tokenize that fails leaves the sample unchecked, never failed
        log.debug("the endpoint's tokenizer failed", exc_info=True)
        sequence = None
    if sequence is None:
        return TokenSide(UNCHECKED, None, tuple((p, -1, t) for p, t in zip(positions, tokens)))
    starts = await asyncio.to_thread(find_turns, sequence, ids)  # up to a million tokens: off the event loop
    check = MATCH if all(s >= 0 for s in starts) else DRIFT
    return TokenSide(check, tuple(sequence), tuple(zip(positions, starts, tokens)))
