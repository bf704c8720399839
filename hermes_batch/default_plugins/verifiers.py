"""The built-in verifiers: command (tests run in the sample's sandbox), answer (the final answer), judge (a model)."""

from __future__ import annotations

import math
import os
import re
from typing import Any, Optional

import attrs

import hermes_batch
from hermes_batch.contract.interfaces import Verdict, Verifier, VerifierContext
from hermes_batch.formats.records import Message

from .judge_verdict import Fence, read_verdict
from .regex_worker import RegexError, RegexWorkers

REWARD_FILE = ".hermes_batch_reward"  # in the sandbox's working directory; $HERMES_REWARD_FILE names it
REWARD_FILE_MAX_BYTES = 256


@hermes_batch.hookimpl
def register_verifiers(register):
    register(CommandVerifier)
    register(AnswerVerifier)
    register(JudgeVerifier)


def _positive(_instance, attribute, value):
    if not value > 0:
        raise ValueError(f"{attribute.name} must be more than 0, got {value!r}")


def _bounded(text: str, limit: int) -> str:
    """The first and last halves of ``text`` when it is longer than ``limit`` characters."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[len(text) - half:]}"


def _row_field(ctx: VerifierContext, field: str) -> Any:
    return (ctx.row.extra or {}).get(field)


class CommandVerifier(Verifier):
    """Run the row's tests in the sample's sandbox: exit status 0 passes, or the command writes the reward."""

    @attrs.frozen
    class Config:
        run: str = ""  # the command; "" takes the row's `tests` field
        timeout: float = attrs.field(default=300.0, validator=_positive)  # seconds, the command's own limit
        max_output_chars: int = attrs.field(default=4000, validator=_positive)  # of its output kept in the record
        files_field: str = "test_files"  # the row's field {path: content} written into the sandbox first

    name = "command"
    description = ("Run a command in the sample's sandbox after its session (the row's `tests`, or command:run=...): "
                   "exit status 0 gives reward 1.0, else 0.0, unless it writes a reward to $HERMES_REWARD_FILE.")

    async def verify(self, ctx: VerifierContext) -> Verdict:
        command = self.config.run or _row_field(ctx, "tests")
        if not isinstance(command, str) or not command.strip():
            raise ValueError("no command: the row has no `tests` field (text) and --verifier command:run=... was not given")
        files = _row_field(ctx, self.config.files_field) or {}
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise ValueError(f"the row's `{self.config.files_field}` must be an object of path -> file content (text)")
        for path, content in files.items():  # only now: the agent never saw them
            await ctx.sandbox.write_file(str(path), content.encode("utf-8"))
        # the agent may have left a reward file: it is removed before the tests can write theirs
        script = (f"rm -f {REWARD_FILE}; HERMES_REWARD_FILE=\"$(pwd)/{REWARD_FILE}\"; export HERMES_REWARD_FILE; "
                  f"{command}")
        result = await ctx.sandbox.exec(script, self.config.timeout)
        output = _bounded(result.output, self.config.max_output_chars)
        if result.timed_out or result.exit_code is None:
            raise TimeoutError(f"the command ran past its {self.config.timeout:g} s (command:timeout=...)")
        written = await self._reward_file(ctx)
        if written is not None:
            return Verdict(written, f"reward file ({REWARD_FILE}), exit status {result.exit_code}", output)
        reward = 1.0 if result.exit_code == 0 else 0.0
        return Verdict(reward, f"exit status {result.exit_code}", output)

    @staticmethod
    async def _reward_file(ctx: VerifierContext) -> Optional[float]:
        try:
            data = await ctx.sandbox.read_file(REWARD_FILE, REWARD_FILE_MAX_BYTES)
        except FileNotFoundError:
            return None
        text = data.decode("utf-8", "replace").strip()
        try:
            reward = float(text)
        except ValueError:
            raise ValueError(f"the reward file holds {text[:40]!r}, not a number") from None
        if not math.isfinite(reward):
            raise ValueError(f"the reward file holds {text!r}, not a finite number")
        return reward


_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


_LEAD_IN = re.compile(r"^(?:so,? |thus,? |therefore,? )?(?:the )?(?:final )?answer(?: is)?\s*[:=]?\s*")


def normalise(text: str) -> str:
    """Lower case, inner spaces collapsed, a lead-in ("the final answer is:") and surrounding quotes, `$`, `**`
    and a final period dropped."""
    text = " ".join(str(text).split()).lower()
    text = text.strip().strip("*").strip()
    text = _LEAD_IN.sub("", text).strip().strip("*").strip().strip("`\"'$").strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def _number(text: str) -> Optional[float]:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def answer_part(answer: str) -> str:
    """What the comparison looks at: a ``\\boxed{}`` answer's content, else the last non-empty line."""
    boxed = _BOXED.findall(answer)
    if boxed:
        return boxed[-1]
    lines = [line for line in answer.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class AnswerVerifier(Verifier):
    """Compare the sample's final answer with the row's `answer`: exact after normalisation, a number, or a regex."""

    @attrs.frozen
    class Config:
        mode: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "exact", "number", "regex")))
        tolerance: float = attrs.field(default=1e-6, validator=attrs.validators.ge(0))  # absolute, for numbers
        field: str = "answer"  # the row's field holding the expected answer
        timeout: float = attrs.field(default=10.0, validator=_positive)

    name = "answer"
    description = ("Compare the final answer (its \\boxed{} or last line) with the row's `answer`: exact after "
                   "normalisation, a number within answer:tolerance=..., or answer:mode=regex (matched in a child "
                   "process that answer:timeout=... stops).")

    _regex: Optional[RegexWorkers] = None  # the processes regex matches run in, started at the first

    async def shutdown(self) -> None:
        workers, self._regex = self._regex, None
        if workers is not None:
            await workers.aclose()

    async def verify(self, ctx: VerifierContext) -> Verdict:
        expected = _row_field(ctx, self.config.field)
        if expected is None or isinstance(expected, (dict, list)):
            raise ValueError(f"the row has no `{self.config.field}` field (text or number)")
        answer = ctx.trajectory.final_answer
        if answer is None:
            return Verdict(0.0, f"no final answer (the session ended: {ctx.trajectory.metadata.end_reason})")
        mode = self.config.mode
        if mode == "auto":
            mode = "number" if isinstance(expected, (int, float)) or _is_number(str(expected)) else "exact"
        if mode == "regex":  # in a child process: a pattern that backtracks for ever is killed at the timeout
            if self._regex is None:
                self._regex = RegexWorkers()
            try:
                match = await self._regex.search(str(expected), answer)
            except RegexError as exc:
                raise ValueError(f"the row's `{self.config.field}` pattern: {exc}") from None
            return Verdict(1.0 if match else 0.0, "matches the pattern" if match else "does not match the pattern")
        part = answer_part(answer)
        if mode == "number":
            if not _is_number(str(expected)):
                raise ValueError(f"the row's `{self.config.field}` {str(expected)[:60]!r} is not a number, so "
                                 "answer:mode=number cannot compare it; use answer:mode=auto for rows of text")
            want, got = float(str(expected).replace(",", "")), _number(part)
            if got is None:
                return Verdict(0.0, "no number in the answer")
            ok = abs(got - want) <= self.config.tolerance
            return Verdict(1.0 if ok else 0.0, f"{got:g} {'within' if ok else 'not within'} "
                                               f"{self.config.tolerance:g} of {want:g}")
        ok = normalise(part) == normalise(str(expected)) or normalise(answer) == normalise(str(expected))
        return Verdict(1.0 if ok else 0.0, "equal after normalisation" if ok else f"{normalise(part)[:60]!r} differs")


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True


class JudgeVerifier(Verifier):
    """A model grades the trajectory against the row's `rubric` (or judge:rubric=...), through the run's client
    or a client of its own (judge:client=..., judge:base_url=..., judge:api_key_env=...)."""

    @attrs.frozen
    class Config:
        rubric: str = ""  # "" takes the row's `rubric` field
        model: str = ""  # "" is the run's --model
        timeout: float = attrs.field(default=300.0, validator=_positive)
        max_transcript_chars: int = attrs.field(default=40000, validator=_positive)
        client: str = ""  # an installed model client (as --model_client); "": the run's, or the one base_url asks
        base_url: str = ""  # "": the run's --base_url
        api_key_env: str = ""  # the variable holding the judge's key (never the key: options go to run.json)
        # "tool": the grade comes through a function call (or the reply's last line); "text": no function is
        # offered (for endpoints that refuse tools), only the last line counts
        verdict: str = attrs.field(default="tool", validator=attrs.validators.in_(("tool", "text")))

    name = "judge"
    description = ("A model grades the transcript (quoted, so that nothing in it can pose as the verdict) against "
                   "the row's `rubric` (or judge:rubric=...) through a call of its grade function, or a last line "
                   "SCORE: 0..1; through the run's model client or judge:client=/base_url=/api_key_env=; its calls "
                   "are journaled and count in the cost.")

    _client = None  # the judge's own client, when it has one: built and checked at start

    @property
    def own_endpoint(self) -> bool:
        """True when the options ask for another client, endpoint or key than the run's."""
        cfg = self.config
        return bool(cfg.client or cfg.base_url or cfg.api_key_env)

    async def start(self, run, client, model_client) -> None:
        if not self.own_endpoint:
            return
        from hermes_batch.errors import FatalModelError, UsageError
        from hermes_batch.formats.redaction import display_url
        from hermes_batch.run.config import resolve_api_key

        cfg, ours = self.config, client.settings
        base_url = cfg.base_url or ours.base_url
        if cfg.api_key_env:
            api_key = os.environ.get(cfg.api_key_env)
            if not api_key:
                raise UsageError(f"The variable {cfg.api_key_env} named by --verifier judge:api_key_env is not set "
                                 "or empty; export the judge's key in it.")
        elif base_url == ours.base_url:
            api_key = ours.api_key  # the run's endpoint: the run's key
        else:  # never the run's key to another endpoint: the variable the client would read for a run there
            api_key = resolve_api_key(None, base_url, model_client=cfg.client or None)
        settings = attrs.evolve(
            ours, model=cfg.model or ours.model, base_url=base_url, api_key=api_key,
            providers_allowed=(), providers_ignored=(), providers_order=(), provider_sort=None,
            max_requests_per_minute=None, max_tokens_per_minute=None,  # the run's endpoint's budgets, not this one's
        )
        self._client = model_client(cfg.client, settings)
        try:
            await self._client.preflight()  # before any prompt: a judge that cannot answer would fail every sample
        except FatalModelError as exc:
            name = self._client.name
            await self.shutdown()
            cause = " ".join(str(exc.__cause__ or exc).split()).rstrip(".")
            raise UsageError(f"The judge's endpoint {display_url(base_url)} ({name} client) failed its check "
                             f"({cause}); fix --verifier judge:base_url, client or api_key_env.") from None

    async def shutdown(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def verify(self, ctx: VerifierContext) -> Verdict:
        rubric = self.config.rubric or _row_field(ctx, "rubric")
        if not isinstance(rubric, str) or not rubric.strip():
            raise ValueError("no rubric: the row has no `rubric` field and --verifier judge:rubric=... was not given")
        task = next((t.value for t in ctx.trajectory.conversations if t.from_ == "human"), "")
        transcript = "\n\n".join(f"[{t.from_}]\n{t.value}" for t in ctx.trajectory.conversations[2:])
        transcript = _bounded(transcript, self.config.max_transcript_chars)
        fence = Fence.around(task, transcript, rubric)
        verdict = self.config.verdict
        user = (f"## Task\n{fence.quote('TASK', task)}\n\n## Rubric\n{rubric}\n\n"
                f"## Transcript\n{fence.quote('TRANSCRIPT', transcript)}\n\n{fence.how(verdict)}")
        if self.own_endpoint:
            if self._client is None:
                raise RuntimeError("the judge's client was not started (Verifier.start)")
            client = self._client
        else:
            client = ctx.client.for_model(self.config.model) if self.config.model else ctx.client
        response = await attrs.evolve(ctx, client=client).complete(
            (Message("system", fence.system(verdict)), Message("user", user)),
            (fence.tool(),) if verdict == "tool" else ())
        score, reason = read_verdict(response, fence)
        return Verdict(score, _bounded(" ".join(reason.split()), 300), "")

