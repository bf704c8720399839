"""The agent loop of one prompt: model calls, tool calls in the sandbox, and how the session ended."""

from __future__ import annotations

import json
import logging
from typing import Callable, Mapping, Optional

import attrs

from .errors import ModelOutcome, PromptFailure
from .interfaces import ModelClient, Tool, ToolContext
from .records import Message, ToolCall, ToolStat, Usage
from .schema import validate

log = logging.getLogger("hermes_batch.agent")

# finish reasons that end a session early although the model was not done
_EARLY_STOPS = {"length": "length", "content_filter": "content_filter"}


@attrs.frozen
class AgentSettings:
    """How sessions run; the same for every prompt of a run."""

    max_turns: int = 10
    system_prompt: str = ""
    ephemeral_system_prompt: Optional[str] = None
    prefill: tuple = ()  # of Message, sent before the prompt and never saved
    command_timeout: float = 180.0
    max_output_chars: int = 20000
    log_prefix_chars: int = 100


@attrs.frozen
class SessionResult:
    """What happened in one session; turned into a Trajectory by the runner."""

    messages: tuple  # assistant and tool Messages after the prompt
    api_calls: int
    completed: bool
    partial: bool
    end_reason: str
    tool_stats: dict
    invalid_tool_calls: tuple
    usage: Usage
    providers: tuple


@attrs.define
class _Tally:
    count: int = 0
    success: int = 0
    failure: int = 0


def _is_failure(result: Mapping) -> bool:
    return result.get("error") is not None or result.get("success") is False


def _preview(text: str, limit: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


async def run_session(
    client: ModelClient,
    tools: Mapping[str, Tool],
    ctx: ToolContext,
    prompt: str,
    settings: AgentSettings,
    say: Optional[Callable[[str], None]] = None,
) -> SessionResult:
    """Run the agent on ``prompt`` with ``tools`` until a final answer or ``max_turns`` model calls."""
    system = settings.system_prompt
    if settings.ephemeral_system_prompt:
        system = f"{system}\n\n{settings.ephemeral_system_prompt}" if system else settings.ephemeral_system_prompt
    head = ((Message("system", system),) if system else ()) + tuple(settings.prefill) + (Message("user", prompt),)
    specs = tuple(tool.spec() for tool in tools.values())
    session: list[Message] = []
    tallies = {name: _Tally() for name in tools}
    invalid: list[dict] = []
    usage = Usage()
    providers: list[str] = []
    api_calls = 0
    end_reason = "max_turns"
    completed = False

    while api_calls < settings.max_turns:
        try:
            response = await client.complete(head + tuple(session), specs)
        except ModelOutcome as exc:
            end_reason = exc.reason
            break
        api_calls += 1
        usage = usage + response.usage
        if response.provider:
            providers.append(response.provider)
        message = response.message
        session.append(message)
        if say:
            said = message.content or ("(reasoning) " + message.reasoning if message.reasoning else "")
            calls = f" -> calls {', '.join(c.name for c in message.tool_calls)}" if message.tool_calls else ""
            say(f"turn {api_calls}: {_preview(said, settings.log_prefix_chars)}{calls}")
        if response.finish_reason in _EARLY_STOPS:
            end_reason = _EARLY_STOPS[response.finish_reason]
            break
        if not message.tool_calls:
            completed = True
            end_reason = "final_answer"
            break
        for call in message.tool_calls:
            result = await _call_tool(call, tools, tallies, invalid, ctx)
            content = json.dumps(result, ensure_ascii=False)
            if say:
                say(f"  {call.name}({_preview(call.raw_arguments, settings.log_prefix_chars)}) -> "
                    f"{_preview(content, settings.log_prefix_chars)}")
            session.append(Message("tool", content, tool_call_id=call.id, name=call.name))

    return SessionResult(
        messages=tuple(session),
        api_calls=api_calls,
        completed=completed,
        partial=not completed,
        end_reason=end_reason,
        tool_stats={name: ToolStat(t.count, t.success, t.failure) for name, t in tallies.items()},
        invalid_tool_calls=tuple(invalid),
        usage=usage,
        providers=tuple(providers),
    )


async def _call_tool(call: ToolCall, tools, tallies, invalid: list, ctx: ToolContext) -> dict:
    tool = tools.get(call.name)
    if tool is None:
        invalid.append({"name": call.name, "reason": "unknown tool"})
        available = ", ".join(sorted(tools)) or "none"
        return {"error": f"Unknown tool {call.name!r}; the tools available are: {available}."}
    tally = tallies[call.name]
    tally.count += 1
    if call.arguments is None:
        problem = "arguments are not valid JSON"
    else:
        problem = validate(call.arguments, tool.parameters)
    if problem:
        tally.failure += 1
        invalid.append({"name": call.name, "reason": problem})
        return {"error": f"Invalid arguments for {call.name}: {problem}."}
    try:
        result = await tool.call(call.arguments, ctx)
    except PromptFailure:
        raise
    except Exception as exc:  # a tool bug must not kill the session; the model sees the error
        log.debug("tool %s raised", call.name, exc_info=True)
        result = {"error": f"{type(exc).__name__}: {exc}"}
    if _is_failure(result):
        tally.failure += 1
    else:
        tally.success += 1
    return result
