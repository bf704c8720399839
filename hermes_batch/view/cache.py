"""The view index's cache on disk: segments of rows, each never changed once written, listed by a manifest.

A segment (``snap-PID-NS/``) holds some rows' columns (one ``NAME.bin`` of
each) and their search text (``search.txt``); ``manifest.json`` lists the
segments in row order with everything else of the index (which bytes of each
record file it covers, the interned values and the tallies).  A
save writes only the rows added since the index was loaded or last saved, so
a run's end that added a thousand records to a million writes a thousand.
"""

from __future__ import annotations

import array
import json
import logging
import os
import shutil
import time

from .aggregates import Tallies, Vocabulary

log = logging.getLogger(__name__)

INDEX_VERSION = 5  # 2: the cache in segments, with the tallies; 3: content keys by records.key_digest; 4: rewards;
# 5: a reward not in [0, 1] reads as not verified
_MAX_SEGMENTS = 64  # a save past this many writes the cache again as one segment

# column name -> array typecode
COLUMNS = {
    "file": "H",  # index into RunIndex.files
    "offset": "Q",
    "length": "I",
    "prompt": "q",  # prompt_index
    "status": "B",  # KEPT, DISCARDED or FAILED
    "turns": "I",  # model calls
    "duration": "f",  # seconds
    "tokens": "I",  # prompt + completion
    "tools": "I",  # interned tuple of the tools called
    "toolsets": "I",  # interned tuple of toolsets_used
    "end": "H",  # interned end reason (finished records)
    "filters": "H",  # interned tuple of filters (discarded records)
    "error": "H",  # interned error kind (failed records)
    "reward": "f",  # metadata.reward (0.0 without a verifier)
    "verdict": "B",  # fields.VERDICTS: no verifier ran, a verifier failed, below the pass mark, passed
    "key": "Q",  # 64 bits of the content key: tells which failures were finished later
    "text": "Q",  # offset of the record's line in the search file
}


class _Columns:
    """The per-record arrays; swapped as a whole on a rebuild so readers never see half of one."""

    def __init__(self):
        for name, code in COLUMNS.items():
            setattr(self, name, array.array(code))

    def __len__(self) -> int:
        return len(self.key)  # the column appended last: only whole rows count


def save(index) -> None:  # under the index's lock
    """Write the rows added since the last load or save as a new segment, then point the manifest at the list.

    The manifest is replaced atomically: readers see the old list or the
    new one, and segments are never changed, only removed once no manifest
    lists them.  A list grown too long, or one whose segments another
    process removed, is written again as one segment.
    """
    count, size = len(index.columns), index.text.size
    segments = list(index._segments)
    if len(segments) >= _MAX_SEGMENTS or not all((index.cache_dir / seg["dir"]).is_dir() for seg in segments):
        segments = []
    first_row = sum(seg["rows"] for seg in segments)
    first_byte = sum(seg["bytes"] for seg in segments)
    if count > first_row or not segments:
        segments.append(_write_segment(index, first_row, count, first_byte, size))
    manifest = {
        "version": INDEX_VERSION, "segments": segments, "count": count, "blob_size": size,
        "files": index.files, "sources": index.sources,
        "tallies": index.tallies.to_dict(), "vocab": {name: v.values for name, v in index.vocab.items()},
    }
    tmp = index.cache_dir / f"manifest.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest), encoding="utf-8")
    os.replace(tmp, index.cache_dir / "manifest.json")
    index._segments = segments
    kept = {seg["dir"] for seg in segments}
    for old in index.cache_dir.glob("snap-*"):
        if old.name not in kept:
            shutil.rmtree(old, ignore_errors=True)


def _write_segment(index, first_row: int, count: int, first_byte: int, size: int) -> dict:
    """A segment folder holding rows ``first_row:count`` and search bytes ``first_byte:size``."""
    folder = index.cache_dir / f"snap-{os.getpid()}-{time.time_ns()}"
    folder.mkdir()
    for name in COLUMNS:
        with open(folder / f"{name}.bin", "wb") as fh:
            getattr(index.columns, name)[first_row:count].tofile(fh)
    with open(folder / "search.txt", "wb") as dst:
        text = index.text
        for fh, base, length in [*text.parts, (None, text.base, size - text.base)]:
            if base + length <= first_byte:
                continue
            skip = max(0, first_byte - base)
            src = fh if fh is not None else open(text.path, "rb")
            try:
                src.seek(skip)
                _copy(src, dst, length - skip)
            finally:
                if fh is None:
                    src.close()
    return {"dir": folder.name, "rows": count - first_row, "bytes": size - first_byte}


def load(index) -> None:
    """Load the cache into ``index`` (just reset); one that is missing, of another version or damaged is ignored."""
    parts: list = []
    try:
        manifest = json.loads((index.cache_dir / "manifest.json").read_text(encoding="utf-8"))
        if manifest.get("version") != INDEX_VERSION:
            raise ValueError(f"index version {manifest.get('version')}")
        columns = _Columns()
        base = 0
        for seg in manifest["segments"]:
            folder = index.cache_dir / seg["dir"]
            for name in COLUMNS:
                with open(folder / f"{name}.bin", "rb") as fh:
                    getattr(columns, name).fromfile(fh, seg["rows"])
            parts.append((open(folder / "search.txt", "rb"), base, seg["bytes"]))
            if os.fstat(parts[-1][0].fileno()).st_size != seg["bytes"]:
                raise ValueError("search file of another size")
            base += seg["bytes"]
        if len(columns) != manifest["count"] or base != manifest["blob_size"]:
            raise ValueError("segments that do not add up")
        files, sources = manifest["files"], manifest["sources"]
        tallies = Tallies(dict(manifest["tallies"]))
        vocab = {name: Vocabulary(tuple(v) if isinstance(v, list) else v for v in values)
                 for name, values in manifest["vocab"].items()}
    except (OSError, ValueError, KeyError, TypeError, EOFError) as exc:
        for fh, _base, _size in parts:
            fh.close()
        log.info("%s: no usable view index cache (%s); building it.", index.cache_dir, exc)
        index._reset()
        return
    index.files, index.sources, index.tallies, index.vocab = files, sources, tallies, vocab
    index.columns = columns
    index.text.use_parts(parts)  # their size is the manifest's blob_size, checked above
    index._segments = manifest["segments"]
    index.generation += 1


def _copy(src, dst, length: int) -> None:
    while length > 0:
        chunk = src.read(min(length, 1 << 20))
        if not chunk:
            raise OSError(f"{getattr(src, 'name', 'a search file')} ended before its recorded size")
        dst.write(chunk)
        length -= len(chunk)
