"""The viewer's list: search, filter and sort over the index's columns, one page of rows at a time."""

from __future__ import annotations

import array
from typing import Optional

import attrs

from ..formats import hermes_format
from .index import DISCARDED, FAILED, STATUSES, VERDICTS, RunIndex, answer_of, prompt_of, unwrap

SORTS = ("arrival", "prompt", "turns", "duration", "tokens", "reward")
PAGE_MAX = 200
PREVIEW_CHARS = 160


@attrs.frozen
class Query:
    """One request of the list: every field optional; ``sort`` is one of SORTS."""

    q: str = ""
    status: str = ""
    tool: str = ""
    toolset: str = ""
    end: str = ""
    filter: str = ""
    error: str = ""
    verdict: str = ""  # one of VERDICTS: passed, failed (below the pass mark), unverified (a verifier failed), unscored
    min_reward: Optional[float] = None  # only samples whose verifiers all gave a reward, at least this one
    sort: str = "arrival"
    desc: bool = False
    offset: int = 0
    limit: int = 50

    @classmethod
    def from_params(cls, params) -> "Query":
        def number(name, default):
            try:
                return max(0, int(params.get(name, default)))
            except (TypeError, ValueError):
                return default

        sort = params.get("sort", "arrival")
        try:
            min_reward: Optional[float] = float(params.get("min_reward", ""))
        except (TypeError, ValueError):
            min_reward = None
        if min_reward is not None and min_reward != min_reward:  # NaN
            min_reward = None
        return cls(
            q=params.get("q", "").strip(), status=params.get("status", ""), tool=params.get("tool", ""),
            toolset=params.get("toolset", ""), end=params.get("end", ""), filter=params.get("filter", ""),
            error=params.get("error", ""), verdict=params.get("verdict", ""), min_reward=min_reward,
            sort=sort if sort in SORTS else "arrival",
            desc=params.get("desc", "") in ("1", "true"), offset=number("offset", 0),
            limit=min(PAGE_MAX, number("limit", 50) or 50),
        )


class _Sorts:
    """Record numbers sorted by each key, kept until the index grows."""

    def __init__(self):
        self._cache: dict = {}

    def order(self, index: RunIndex, n: int, key: str) -> list:
        cached = self._cache.get(key)
        if cached is not None and cached[0] == (index.generation, n):
            return cached[1]
        column = getattr(index.columns, key)
        # stable: ties stay in arrival order; kept as 4 bytes a record, not a list of Python ints
        order = array.array("I", sorted(range(n), key=column.__getitem__))
        self._cache[key] = ((index.generation, n), order)
        return order


_COLUMN_OF_SORT = {"prompt": "prompt", "turns": "turns", "duration": "duration", "tokens": "tokens", "reward": "reward"}


def _predicate(index: RunIndex, query: Query):
    """A test of one record number, or None when nothing filters."""
    cols, vocab = index.columns, index.vocab
    tests = []
    if query.status in STATUSES:
        wanted, status = STATUSES.index(query.status), cols.status
        tests.append(lambda i: status[i] == wanted)
    if query.verdict in VERDICTS:
        wanted_verdict, verdict = VERDICTS.index(query.verdict), cols.verdict
        tests.append(lambda i: verdict[i] == wanted_verdict)
    if query.min_reward is not None:
        # the column is a 32-bit float: compare with the bar as the column would hold it
        bar, reward, verdict = array.array("f", [query.min_reward])[0], cols.reward, cols.verdict
        tests.append(lambda i: verdict[i] >= 2 and reward[i] >= bar)
    for value, column, vocab_name, contains in (
        (query.tool, cols.tools, "tools", True),
        (query.toolset, cols.toolsets, "toolsets", True),
        (query.end, cols.end, "end", False),
        (query.filter, cols.filters, "filters", True),
        (query.error, cols.error, "error", False),
    ):
        if not value:
            continue
        ids = vocab[vocab_name].ids_where((lambda v, x=value: x in v) if contains else (lambda v, x=value: v == x))
        tests.append(lambda i, c=column, ids=ids: c[i] in ids)
    if not tests:
        return None
    if len(tests) == 1:
        return tests[0]
    return lambda i: all(t(i) for t in tests)


def run_query(index: RunIndex, query: Query, sorts: Optional[_Sorts] = None) -> dict:
    """``{"total", "rows", "offset"}`` for ``query``: one page of rows, each with what the list shows."""
    n = len(index)
    test = _predicate(index, query)
    if query.sort == "arrival":
        order = range(n - 1, -1, -1) if query.desc else range(n)
    else:
        order = (sorts or _Sorts()).order(index, n, _COLUMN_OF_SORT[query.sort])
        if query.desc:
            order = order[::-1]
    if query.q:
        found = list(index.search(query.q, within=n))  # in arrival order
        if query.sort == "arrival" and test is None:
            matched = found[::-1] if query.desc else found
            page = matched[query.offset: query.offset + query.limit]
            return {"total": len(matched), "offset": query.offset, "rows": [row(index, i) for i in page]}
        hits = bytearray(n)
        for i in found:
            hits[i] = 1
        test = hits.__getitem__ if test is None else (lambda i, t=test: hits[i] and t(i))
    if test is None:
        total = n
        page = list(order[query.offset: query.offset + query.limit])
    else:
        matched = [i for i in order if test(i)]
        total = len(matched)
        page = matched[query.offset: query.offset + query.limit]
    return {"total": total, "offset": query.offset, "rows": [row(index, i) for i in page]}


def row(index: RunIndex, i: int) -> dict:
    """What the list shows of record ``i``; the prompt preview comes from one read of its line."""
    cols, vocab = index.columns, index.vocab
    status = cols.status[i]
    try:
        data = unwrap(status, index.read(i))
    except (OSError, ValueError):
        data = {}
    if status == FAILED:
        preview, detail = str(data.get("prompt", "")), vocab["error"].values[cols.error[i]]
    else:
        preview, detail = prompt_of(data), vocab["end"].values[cols.end[i]]
        if status == DISCARDED:
            detail = ", ".join(vocab["filters"].values[cols.filters[i]]) or detail
    answer = "" if status == FAILED else answer_of(data)
    return {
        "ref": f"{index.files[cols.file[i]]}:{cols.offset[i]}",
        "prompt_index": cols.prompt[i],
        "status": STATUSES[status],
        "turns": cols.turns[i],
        "duration": round(cols.duration[i], 2),
        "tokens": cols.tokens[i],
        "reward": round(cols.reward[i], 4),
        "verdict": VERDICTS[cols.verdict[i]],
        "detail": detail,
        "tools": list(vocab["tools"].values[cols.tools[i]]),
        "preview": preview[:PREVIEW_CHARS],
        "answer": hermes_format.split_reasoning(answer)[1].strip()[:PREVIEW_CHARS],
    }
