"""The ``file`` toolset: read, write, patch and search files in the prompt's sandbox.

Every tool acts through the :class:`~hermes_batch.contract.interfaces.Sandbox` interface
only (``read_file``, ``write_file``, ``exec``), so it works in every backend.
Problems the model can act on (a missing file, a refused path, a bad regex)
come back as a result with a non-null ``error``; a sandbox that died raises
:class:`~hermes_batch.errors.SandboxError` and fails the prompt.
"""

from __future__ import annotations

import re
import shlex
from typing import Any, Optional

import hermes_batch

from ..contract.interfaces import Tool, ToolContext, Toolset

DEFAULT_READ_LINES = 500
MAX_SEARCH_MATCHES = 100
MAX_MATCH_LINE_CHARS = 300
# read_file asks the sandbox for a larger start of the file only when the lines to show lie further in,
# so its memory follows what it returns; lines past the last window are for the terminal.
READ_WINDOWS = (256 * 1024, 2 * 1024 * 1024, 16 * 1024 * 1024)
MAX_READ_BYTES = READ_WINDOWS[-1]
MAX_PATCH_BYTES = 8 * 1024 * 1024

_MATCH_LINE = re.compile(r"^(.*?):(\d+):(.*)$")
_BINARY_NOTE = re.compile(r"binary file .*matches|binary file matches", re.IGNORECASE)


def _failure(message: str, **fields: Any) -> dict:
    return {**fields, "error": message}


def _os_error(path: str, exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"File not found: {path}"
    if isinstance(exc, IsADirectoryError):
        return f"{path} is a directory, not a file."
    if isinstance(exc, NotADirectoryError):
        return f"A parent of {path} is a file, not a directory."
    if exc.filename is None and exc.strerror:
        return exc.strerror  # the sandbox's own refusal (not a regular file), already a sentence
    if isinstance(exc, PermissionError) and exc.filename is None:
        return str(exc)  # the sandbox's own refusal (outside its folder), already a sentence
    return f"{path}: {exc.strerror or exc}"


def _mib(size: int) -> str:
    return f"{size // (1024 * 1024)} MiB"


def _line_start(data: bytes, line: int) -> int:
    """Byte offset where 1-based ``line`` starts in ``data``, or -1 when ``data`` has fewer lines."""
    if line == 1:
        return 0 if data else -1
    skip = line - 1
    if data.count(b"\n") < skip:
        return -1
    position = 0
    chunk = 1024 * 1024
    while True:  # whole chunks by count (fast, in C), then newline by newline inside the last one
        here = data.count(b"\n", position, position + chunk)
        if here >= skip:
            break
        skip -= here
        position += chunk
    for _ in range(skip):
        position = data.index(b"\n", position) + 1
    return position if position < len(data) else -1


def _enough(data: bytes, offset: int, limit: int, max_chars: int) -> bool:
    """Whether ``data`` (the start of a longer file) holds everything read_file will show."""
    start = _line_start(data, offset)
    if start < 0:
        return False
    # Every character of output stands for at most 4 bytes of the file.
    return data.count(b"\n", start) >= limit or len(data) - start >= 4 * max_chars


def _path_argument(arguments: dict) -> Optional[str]:
    path = arguments.get("path")
    return path if isinstance(path, str) and path else None


def _positive_int(value: Any, default: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return default


class ReadFileTool(Tool):
    """Reads a text file, or a range of its lines, with line numbers."""

    name = "read_file"
    description = (
        "Read a text file in your sandbox. Each returned line is prefixed with its line number and '|' "
        "(for example '    12|text'); the prefix is not part of the file, so leave it out of patch's "
        f"old_string. Returns at most `limit` lines (default {DEFAULT_READ_LINES}) starting at line `offset` "
        "(1-based); `total_lines` tells whether there is more. Relative paths are relative to the working directory."
    )
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File to read."},
            "offset": {"type": "integer", "minimum": 1, "description": "First line to return (1-based), default 1."},
            "limit": {"type": "integer", "minimum": 1, "description": f"Most lines to return, default {DEFAULT_READ_LINES}."},
        },
        "required": ["path"],
        "additionalProperties": False,
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        path = _path_argument(arguments)
        if path is None:
            return _failure("path must be a non-empty string.", content="")
        offset = _positive_int(arguments.get("offset"), 1)
        limit = _positive_int(arguments.get("limit"), DEFAULT_READ_LINES)
        for window in READ_WINDOWS:
            try:
                data = await ctx.sandbox.read_file(path, max_bytes=window)
            except OSError as exc:
                return _failure(_os_error(path, exc), path=path, content="")
            # A file of exactly the window's size counts as longer: cheaper than asking for one byte more.
            whole = len(data) < window
            if whole or _enough(data, offset, limit, ctx.max_output_chars):
                break
        if b"\0" in data[:8192]:
            return _failure(f"{path} is a binary file; inspect it with the terminal instead.", path=path, content="")
        total = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0) if whole else None
        start = _line_start(data, offset)
        if start < 0:
            if whole:
                return _failure(
                    f"offset {offset} is past the end of {path} ({total} lines).", path=path, content="", total_lines=total
                )
            return _failure(
                f"offset {offset} lies past the first {_mib(window)} of {path}, the most read_file reads; "
                "use the terminal (for example sed -n 'FIRST,LASTp') for lines further in.",
                path=path,
                content="",
                total_lines=None,
            )
        out: list[str] = []
        size = 0
        truncated = False
        end = offset - 1
        position = start
        number = offset
        while number < offset + limit and position < len(data):
            newline = data.find(b"\n", position)
            stop = len(data) if newline < 0 else newline
            # decode no more of a huge line than the output can show
            text = data[position:min(stop, position + 4 * ctx.max_output_chars + 4)].decode("utf-8", errors="replace")
            line = f"{number:>6}|{text}"
            if size + len(line) + 1 > ctx.max_output_chars:
                if not out:  # a single huge line: show its start rather than nothing
                    out.append(line[: ctx.max_output_chars])
                    end = number
                truncated = True
                break
            out.append(line)
            size += len(line) + 1
            end = number
            number += 1
            position = stop + 1
        result = {
            "path": path,
            "content": "\n".join(out),
            "start_line": offset,
            "end_line": end,
            "total_lines": total,
            "error": None,
        }
        if truncated:
            result["note"] = f"Output limit reached; continue with offset={end + 1}."
        elif not whole and window == MAX_READ_BYTES and position >= len(data):
            result["note"] = (
                f"{path} is longer than {_mib(window)}, the most read_file reads; use the terminal for lines further in."
            )
        elif not whole:
            result["note"] = f"{path} has more lines (only its start was read, so total_lines is unknown); continue with offset={end + 1}."
        return result


class WriteFileTool(Tool):
    """Writes a text file, creating parent folders; replaces the file if it exists."""

    name = "write_file"
    description = (
        "Write `content` to a file in your sandbox, creating parent folders and replacing the file if it "
        "exists. Relative paths are relative to the working directory. Use patch to change part of a file."
    )
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File to write."},
            "content": {"type": "string", "description": "The complete new content of the file."},
        },
        "required": ["path", "content"],
        "additionalProperties": False,
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        path = _path_argument(arguments)
        content = arguments.get("content")
        if path is None:
            return _failure("path must be a non-empty string.")
        if not isinstance(content, str):
            return _failure("content must be a string.", path=path)
        data = content.encode("utf-8")
        try:
            await ctx.sandbox.write_file(path, data)
        except OSError as exc:
            return _failure(_os_error(path, exc), path=path)
        return {"path": path, "bytes_written": len(data), "error": None}


class PatchTool(Tool):
    """Replaces an exact string in a file (search and replace edit)."""

    name = "patch"
    description = (
        "Edit a file by replacing the exact text `old_string` with `new_string`. `old_string` must "
        "match the file exactly (whitespace included, without read_file's line-number prefixes) and "
        "occur exactly once, unless `replace_all` is true; add surrounding lines to make it unique."
    )
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File to edit."},
            "old_string": {"type": "string", "description": "Exact text to replace."},
            "new_string": {"type": "string", "description": "Text to put in its place."},
            "replace_all": {"type": "boolean", "description": "Replace every occurrence, default false."},
        },
        "required": ["path", "old_string", "new_string"],
        "additionalProperties": False,
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        path = _path_argument(arguments)
        old = arguments.get("old_string")
        new = arguments.get("new_string")
        replace_all = arguments.get("replace_all") is True
        if path is None:
            return _failure("path must be a non-empty string.", replacements=0)
        if not isinstance(old, str) or not old:
            return _failure("old_string must be a non-empty string.", path=path, replacements=0)
        if not isinstance(new, str):
            return _failure("new_string must be a string.", path=path, replacements=0)
        if old == new:
            return _failure("old_string and new_string are identical; nothing to change.", path=path, replacements=0)
        try:
            data = await ctx.sandbox.read_file(path, max_bytes=MAX_PATCH_BYTES + 1)
            if len(data) > MAX_PATCH_BYTES:
                return _failure(
                    f"{path} is larger than {_mib(MAX_PATCH_BYTES)}, the most patch edits; "
                    "change it with the terminal (for example sed) instead.",
                    path=path,
                    replacements=0,
                )
            text = data.decode("utf-8")
        except OSError as exc:
            return _failure(_os_error(path, exc), path=path, replacements=0)
        except UnicodeDecodeError:
            return _failure(f"{path} is not a UTF-8 text file; patch only edits text.", path=path, replacements=0)
        count = text.count(old)
        if count == 0:
            return _failure(f"old_string was not found in {path}; read the file and copy the text exactly.", path=path, replacements=0)
        if count > 1 and not replace_all:
            return _failure(
                f"old_string occurs {count} times in {path}; include more surrounding text to make it unique, "
                "or set replace_all to true.",
                path=path,
                replacements=0,
            )
        updated = text.replace(old, new) if replace_all else text.replace(old, new, 1)
        try:
            await ctx.sandbox.write_file(path, updated.encode("utf-8"))
        except OSError as exc:
            return _failure(_os_error(path, exc), path=path, replacements=0)
        return {"path": path, "replacements": count if replace_all else 1, "error": None}


class SearchFilesTool(Tool):
    """Searches file contents for a regular expression with grep, inside the sandbox."""

    name = "search_files"
    description = (
        "Search the contents of files under `path` (default: the working directory) for a POSIX extended "
        "regular expression, like `grep -rnE`. `glob` limits the search to file names matching it (for "
        f"example '*.py'); .git folders are skipped. Returns up to {MAX_SEARCH_MATCHES} matches, one per "
        "line as 'file:line:text'."
    )
    parameters = {
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "description": "Extended regular expression (grep -E syntax)."},
            "path": {"type": "string", "description": "File or folder to search, default the working directory."},
            "glob": {"type": "string", "description": "Only search files whose name matches this glob, e.g. '*.py'."},
        },
        "required": ["pattern"],
        "additionalProperties": False,
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        pattern = arguments.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            return _failure("pattern must be a non-empty string.", matches="", count=0)
        path = arguments.get("path") or "."
        glob = arguments.get("glob")
        if not isinstance(path, str) or (glob is not None and not isinstance(glob, str)):
            return _failure("path and glob must be strings.", matches="", count=0)
        if path not in (".", "./"):
            # The sandbox's own rule for what the file API may reach (read_file refuses the same paths):
            # a search is no way around it.
            try:
                await ctx.sandbox.read_file(path, max_bytes=0)
            except IsADirectoryError:
                pass
            except OSError as exc:
                return _failure(_os_error(path, exc), matches="", count=0)
        if path.startswith("-"):
            path = "./" + path  # so find does not read it as an option
        name_test = f" -name {shlex.quote(glob)}" if glob else ""
        quoted = shlex.quote(pattern)
        # grep on /dev/null first reports a bad regex even when no file is searched (status 2).
        # find + grep -nHE: POSIX options only, so busybox images work too; head bounds the output.
        command = (
            f"grep -E -e {quoted} /dev/null 2>&1; [ $? -lt 2 ] && "
            f"find {shlex.quote(path)} -name .git -prune -o -type f{name_test} "
            f"-exec grep -nHE -e {quoted} {{}} + 2>&1 | head -n {MAX_SEARCH_MATCHES + 20}"
        )
        result = await ctx.sandbox.exec(command, ctx.command_timeout)
        matches: list[str] = []
        messages: list[str] = []
        for line in result.output.splitlines():
            if _MATCH_LINE.match(line):
                matches.append(line[:MAX_MATCH_LINE_CHARS])
            elif line.strip() and not _BINARY_NOTE.search(line) and line not in messages:
                messages.append(line)
        truncated = len(matches) > MAX_SEARCH_MATCHES
        matches = matches[:MAX_SEARCH_MATCHES]
        error = None
        if result.timed_out:
            error = f"The search timed out after {ctx.command_timeout:g} s; narrow it with path or glob."
        elif not matches and messages:
            error = "; ".join(messages)[:1000]
        out = {"matches": "\n".join(matches), "count": len(matches), "truncated": truncated, "error": error}
        if truncated:
            out["note"] = f"Only the first {MAX_SEARCH_MATCHES} matches are shown; narrow the pattern, path or glob."
        return out


FILE_TOOLSET = Toolset(
    "file",
    "Read, write, patch and search files in the prompt's sandbox.",
    (ReadFileTool, WriteFileTool, PatchTool, SearchFilesTool),
)


@hermes_batch.hookimpl
def register_toolsets(register):
    register(FILE_TOOLSET)
