"""The ``terminal`` toolset: run a shell command in the prompt's sandbox."""

from __future__ import annotations

import hermes_batch

from ..contract.interfaces import Tool, ToolContext, Toolset


def _notice(cut: int) -> str:
    return f"\n\n[... {cut} characters cut ...]\n\n"


def truncate_middle(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, keeping its start and end around a notice of the cut."""
    if len(text) <= limit:
        return text
    # Size the notice for the largest possible count so that output plus notice stays within the limit.
    keep = max(limit - len(_notice(len(text))), 0)
    notice = _notice(len(text) - keep)
    head = keep // 2
    tail = keep - head
    return text[:head] + notice + (text[len(text) - tail :] if tail else "")


class TerminalTool(Tool):
    """Runs one shell command in the sandbox and returns its combined output and exit code."""

    name = "terminal"
    runs_commands = True
    description = (
        "Run a shell command (POSIX sh, non-interactive) in your sandbox and get its combined stdout and "
        "stderr and its exit code. Each call starts a new shell in the working directory: `cd` and "
        "variables do not carry over between calls, so chain commands with `&&`. Commands must not wait "
        "for input; a command still running at the timeout is killed with everything it started. To keep "
        "a server running, start it in the background with its output redirected to a file "
        "(`cmd > log 2>&1 &`). Long output is shortened in the middle."
    )
    parameters = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command line to run with /bin/sh -c."},
            "timeout": {
                "type": "integer",
                "minimum": 1,
                "description": "Seconds before the command is killed; defaults to, and cannot exceed, the run's command timeout.",
            },
        },
        "required": ["command"],
        "additionalProperties": False,
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        command = arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            return {"output": "", "exit_code": None, "error": "The command must be a non-empty string."}
        timeout = ctx.command_timeout
        requested = arguments.get("timeout")
        if isinstance(requested, (int, float)) and not isinstance(requested, bool) and requested > 0:
            timeout = min(float(requested), timeout)
        result = await ctx.sandbox.exec(command, timeout)
        error = f"Command timed out after {timeout:g} s" if result.timed_out else None
        return {
            "output": truncate_middle(result.output, ctx.max_output_chars),
            "exit_code": result.exit_code,
            "error": error,
        }


TERMINAL_TOOLSET = Toolset("terminal", "Run shell commands in the prompt's sandbox.", (TerminalTool,))


@hermes_batch.hookimpl
def register_toolsets(register):
    register(TERMINAL_TOOLSET)
