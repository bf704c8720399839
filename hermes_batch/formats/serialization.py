"""The one place where records become JSON and back (cattrs converters).

``record_converter`` reads leniently (unknown keys ignored, so files written by
newer versions still load, and the shapes older versions wrote still read);
``config_converter`` is strict (unknown keys and wrong types are errors,
``"false"`` is not a bool).

Records are written so that every field has one JSON type in every record,
whatever the run holds: Arrow readers (pyarrow, HuggingFace ``datasets``) fix a
column's type from the first block they read, and neither a ``null`` nor an
empty list carries a type, so a later value of another type breaks the load.
Hence: no nulls (an absent string is ``""``, an absent status ``0``, cost
``0.0`` with ``cost_reported`` false), floats always written as floats, and
the fields whose shape the model, the dataset or the run decides
(``tool_calls[].arguments``, ``metadata.row``, ``metadata.sampling``, ``metadata.invalid_tool_calls``,
``metadata.verifiers``, ``metadata.audit``)
written as JSON text, which is one string type whatever it holds.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional, TypeVar

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override
from cattrs.v import format_exception

from ..errors import ConfigError
from .endpoint_numbers import TOKEN_FIELDS, finite_seconds, stored_cost, stored_usage
from .jsonguard import MAX_DEPTH, finite_dumps, has_lone_surrogate, scrub_text, value_problem
from .reward_numbers import stored_reward
from .records import (
    AuditFinding, CallRecord, InvalidToolCall, Metadata, SessionInfo, ToolCallRecord, Trajectory, Turn, Usage, VerifierResult,
)

T = TypeVar("T")


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # text in a string: NaN there is the model's word, not a number


def _unstructure_usage(usage: Usage) -> dict:
    usage = usage or Usage()  # a plugin may still build records with usage=None
    # what no reader could take back (NaN, Infinity, 10**30 tokens) is never written: it is not reported
    usage = stored_usage({name: getattr(usage, name) for name in (*TOKEN_FIELDS, "cost")})
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "reasoning_tokens": usage.reasoning_tokens,
        "cached_tokens": usage.cached_tokens,
        "cost": float(usage.cost or 0.0),
        "cost_reported": usage.cost is not None,
    }


def _structure_usage(data: Any, _type=None) -> Usage:
    if not isinstance(data, dict):  # null: written by versions before schema 2
        return Usage()
    # values no call could report (NaN, Infinity, negative, 10**30), as older versions wrote them, are not reported
    return stored_usage(data)


def _unstructure_call(call: CallRecord) -> dict:
    return {"provider": call.provider or "", "latency_s": finite_seconds(call.latency_s), "status": call.status or 0}


def _structure_call(data: Any, _type=None) -> CallRecord:
    return CallRecord(data.get("provider") or None, finite_seconds(data.get("latency_s")), data.get("status") or None)


def _seconds(value: Any, _type=None) -> float:
    return finite_seconds(value)


def _session_cost(value: Any, _type=None) -> Optional[float]:
    return stored_cost(value, calls=None)


def _reward(value: Any, _type=None) -> float:
    """A reward as written and read: a float in [0, 1] (True, NaN, 1e308 or a string are 0.0)."""
    reward = stored_reward(value)
    return 0.0 if reward is None else reward


def _unverified_if_no_reward(meta: Metadata, reward: Any) -> Metadata:
    """``meta``, not verified when ``reward`` (as the record or a plugin has it) is no reward in [0, 1],
    and not passed unless verified.

    So every reader (statistics, pass@k, resume, refilter, the exports) counts such a sample as one
    whose verifier failed, and no sum of rewards can overflow.
    """
    if (meta.verified or meta.passed) and stored_reward(reward) is None:
        return attrs.evolve(meta, reward=0.0, verified=False, passed=False)
    if meta.passed and not meta.verified:
        return attrs.evolve(meta, passed=False)
    return meta


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _unstructure_verifier(result: VerifierResult) -> dict:
    data = {"name": _text(result.name), "reward": _reward(result.reward), "reason": _text(result.reason),
            "error": _text(result.error), "output": _text(result.output), "duration_s": finite_seconds(result.duration_s)}
    if result.disagree is not None:  # only an entry of two verdicts (command:clean=true) has it
        data["disagree"] = result.disagree is True
    return data


def _structure_verifier(data: Any, _type=None) -> VerifierResult:
    disagree = data.get("disagree")
    return VerifierResult(_text(data.get("name")), _reward(data.get("reward")), _text(data.get("reason")),
                          _text(data.get("error")), _text(data.get("output")), finite_seconds(data.get("duration_s")),
                          disagree if isinstance(disagree, bool) else None)


def _unstructure_verifiers(results: tuple) -> str:
    # JSON text, as invalid_tool_calls: "[]" (no verifier ran) and a list of objects are then one Arrow type
    if not results:
        return "[]"
    return _json_text([_unstructure_verifier(result) for result in results])


def _structure_verifiers(value: Any, _type=None) -> tuple:
    value = _from_text(value)
    return tuple(_structure_verifier(item) for item in value if isinstance(item, dict)) if isinstance(value, list) else ()


def _unstructure_audit(findings: Optional[tuple]) -> str:
    # JSON text as verifiers; "" for a record never audited, so that it does not read back as one with no findings
    if findings is None:
        return ""
    return _json_text([{"kind": _text(f.kind), "turn": _count(f.turn), "tool": _text(f.tool), "target": _text(f.target),
                        "excerpt": _text(f.excerpt)} for f in findings])


def _structure_audit(value: Any, _type=None) -> Optional[tuple]:
    if value is None or value == "":  # absent: a record of a version before the audit
        return None
    value = _from_text(value)
    if not isinstance(value, list):
        return ()
    return tuple(AuditFinding(_text(item.get("kind")), _count(item.get("turn")), _text(item.get("tool")),
                              _text(item.get("target")), _text(item.get("excerpt")))
                 for item in value if isinstance(item, dict))


def _count(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


def _sample_index(value: Any, _type=None) -> int:
    return value if type(value) is int and value >= 0 else 0


def _text_or_empty(value: Any, _type=None) -> str:
    return value if isinstance(value, str) else ""


def _flag(value: Any, _type=None) -> bool:
    return value is True


def _unstructure_tool_call(call: ToolCallRecord) -> dict:
    arguments = call.arguments if isinstance(call.arguments, str) else _json_text(call.arguments)
    return {"id": call.id, "name": call.name, "arguments": arguments}


def _from_text(value: Any) -> Any:
    """A field written as JSON text, decoded (None if it is not JSON); older records hold the value itself."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return None


def _structure_tool_call(data: Any, _type=None) -> ToolCallRecord:
    arguments = data.get("arguments")
    parsed = _from_text(arguments)
    # the text of a JSON object reads back as the object; any other text is the raw (invalid) arguments
    arguments = parsed if isinstance(parsed, dict) else arguments
    return ToolCallRecord(str(data["id"]), str(data["name"]), arguments)


def _structure_row(value: Any, _type=None) -> dict:
    value = _from_text(value)
    return value if isinstance(value, dict) else {}


def _structure_invalid_calls(value: Any, _type=None) -> tuple:
    value = _from_text(value)
    if isinstance(value, dict):  # before schema 2: an object keyed by tool call id
        value = [{"id": key, **(item if isinstance(item, dict) else {})} for key, item in value.items()]
    if not isinstance(value, list):
        return ()
    return tuple(
        InvalidToolCall(str(item.get("id", "")), str(item.get("name", "")), str(item.get("reason", "")))
        for item in value
        if isinstance(item, dict)
    )


def _unstructure_invalid_calls(calls: tuple) -> str:
    return _json_text([{"id": c.id, "name": c.name, "reason": c.reason} for c in calls])


def _make_record_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=False)
    conv.register_unstructure_hook(Usage, _unstructure_usage)
    conv.register_structure_hook(Usage, _structure_usage)
    conv.register_unstructure_hook(CallRecord, _unstructure_call)
    conv.register_structure_hook(CallRecord, _structure_call)
    conv.register_unstructure_hook(ToolCallRecord, _unstructure_tool_call)
    conv.register_structure_hook(ToolCallRecord, _structure_tool_call)
    conv.register_unstructure_hook(VerifierResult, _unstructure_verifier)
    conv.register_structure_hook(VerifierResult, _structure_verifier)
    # after the hooks above: generated functions bind the hooks registered when they are made
    conv.register_unstructure_hook(
        Turn,
        make_dict_unstructure_fn(Turn, conv, from_=override(rename="from"), tool_calls=override(omit_if_default=True)),
    )
    conv.register_structure_hook(Turn, make_dict_structure_fn(Turn, conv, from_=override(rename="from")))
    unstructure_metadata = make_dict_unstructure_fn(
        Metadata, conv,
        row=override(unstruct_hook=_json_text),
        sampling=override(unstruct_hook=_json_text),
        invalid_tool_calls=override(unstruct_hook=_unstructure_invalid_calls),
        duration_s=override(unstruct_hook=finite_seconds),
        reward=override(unstruct_hook=_reward),
        verified=override(unstruct_hook=bool),
        passed=override(unstruct_hook=bool),
        verifiers=override(unstruct_hook=_unstructure_verifiers),
        audit=override(unstruct_hook=_unstructure_audit),
    )
    conv.register_unstructure_hook(
        Metadata, lambda meta: unstructure_metadata(_unverified_if_no_reward(meta, meta.reward)))
    structure_metadata = make_dict_structure_fn(
        Metadata, conv,
        row=override(struct_hook=_structure_row),
        sampling=override(struct_hook=_structure_row),
        invalid_tool_calls=override(struct_hook=_structure_invalid_calls),
        duration_s=override(struct_hook=_seconds),
        sample_index=override(struct_hook=_sample_index),
        branch_of=override(struct_hook=_text_or_empty),
        branch_turn=override(struct_hook=_sample_index),
        reward=override(struct_hook=_reward),
        verified=override(struct_hook=_flag),
        passed=override(struct_hook=_flag),
        verifiers=override(struct_hook=_structure_verifiers),
        audit=override(struct_hook=_structure_audit),
    )
    conv.register_structure_hook(
        Metadata, lambda data, cls: _unverified_if_no_reward(structure_metadata(data, cls), data.get("reward")))
    # a sample's token ids go to the side file (--logprobs), never into its record
    conv.register_unstructure_hook(Trajectory, make_dict_unstructure_fn(Trajectory, conv, tokens=override(omit=True)))
    conv.register_structure_hook(Trajectory, make_dict_structure_fn(Trajectory, conv, tokens=override(omit=True)))
    # a session's duration and cost, as an older version may have written them (Infinity, NaN)
    conv.register_unstructure_hook(
        SessionInfo,
        make_dict_unstructure_fn(SessionInfo, conv, duration_s=override(unstruct_hook=finite_seconds),
                                 cost=override(unstruct_hook=_session_cost)),
    )
    conv.register_structure_hook(
        SessionInfo,
        make_dict_structure_fn(SessionInfo, conv, duration_s=override(struct_hook=_seconds),
                               cost=override(struct_hook=_session_cost)),
    )
    # the free JSON of records written before schema 2 (tool-call arguments, metadata.row)
    conv.register_structure_hook(Any, lambda v, _: v)
    return conv


record_converter = _make_record_converter()


def _strict_bool(value, _type):
    if isinstance(value, bool):
        return value
    raise TypeError(f"expected a bool (true or false), got {value!r}")


def _make_config_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(bool, _strict_bool)

    def strict_scalar(kind):
        def hook(value, _type):
            if isinstance(value, bool) or not isinstance(value, kind):
                raise TypeError(f"expected {_type.__name__}, got {value!r}")
            return _type(value)

        return hook

    def finite_float(value, _type):
        value = strict_scalar((int, float))(value, _type)
        if not math.isfinite(value):
            raise TypeError(f"expected a finite number, got {value!r}")
        return value

    conv.register_structure_hook(int, strict_scalar(int))
    conv.register_structure_hook(float, finite_float)
    def text(value, _type):  # a whole number given on a command line (-S user=1000) is its digits
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return strict_scalar(str)(value, _type)

    conv.register_structure_hook(str, text)
    conv.register_structure_hook(Optional[str], lambda value, _type: None if value is None else text(value, str))
    return conv


config_converter = _make_config_converter()


def to_json_line(record: Any) -> str:
    """One record as one JSON line (with the trailing newline), always encodable as UTF-8.

    A lone surrogate that reached the record some way (a plugin's text, a file name) becomes U+FFFD.
    """
    line = finite_dumps(record_converter.unstructure(record), ensure_ascii=False, separators=(",", ":")) + "\n"
    return line if line.isascii() else scrub_text(line)


def from_json(data: Any, cls: type[T]) -> T:
    """Structure decoded JSON into a record class (lenient)."""
    return record_converter.structure(data, cls)


def trajectory_to_dict(trajectory: Trajectory) -> dict:
    """The trajectory as the JSON object of its line in trajectories.jsonl (a writer of another format starts here)."""
    return record_converter.unstructure(trajectory)


def trajectory_from_dict(data: dict) -> Trajectory:
    """The Trajectory of a decoded line of trajectories.jsonl or batch_N.jsonl."""
    return from_json(data, Trajectory)


def _format_exception(exc: BaseException, type_) -> str:
    # A validator's ValueError (raised by the class itself, so no type) is a sentence meant for the user.
    if isinstance(exc, ValueError) and type_ is None and str(exc):
        # attrs' own validators (in_, ...) raise ValueError(message, attribute, ...): the message alone
        return exc.args[0] if len(exc.args) > 1 and isinstance(exc.args[0], str) else str(exc)
    return format_exception(exc, type_)


def describe_structure_error(exc: BaseException, path: str = "$") -> str:
    """A short message for a cattrs error: ``$.field: reason``."""
    if isinstance(exc, (cattrs.ClassValidationError, cattrs.IterableValidationError)):
        messages = cattrs.transform_error(exc, path=path, format_exception=_format_exception)
        return "; ".join(m.removesuffix(" @ ") for m in messages)
    return f"{path}: {exc}"


def structure_config(data: dict, cls: type[T], what: str) -> T:
    """Structure options strictly into an attrs Config class; a ConfigError names the bad key."""
    try:
        return config_converter.structure(data, cls)
    except Exception as exc:  # cattrs raises several exception types
        raise ConfigError(f"Invalid {what}: {describe_structure_error(exc, path='')}.") from exc


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def parse_key_values(items: tuple[str, ...], option: str) -> dict:
    """``("a=1", "b=x")`` -> ``{"a": 1, "b": "x"}``; values are JSON when they parse as JSON."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{option} expects KEY=VALUE, got {item!r}.")
        key = key.strip()
        try:
            value = json.loads(raw, parse_constant=_refuse_constant)
        except ValueError:
            value = raw  # NaN and Infinity stay text, so a number option refuses them
        except RecursionError:  # nested beyond what the decoder takes
            value = _TOO_DEEP
        if isinstance(value, float) and not math.isfinite(value):
            value = raw  # 1e999
        # the options go into run.json and plugins' configs: the same limits as a dataset row
        if has_lone_surrogate(key):
            raise ConfigError(f"The key {scrub_text(key)!r} of {option} holds bytes that are not UTF-8; pass it as UTF-8.")
        if value is _TOO_DEEP:
            problem = f"$: is nested more than {MAX_DEPTH} levels deep; flatten the field"
        else:
            problem = value_problem(value, int_range=False)
        if problem is not None:
            raise ConfigError(f"The value of {option} {key} {problem.partition(': ')[2]}.")
        out[key] = value
    return out


_TOO_DEEP = object()
