"""The agent loop of one prompt: model calls, tool calls in the sandbox, and how the session ended."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from typing import Callable, Mapping, Optional

import attrs

from ..errors import ModelOutcome, PromptFailure, RunFolderWriteError
from ..contract.interfaces import COMMAND_TIMEOUT, MAX_OUTPUT_CHARS, ModelClient, Tool, ToolContext
from ..formats.jsonguard import arguments_problem, escape_controls, safe_message, scrub_text
from ..formats.records import InvalidToolCall, Message, ToolCall, ToolStat, Usage
from ..contract.run_context import LOG_PREFIX_CHARS
from ..formats.schema import validate

log = logging.getLogger("hermes_batch.session.agent")

# finish reasons that end a session early although the model was not done
_EARLY_STOPS = {"length": "length", "content_filter": "content_filter"}
# A reply without tool calls whose text holds a tool call's markup: the endpoint could not parse the call the model
# made (a local server's template, a call in another model's syntax), so the session ended without an answer.
_TOOL_CALL_MARKUP = re.compile(r"<tool_call>|<tool_calls>|<function=|<\|tool_call|\[TOOL_CALLS\]|<\|python_tag\|>")
# Why a reply without tool calls is no answer (end_reason), or None when it is one.
EMPTY_ANSWER, UNPARSED_TOOL_CALL = "empty_answer", "unparsed_tool_call"
# a tool call may outlive --command_timeout by this much (killing a process tree, a slow sandbox) before it is cut
TOOL_GRACE_S = 30.0
MAX_TURNS = 10  # the default of --max_turns
MAX_TOOL_CALLS_PER_TURN = 20  # the default of --max_tool_calls_per_turn


@attrs.frozen
class AgentSettings:
    """How sessions run; the same for every prompt of a run."""

    max_turns: int = MAX_TURNS
    system_prompt: str = ""
    ephemeral_system_prompt: Optional[str] = None
    prefill: tuple = ()  # of Message, sent before the prompt and never saved
    command_timeout: float = COMMAND_TIMEOUT
    max_output_chars: int = MAX_OUTPUT_CHARS
    log_prefix_chars: int = LOG_PREFIX_CHARS
    prompt_timeout: Optional[float] = None  # wall-clock limit of one prompt's whole session, sandbox included
    max_tool_calls_per_turn: int = MAX_TOOL_CALLS_PER_TURN  # calls of one reply beyond this are answered with an error, not run


@attrs.frozen
class SessionResult:
    """What happened in one session; turned into a Trajectory by the runner."""

    messages: tuple  # assistant and tool Messages after the prompt
    api_calls: int
    completed: bool
    partial: bool
    end_reason: str
    tool_stats: dict
    invalid_tool_calls: tuple  # of InvalidToolCall
    usage: Usage


@attrs.define
class _Tally:
    count: int = 0
    success: int = 0
    failure: int = 0


@attrs.define
class SessionLog:
    """What a session has done so far; owned by the caller, so a deadline or a failure keeps it."""

    messages: list = attrs.Factory(list)  # assistant and tool Messages after the prompt
    calls: list = attrs.Factory(list)  # a CallRecord per model request, failed attempts included
    api_calls: int = 0
    usage: Usage = Usage()
    tallies: dict = attrs.Factory(dict)  # tool name -> _Tally
    invalid: list = attrs.Factory(list)  # InvalidToolCall, in the order the calls were made
    replay: Optional[object] = None  # a session.replay.SessionReplay: recorded answers used before calls are made
    # --branch_at: the prefix this session continues, the model calls it holds, the sampling its requests send
    branch_of: str = ""
    branch_turn: int = 0
    sampling: Optional[dict] = None

    @property
    def replayed_turns(self) -> int:
        """Model answers this session took from the replay journal or the response cache, without a call."""
        return self.replay.replayed if self.replay is not None else 0

    def result(self, *, completed: bool, end_reason: str) -> SessionResult:
        """The session as it stands, ended for ``end_reason``."""
        return SessionResult(
            messages=tuple(self.messages),
            api_calls=self.api_calls,
            completed=completed,
            partial=not completed,
            end_reason=end_reason,
            tool_stats={name: ToolStat(t.count, t.success, t.failure) for name, t in self.tallies.items()},
            invalid_tool_calls=tuple(self.invalid),
            usage=self.usage,
        )


def _is_failure(result: Mapping) -> bool:
    return result.get("error") is not None or result.get("success") is False


def _preview(text: str, limit: int) -> str:
    text = text.replace("\n", " ")
    # the model's ESC and NUL bytes go to a terminal: shown escaped, never acted on
    return escape_controls(text if len(text) <= limit else text[:limit] + "...")


@functools.lru_cache(maxsize=16)
def _system_message(text: str) -> Message:
    # one object for every prompt of the run: the model clients serialize a message once, found by identity
    return Message("system", text)


async def run_session(
    client: ModelClient,
    tools: Mapping[str, Tool],
    ctx: ToolContext,
    prompt: str,
    settings: AgentSettings,
    say: Optional[Callable[[str], None]] = None,
    state: Optional[SessionLog] = None,
) -> SessionResult:
    """Run the agent on ``prompt`` with ``tools`` until a final answer or ``max_turns`` model calls.

    The session is kept in ``state`` as it goes, so a caller that cuts it short still has the turns done.
    """
    system = settings.system_prompt
    if settings.ephemeral_system_prompt:
        system = f"{system}\n\n{settings.ephemeral_system_prompt}" if system else settings.ephemeral_system_prompt
    head = ((_system_message(system),) if system else ()) + tuple(settings.prefill) + (Message("user", prompt),)
    specs = tuple(tool.spec() for tool in tools.values())
    state = state if state is not None else SessionLog()
    session = state.messages
    for name in tools:  # a branch's state holds its prefix's counts already
        state.tallies.setdefault(name, _Tally())
    end_reason = "max_turns"
    completed = False

    while state.api_calls < settings.max_turns:
        messages = head + tuple(session)
        replay = state.replay
        response = replay.lookup(messages, specs) if replay is not None else None
        if response is None:
            try:
                response = await client.complete(messages, specs, calls=state.calls)
            except ModelOutcome as exc:
                end_reason = exc.reason
                break
            if replay is not None:
                replay.record(response)  # journaled before the session acts on it
        state.api_calls += 1
        state.usage = state.usage + response.usage
        message = safe_message(response.message)  # half an emoji must not crash the record or the next request
        session.append(message)
        if say:
            said = message.content or ("(reasoning) " + message.reasoning if message.reasoning else "")
            names = escape_controls(", ".join(c.name for c in message.tool_calls))
            calls = f" -> calls {names}" if message.tool_calls else ""
            say(f"turn {state.api_calls}: {_preview(said, settings.log_prefix_chars)}{calls}")
        if response.finish_reason in _EARLY_STOPS:
            end_reason = _EARLY_STOPS[response.finish_reason]
            break
        if not message.tool_calls:
            end_reason = _no_answer(message, response.finish_reason) or "final_answer"
            completed = end_reason == "final_answer"
            break
        for index, call in enumerate(message.tool_calls):
            if index < settings.max_tool_calls_per_turn:
                result = await _call_tool(call, tools, state.tallies, state.invalid, ctx)
            else:
                result = _not_run(len(message.tool_calls), settings.max_tool_calls_per_turn)
            content = scrub_text(json.dumps(result, ensure_ascii=False))  # a tool may return any text
            if say:
                say(f"  {escape_controls(call.name)}({_preview(call.raw_arguments, settings.log_prefix_chars)}) -> "
                    f"{_preview(content, settings.log_prefix_chars)}")
            session.append(Message("tool", content, tool_call_id=call.id, name=call.name))

    return state.result(completed=completed, end_reason=end_reason)


def _no_answer(message: Message, finish_reason: Optional[str]) -> Optional[str]:
    """Why a reply without tool calls ends the session without an answer, or None when it is an answer."""
    if finish_reason == "tool_calls" or _TOOL_CALL_MARKUP.search(message.content):
        return UNPARSED_TOOL_CALL
    if not message.content.strip():  # reasoning alone is no answer
        return EMPTY_ANSWER
    return None


def _not_run(made: int, cap: int) -> dict:
    # Every call still gets a result: the APIs refuse a conversation with a call left unanswered.
    return {
        "error": f"Not run: this reply made {made} tool calls and only the first {cap} of a reply are run "
        "(--max_tool_calls_per_turn); make fewer calls per reply."
    }


async def _call_tool(call: ToolCall, tools, tallies, invalid: list, ctx: ToolContext) -> dict:
    tool = tools.get(call.name)
    if tool is None:
        invalid.append(InvalidToolCall(call.id, call.name, "unknown tool"))
        available = ", ".join(sorted(tools)) or "none"
        return {"error": f"Unknown tool {call.name!r}; the tools available are: {available}."}
    tally = tallies[call.name]
    tally.count += 1
    if call.arguments is None:
        problem = arguments_problem(call.raw_arguments)
    else:
        problem = validate(call.arguments, tool.parameters)
    if problem:
        tally.failure += 1
        invalid.append(InvalidToolCall(call.id, call.name, problem))
        return {"error": f"Invalid arguments for {call.name}: {problem}."}
    if ctx.sandbox is not None:
        # opened beside the first model request; waiting for it is not on the tool's clock, and a sandbox
        # that cannot be opened fails the prompt (SandboxError), as it did when it was opened first
        await ctx.sandbox.ready()
    limit = ctx.command_timeout + TOOL_GRACE_S
    try:
        async with asyncio.timeout(limit) as deadline:
            result = await tool.call(call.arguments, ctx)
    except (PromptFailure, RunFolderWriteError):  # the journal of a tool's model call could not be written
        raise
    except Exception as exc:  # a tool bug must not kill the session; the model sees the error
        if isinstance(exc, TimeoutError) and deadline.expired():
            log.warning("tool %s did not return within %g s; its call was abandoned", call.name, limit)
            result = {"error": f"The tool did not finish within {limit:g} s and was stopped."}
        else:
            log.debug("tool %s raised", call.name, exc_info=True)
            result = {"error": f"{type(exc).__name__}: {exc}"}
    if _is_failure(result):
        tally.failure += 1
    else:
        tally.success += 1
    return result
