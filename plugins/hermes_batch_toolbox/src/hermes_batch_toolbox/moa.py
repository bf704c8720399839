"""The ``moa`` toolset: ``mixture_of_agents(user_prompt)``.

Reference models answer the prompt in parallel; an aggregator model then
writes one answer from theirs.  Every call goes through the run's endpoint and
limiter (``ModelClient.for_model``), so the calls share the run's rate limits,
their cost counts against ``--max_cost``, and their tokens and cost are added
to the prompt's usage.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import attrs

from hermes_batch import (
    HermesBatchError,
    Message,
    ModelCallError,
    ModelClient,
    PromptFailure,
    Tool,
    ToolContext,
    ToolsetRuntime,
)

AGGREGATOR_PROMPT = (
    "You have been given answers from several models to the user's latest request. Write one answer of "
    "the highest quality from them: weigh them critically, since some may be wrong or biased; do not just "
    "copy one; make it accurate, complete and well structured.\n\nThe models' answers:\n\n{answers}"
)
DEFAULT_REFERENCES = 3  # answers from the run's model when -T moa.models is not given


def _models(value: Any) -> tuple:
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"models must be model names, comma-separated or a JSON list, got {value!r}")
    return tuple(value)


def _at_least_one(_instance, attribute, value) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value!r}")


@attrs.frozen
class MoaConfig:
    """Options of the moa toolset (``-T moa.KEY=VALUE``)."""

    models: Any = attrs.field(default=(), converter=_models)  # reference models; default: the run's --model, 3 times
    aggregator: Optional[str] = None  # the model that combines the answers; default: the run's --model
    min_successful: int = attrs.field(default=1, validator=_at_least_one)  # reference answers needed to aggregate


class MoaRuntime(ToolsetRuntime):
    """Clients of the run's endpoint for the reference and aggregator models."""

    def __init__(self, config: MoaConfig, model):
        super().__init__(config, model)
        self.references = config.models or (model.model,) * DEFAULT_REFERENCES
        self.aggregator = config.aggregator or model.model
        self._clients: dict[str, ModelClient] = {}

    def client_for(self, model: str) -> ModelClient:
        if model == self.model.model:
            return self.client
        if model not in self._clients:
            self._clients[model] = self.client.for_model(model)
        return self._clients[model]

    async def shutdown(self) -> None:
        for client in self._clients.values():
            try:
                await client.aclose()
            except Exception:
                pass


async def _ask(runtime: MoaRuntime, ctx: ToolContext, model: str, messages: tuple) -> str:
    response = await runtime.client_for(model).complete(messages, ())
    ctx.report_usage(response.usage, journaled=True)  # a request of the run's client: journaled already
    text = (response.message.content or "").strip()  # the client took reasoning out; it is never an answer here
    if not text:
        raise ModelCallError(f"{model} answered with no text" + (" (reasoning only)" if response.message.reasoning else ""))
    return text


class MixtureOfAgentsTool(Tool):
    name = "mixture_of_agents"
    description = (
        "Route a hard problem through several language models collaboratively: reference models answer in "
        "parallel, then an aggregator writes the best answer from theirs. Makes several model calls, so use it "
        "for genuinely difficult problems: complex math, algorithms, multi-step analysis."
    )
    parameters = {
        "type": "object",
        "properties": {
            "user_prompt": {
                "type": "string",
                "description": "The complex query or problem to solve with several models. Give the full problem.",
            }
        },
        "required": ["user_prompt"],
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        runtime: MoaRuntime = ctx.session("moa").runtime
        prompt = arguments["user_prompt"].strip()
        if not prompt:
            return {"success": False, "error": "The user_prompt is empty."}
        question = (Message("user", prompt),)
        outcomes = await asyncio.gather(
            *(_ask(runtime, ctx, model, question) for model in runtime.references), return_exceptions=True
        )
        answers, failed = [], []
        for model, outcome in zip(runtime.references, outcomes):
            if isinstance(outcome, (ModelCallError, PromptFailure, HermesBatchError)):
                failed.append({"model": model, "error": str(outcome)})
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                answers.append(outcome)
        used = {"reference_models": list(runtime.references), "aggregator_model": runtime.aggregator}
        if len(answers) < runtime.config.min_successful:
            return {"success": False, "error": f"Only {len(answers)} reference model(s) answered.",
                    "models_used": used, "failed_models": failed}
        numbered = "\n\n".join(f"{i}. {answer}" for i, answer in enumerate(answers, start=1))
        messages = (Message("system", AGGREGATOR_PROMPT.format(answers=numbered)), Message("user", prompt))
        try:
            final = await _ask(runtime, ctx, runtime.aggregator, messages)
        except (ModelCallError, PromptFailure, HermesBatchError) as exc:
            return {"success": False, "error": f"The aggregator {runtime.aggregator} failed: {exc}",
                    "models_used": used, "failed_models": failed}
        result = {"success": True, "response": final, "models_used": used}
        if failed:
            result["failed_models"] = failed
        return result


MOA_TOOLS = (MixtureOfAgentsTool,)
