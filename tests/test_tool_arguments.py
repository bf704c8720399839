"""Tool arguments: validated by a full JSON Schema implementation, and tools written as typed functions."""

from typing import Literal, Optional

import pytest

import hermes_batch
from hermes_batch import Tool, ToolContext
from hermes_batch.formats.schema import check_schema, validate

RICH = {
    "type": "object",
    "properties": {
        "mode": {"anyOf": [{"const": "fast"}, {"type": "integer", "minimum": 1}]},
        "name": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8},
        "point": {"$ref": "#/$defs/point"},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    },
    "required": ["name"],
    "additionalProperties": False,
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
}


@pytest.mark.parametrize(
    "value, problem",
    [
        ({"name": "abc", "mode": "fast", "point": {"x": 1.5}, "tags": ["a", "b"]}, None),
        ({"name": "abc", "mode": 0}, "$.mode: 0 is less than the minimum of 1"),  # the closest branch of anyOf
        ({"name": "ABC"}, "$.name: 'ABC' does not match '^[a-z]+$'"),
        ({"name": "abc", "point": {}}, "$.point.x: required"),
        ({"name": "abc", "point": {"x": "1"}}, "$.point.x: expected number, got str"),
        ({"name": "abc", "tags": ["a", "a"]}, "$.tags: ['a', 'a'] has non-unique elements"),
        ({"name": "abc", "colour": "red"}, "$.colour: unexpected argument"),
        ({}, "$.name: required"),
    ],
)
def test_keywords_the_old_subset_ignored_are_enforced(value, problem):
    assert validate(value, RICH) == problem


def test_a_reason_stays_one_short_line_whatever_the_model_sent():
    problem = validate({"name": "x\n" * 10_000}, RICH)
    assert "\n" not in problem and len(problem) <= 300


def test_integers_may_be_written_as_floats_but_not_as_booleans():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert validate({"n": 3.0}, schema) is None
    assert validate({"n": True}, schema) == "$.n: expected integer, got bool"


def test_check_schema_finds_broken_schemas():
    assert check_schema(RICH) is None
    assert "is not valid under any of the given schemas" in check_schema({"type": "strnig"})
    assert check_schema([]) == "expected a JSON object, got list"


# --- @hermes_batch.tool ---------------------------------------------------------------------------


def test_a_schema_is_checked_against_its_metaschema_once(monkeypatch):
    """Every registry checks every tool's schema: the same schema again (an equal copy too) is not checked again."""
    from hermes_batch.formats import schema as module

    checked = []
    real = module._check_schema
    monkeypatch.setattr(module, "_check_schema", lambda s: checked.append(s) or real(s))
    fresh = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 7}}, "required": ["n"]}
    broken = {"type": "object", "properties": {"n": {"type": "integr"}}}
    for _ in range(3):
        assert check_schema(dict(fresh)) is None
        assert "is not valid under any of the given schemas" in check_schema(dict(broken))
    assert len(checked) == 2
    assert check_schema({"type": "object", "required": ("n",)}) is not None  # not plain JSON: checked as it is


@hermes_batch.tool
async def lookup(query: str, limit: int = 5, exact: bool = False, fields: Optional[list[str]] = None,
                 order: Literal["asc", "desc"] = "asc") -> dict:
    """Look something up in the catalogue.

    A second paragraph the model does not need.

    Args:
        query: What to look for.
        limit: Most results to return; the catalogue
            never returns more than 50.
        exact: Whole words only.
        fields: Which fields to return.
        order: Sort order.
    """
    return {"query": query, "limit": limit, "exact": exact, "fields": fields, "order": order}


def test_the_schema_comes_from_the_signature_and_the_docstring():
    assert issubclass(lookup, Tool) and lookup.__name__ == "LookupTool"
    spec = lookup.spec()
    assert spec.name == "lookup"
    assert spec.description == "Look something up in the catalogue."
    assert spec.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look for."},
            "limit": {"type": "integer", "default": 5,
                      "description": "Most results to return; the catalogue never returns more than 50."},
            "exact": {"type": "boolean", "default": False, "description": "Whole words only."},
            "fields": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
                       "default": None, "description": "Which fields to return."},
            "order": {"enum": ["asc", "desc"], "type": "string", "default": "asc", "description": "Sort order."},
        },
        "required": ["query"],
        "additionalProperties": False,
    }
    assert check_schema(spec.parameters) is None


async def test_a_function_tool_is_called_with_the_arguments():
    result = await lookup().call({"query": "tea", "limit": 2.0}, ToolContext(sandbox=None))
    assert result == {"query": "tea", "limit": 2, "exact": False, "fields": None, "order": "asc"}
    assert type(result["limit"]) is int


async def test_the_context_parameter_is_hidden_from_the_model_and_other_results_are_wrapped():
    @hermes_batch.tool(name="where", description="Where commands run.")
    async def workdir(ctx: ToolContext, suffix: str = "") -> str:
        return ctx.sandbox.workdir + suffix

    class Box:
        workdir = "/work"

    assert workdir.spec().parameters == {
        "type": "object", "properties": {"suffix": {"type": "string", "default": ""}}, "additionalProperties": False,
    }
    assert workdir.spec().name == "where" and workdir.spec().description == "Where commands run."
    assert await workdir().call({"suffix": "/x"}, ToolContext(sandbox=Box())) == {"result": "/work/x", "error": None}


def test_what_cannot_become_a_tool_is_refused_at_once():
    def generator(x: str):
        yield x

    async def untyped_object(x: object):
        pass

    async def star(*args: str):
        pass

    with pytest.raises(TypeError, match=r"must be a function \(def or async def\)"):
        hermes_batch.tool(generator)
    with pytest.raises(TypeError, match=r"untyped_object\(x\): the type <class 'object'> has no JSON Schema"):
        hermes_batch.tool(untyped_object)
    with pytest.raises(TypeError, match="must be named"):
        hermes_batch.tool(star)


async def test_a_plain_function_is_a_tool_run_in_the_thread_pool_it_is_given():
    import concurrent.futures
    import threading

    @hermes_batch.tool
    def add(a: int, b: int = 1) -> int:
        """Add two numbers."""
        assert threading.current_thread().name.startswith("given-pool")
        return a + b

    assert add.spec().parameters["required"] == ["a"] and add.spec().description == "Add two numbers."
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="given-pool") as pool:
        assert await add().call({"a": 2.0}, ToolContext(sandbox=None, thread_pool=pool)) == {"result": 3, "error": None}


def test_in_a_run_a_plain_function_runs_in_the_tool_pool_and_its_exception_is_the_models_tool_error(
        tmp_path, runner, model_server):
    import threading

    from hermes_batch import Distribution, Toolset
    from hermes_batch.testing import Reply, write_dataset

    @hermes_batch.tool
    def where() -> str:
        """Name the thread the tool runs in."""
        return threading.current_thread().name

    @hermes_batch.tool
    def fail() -> str:
        """Always raises."""
        raise ValueError("no such record")

    class Plugin:
        @hermes_batch.hookimpl
        def register_toolsets(self, register):
            register(Toolset("sync", "Plain functions.", (where, fail)))

        @hermes_batch.hookimpl
        def register_distributions(self, register):
            register(Distribution("sync-only", "Plain functions only.", (("sync", 1.0),)))

    seen = []

    def script(request):
        if request.turn == 0:
            return Reply(tool_calls=[("where", {}), ("fail", {})])
        seen.extend(request.tool_results)
        return Reply("Done.")

    runner.plugins = (Plugin(),)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "go"}])
    result = runner.invoke(dataset, "--distribution", "sync-only", "--no_filters", server=model_server(script))
    assert result.exit_code == 0, result.output
    assert "hermes-batch-tools" in seen[0]
    assert '"error": "ValueError: no such record"' in seen[1]
    [kept] = runner.records("trajectories.jsonl")
    assert kept["tool_error_counts"]["fail"] == 1
