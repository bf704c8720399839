"""The terminal and file toolsets, run against a real local sandbox."""

from __future__ import annotations

import asyncio
import json

import pytest

from hermes_batch.default_plugins.file_tools import (
    MAX_SEARCH_MATCHES,
    PatchTool,
    ReadFileTool,
    SearchFilesTool,
    WriteFileTool,
)
from hermes_batch.local_sandbox.backend import LocalSandboxBackend, LocalSandboxConfig
from hermes_batch.default_plugins.terminal_tools import TerminalTool, truncate_middle
from hermes_batch.errors import SandboxError
from hermes_batch.contract.interfaces import ToolContext
from hermes_batch.contract.plugins import collect, get_plugin_manager
from hermes_batch.formats.records import SandboxSpec
from hermes_batch.contract.run_context import RunContext
from hermes_batch.testing.sandbox_contract import make_huge_files, peak_rss, peak_rss_reset


@pytest.fixture
async def sandbox(tmp_path):
    backend = LocalSandboxBackend(LocalSandboxConfig(), RunContext("tools-test", tmp_path / "run", seed=0))
    await backend.start()
    sandbox = await backend.open(SandboxSpec("tools-test", 0, "0123456789abcdef"))
    yield sandbox
    await backend.shutdown()


@pytest.fixture
def ctx(sandbox):
    return ToolContext(sandbox, command_timeout=10, max_output_chars=2000)


async def call(tool_cls, ctx, **arguments) -> dict:
    result = await tool_cls().call(arguments, ctx)
    json.dumps(result)  # every result must be JSON
    assert "error" in result
    return result


def test_toolsets_are_registered_with_the_seed_names():
    registry = collect(get_plugin_manager(load_entry_points=False))
    assert [t.name for t in registry.get("toolsets", "terminal").tools] == ["terminal"]
    assert [t.name for t in registry.get("toolsets", "file").tools] == ["read_file", "write_file", "patch", "search_files"]
    for tool in (TerminalTool, ReadFileTool, WriteFileTool, PatchTool, SearchFilesTool):
        spec = tool.spec()
        assert spec.parameters["type"] == "object"
        assert set(spec.parameters["required"]) <= set(spec.parameters["properties"])


# --- terminal -----------------------------------------------------------------


async def test_terminal_runs_a_command(ctx):
    assert await call(TerminalTool, ctx, command="echo hi; echo oops >&2") == {
        "output": "hi\noops\n",
        "exit_code": 0,
        "error": None,
    }


async def test_terminal_non_zero_exit_is_not_an_error(ctx):
    result = await call(TerminalTool, ctx, command="ls no-such-file")
    assert result["exit_code"] != 0
    assert "no-such-file" in result["output"]
    assert result["error"] is None


async def test_terminal_timeout_is_an_error(ctx):
    result = await call(TerminalTool, ctx, command="echo started; sleep 30", timeout=1)
    assert result["error"] == "Command timed out after 1 s"
    assert result["exit_code"] is None
    assert "started" in result["output"]


async def test_terminal_timeout_is_capped_by_the_run(sandbox):
    ctx = ToolContext(sandbox, command_timeout=1, max_output_chars=2000)
    result = await call(TerminalTool, ctx, command="sleep 30", timeout=600)
    assert result["error"] == "Command timed out after 1 s"


async def test_terminal_truncates_long_output_with_a_notice(ctx, sandbox):
    result = await call(TerminalTool, ctx, command="echo FIRST; seq 1 5000; echo LAST")
    output = result["output"]
    assert len(output) <= ctx.max_output_chars
    assert output.startswith("FIRST\n")
    assert output.endswith("LAST\n")
    full_length = len((await sandbox.exec("echo FIRST; seq 1 5000; echo LAST", 10)).output)
    head, rest = output.split("\n\n[... ")
    cut, tail = rest.split(" characters cut ...]\n\n")
    assert len(head) + int(cut) + len(tail) == full_length
    assert result["error"] is None


def test_truncate_middle_counts_exactly():
    text = "a" * 500 + "b" * 500
    out = truncate_middle(text, 100)
    head, rest = out.split("\n\n[... ")
    number, tail = rest.split(" characters cut ...]\n\n")
    assert len(out) <= 100
    assert len(head) + len(tail) + int(number) == len(text)
    assert truncate_middle("short", 100) == "short"


async def test_terminal_rejects_an_empty_command(ctx):
    result = await call(TerminalTool, ctx, command="  ")
    assert result["error"]


async def test_terminal_sandbox_failure_fails_the_prompt(ctx, sandbox):
    await sandbox.close()
    with pytest.raises(SandboxError):
        await TerminalTool().call({"command": "echo hi"}, ctx)


# --- read_file / write_file -------------------------------------------------------


async def test_write_then_read_with_line_numbers(ctx, sandbox):
    written = await call(WriteFileTool, ctx, path="src/app.py", content="import os\nprint('é')\n")
    assert written == {"path": "src/app.py", "bytes_written": len("import os\nprint('é')\n".encode()), "error": None}
    assert await sandbox.read_file("src/app.py") == "import os\nprint('é')\n".encode()
    result = await call(ReadFileTool, ctx, path="src/app.py")
    assert result["content"] == "     1|import os\n     2|print('é')"
    assert (result["start_line"], result["end_line"], result["total_lines"]) == (1, 2, 2)
    assert result["error"] is None


async def test_read_offset_and_limit(ctx, sandbox):
    await sandbox.write_file("lines.txt", "".join(f"line {i}\n" for i in range(1, 101)).encode())
    result = await call(ReadFileTool, ctx, path="lines.txt", offset=10, limit=3)
    assert result["content"] == "    10|line 10\n    11|line 11\n    12|line 12"
    assert (result["end_line"], result["total_lines"]) == (12, 100)
    past = await call(ReadFileTool, ctx, path="lines.txt", offset=500)
    assert "past the end" in past["error"]


async def test_read_stops_at_the_output_limit_and_says_where_to_continue(ctx, sandbox):
    await sandbox.write_file("big.txt", "".join(f"{'x' * 90} {i}\n" for i in range(1, 1001)).encode())
    result = await call(ReadFileTool, ctx, path="big.txt")
    assert len(result["content"]) <= ctx.max_output_chars
    assert result["error"] is None
    end = result["end_line"]
    assert 1 < end < 1000
    assert result["note"] == f"Output limit reached; continue with offset={end + 1}."
    nxt = await call(ReadFileTool, ctx, path="big.txt", offset=end + 1, limit=1)
    assert nxt["content"] == f"{end + 1:>6}|{'x' * 90} {end + 1}"


async def test_read_errors_are_results(ctx, sandbox):
    missing = await call(ReadFileTool, ctx, path="nope.txt")
    assert missing["error"] == "File not found: nope.txt"
    escaped = await call(ReadFileTool, ctx, path="../../outside.txt")
    assert "outside this prompt's sandbox folder" in escaped["error"]
    await sandbox.exec("mkdir adir; printf 'a\\000b' > bin.dat", 10)
    assert "is a directory" in (await call(ReadFileTool, ctx, path="adir"))["error"]
    assert "binary file" in (await call(ReadFileTool, ctx, path="bin.dat"))["error"]


async def test_write_errors_are_results(ctx):
    escaped = await call(WriteFileTool, ctx, path="/etc/hermes-batch-test.txt", content="x")
    assert "outside this prompt's sandbox folder" in escaped["error"]
    bad = await call(WriteFileTool, ctx, path="ok.txt", content=None)
    assert bad["error"] == "content must be a string."


# --- patch -----------------------------------------------------------------------


async def test_patch_replaces_a_unique_string(ctx, sandbox):
    await sandbox.write_file("a.py", b"def f():\n    return 1\n")
    result = await call(PatchTool, ctx, path="a.py", old_string="return 1", new_string="return 2")
    assert result == {"path": "a.py", "replacements": 1, "error": None}
    assert await sandbox.read_file("a.py") == b"def f():\n    return 2\n"


async def test_patch_refuses_an_ambiguous_string_unless_replace_all(ctx, sandbox):
    await sandbox.write_file("b.txt", b"x = 1\ny = 1\n")
    ambiguous = await call(PatchTool, ctx, path="b.txt", old_string="1", new_string="2")
    assert "occurs 2 times" in ambiguous["error"]
    assert await sandbox.read_file("b.txt") == b"x = 1\ny = 1\n"
    result = await call(PatchTool, ctx, path="b.txt", old_string="1", new_string="2", replace_all=True)
    assert result == {"path": "b.txt", "replacements": 2, "error": None}
    assert await sandbox.read_file("b.txt") == b"x = 2\ny = 2\n"


async def test_patch_errors_are_results(ctx, sandbox):
    await sandbox.write_file("c.txt", b"hello\n")
    not_found = await call(PatchTool, ctx, path="c.txt", old_string="bye", new_string="hi")
    assert "was not found" in not_found["error"]
    assert (await call(PatchTool, ctx, path="missing.txt", old_string="a", new_string="b"))["error"] == (
        "File not found: missing.txt"
    )
    assert "non-empty" in (await call(PatchTool, ctx, path="c.txt", old_string="", new_string="x"))["error"]
    await sandbox.write_file("latin1.txt", b"caf\xe9\n")
    assert "not a UTF-8 text file" in (await call(PatchTool, ctx, path="latin1.txt", old_string="caf", new_string="x"))["error"]
    assert await sandbox.read_file("c.txt") == b"hello\n"


# --- search_files -------------------------------------------------------------------


async def test_search_files_finds_matches_with_line_numbers(ctx, sandbox):
    await sandbox.write_file("src/a.py", b"import os\ndef main():\n    pass\n")
    await sandbox.write_file("src/b.txt", b"def not_python\n")
    await sandbox.write_file(".git/config", b"def hidden\n")
    result = await call(SearchFilesTool, ctx, pattern="^def [a-z_]+")
    assert sorted(result["matches"].splitlines()) == ["./src/a.py:2:def main():", "./src/b.txt:1:def not_python"]
    assert result["count"] == 2
    assert result["error"] is None
    only_py = await call(SearchFilesTool, ctx, pattern="def", path="src", glob="*.py")
    assert only_py["matches"] == "src/a.py:2:def main():"


async def test_search_files_quotes_its_arguments(ctx, sandbox):
    await sandbox.write_file("weird name.txt", b"it's $HOME; `x`\n")
    result = await call(SearchFilesTool, ctx, pattern="it's \\$HOME; `x`", path="weird name.txt")
    assert result["matches"] == "weird name.txt:1:it's $HOME; `x`"


async def test_search_files_without_matches_is_not_an_error(ctx, sandbox):
    await sandbox.write_file("a.txt", b"nothing here\n")
    assert await call(SearchFilesTool, ctx, pattern="absent") == {
        "matches": "",
        "count": 0,
        "truncated": False,
        "error": None,
    }


async def test_search_files_caps_matches(ctx, sandbox):
    await sandbox.write_file("many.txt", b"hit\n" * (MAX_SEARCH_MATCHES + 50))
    result = await call(SearchFilesTool, ctx, pattern="hit")
    assert result["count"] == MAX_SEARCH_MATCHES
    assert result["truncated"] is True
    assert "first" in result["note"]


async def test_search_files_errors_are_results(ctx, sandbox):
    empty = await call(SearchFilesTool, ctx, pattern="(unclosed")
    assert empty["error"] and empty["count"] == 0  # reported even with no file to search
    await sandbox.write_file("a.txt", b"(unclosed\n")
    bad_regex = await call(SearchFilesTool, ctx, pattern="(unclosed")
    assert bad_regex["error"] and bad_regex["count"] == 0
    missing = await call(SearchFilesTool, ctx, pattern="x", path="no-such-dir")
    assert "no-such-dir" in missing["error"]


# --- hostile paths and sizes ---------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/etc", "..", "../..", "sub/../../..", "link-out", "link-out/etc"])
async def test_search_files_stays_inside_the_sandbox(ctx, sandbox, path):
    await sandbox.exec("mkdir sub && ln -s / link-out", 10)
    result = await call(SearchFilesTool, ctx, pattern="root", path=path)
    assert result["count"] == 0 and result["matches"] == ""
    assert "outside this prompt's sandbox folder" in result["error"]


async def test_search_files_accepts_paths_inside(ctx, sandbox):
    await sandbox.write_file("sub/deeper/a.txt", b"needle\n")
    for path in ("sub", "./sub/deeper", "sub/../sub", f"{sandbox.workdir}/sub", "sub/deeper/a.txt"):
        result = await call(SearchFilesTool, ctx, pattern="needle", path=path)
        assert result["count"] == 1, path


async def test_file_tools_refuse_a_fifo_at_once(ctx, sandbox):
    await sandbox.exec("mkfifo pipe", 10)
    for tool, arguments in (
        (ReadFileTool, {"path": "pipe"}),
        (WriteFileTool, {"path": "pipe", "content": "x"}),
        (PatchTool, {"path": "pipe", "old_string": "a", "new_string": "b"}),
    ):
        result = await asyncio.wait_for(call(tool, ctx, **arguments), 10)
        assert "is a FIFO (named pipe), not a regular file" in result["error"], tool.name


def peak_rss_growth():
    """A context that measures how far this process's peak resident size rises (bytes) inside it."""
    baseline = peak_rss_reset()
    if baseline is None:
        pytest.skip("this kernel cannot reset the peak resident size")
    return lambda: peak_rss() - baseline


async def test_read_file_memory_follows_what_it_returns(ctx, sandbox):
    await make_huge_files(sandbox, "some text on a line of its own", 50_000_000)
    growth = peak_rss_growth()
    binary = await call(ReadFileTool, ctx, path="sparse")
    assert "binary file" in binary["error"]
    first = await call(ReadFileTool, ctx, path="text")
    assert first["content"].startswith("     1|some text on a line of its own\n     2|")
    assert first["total_lines"] is None and "continue with offset=" in first["note"]
    assert growth() < 8 * 1024 * 1024  # what the first lines need: the start of the file only
    deep = await call(ReadFileTool, ctx, path="text", offset=200_000, limit=2)
    assert deep["content"] == "200000|some text on a line of its own\n200001|some text on a line of its own"
    beyond = await call(ReadFileTool, ctx, path="text", offset=1_000_000)
    assert "past the first 16 MiB" in beyond["error"] and "terminal" in beyond["error"]
    assert growth() < 64 * 1024 * 1024


async def test_patch_refuses_files_larger_than_its_limit(ctx, sandbox):
    await sandbox.exec("yes 'old text' | head -c 30000000 > big.txt", 30)
    growth = peak_rss_growth()
    result = await call(PatchTool, ctx, path="big.txt", old_string="old text", new_string="new text", replace_all=True)
    assert "larger than 8 MiB" in result["error"] and result["replacements"] == 0
    assert growth() < 40 * 1024 * 1024
    assert (await sandbox.exec("head -c 8 big.txt", 10)).output == "old text"
