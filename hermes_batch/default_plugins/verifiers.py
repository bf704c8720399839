"""The built-in verifiers: command (tests run in the sample's sandbox), answer (the final answer), judge (a model)."""

from __future__ import annotations

import os
import re
import secrets
from typing import Any, Optional

import attrs

import hermes_batch
from hermes_batch.contract.interfaces import Verdict, Verifier, VerifierContext
from hermes_batch.formats.records import Message, TestsRun
from hermes_batch.sandbox_blocks.grading import checked_files

from hermes_batch.formats.reward_numbers import RewardTextError, parse_reward

from .judge_verdict import Fence, read_verdict
from .regex_worker import RegexError, RegexWorkers

REWARD_MAX_BYTES = 256
# In the agent's own context (command:apart=false) the tests' files and reward go into the working folder.
IN_CONTEXT_PREFIX = ".hermes-batch-tests-"


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


def reward_from_file(data: bytes, harbor: bool = False) -> float:
    """The reward a tests' reward file states (formats/reward_numbers.py: a plain decimal from 0 to 1, blanks around
    it allowed); ValueError saying why for anything else, or for more than REWARD_MAX_BYTES bytes.

    ``harbor``: a Harbor task's reward.json is allowed too (an object whose ``reward``, or only value, is that
    number)."""
    if len(data) > REWARD_MAX_BYTES:
        raise ValueError(f"the reward file holds more than {REWARD_MAX_BYTES} bytes")
    if harbor and data.lstrip().startswith(b"{"):
        return _harbor_json_reward(data)
    try:
        return parse_reward(data)
    except RewardTextError as exc:
        raise ValueError(f"the reward file holds {exc}") from None


def _harbor_json_reward(data: bytes) -> float:
    import json

    from hermes_batch.formats.reward_numbers import checked_reward

    try:
        value = json.loads(data.decode("utf-8"), parse_constant=lambda name: None)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError("the reward.json holds no valid JSON") from None
    if not isinstance(value, dict) or not value:
        raise ValueError("the reward.json holds no object of rewards")
    reward = value.get("reward", next(iter(value.values())) if len(value) == 1 else None)
    if type(reward) not in (int, float):
        raise ValueError("the reward.json names no number as `reward` (nor holds only one value)")
    return checked_reward(float(reward))


class CommandVerifier(Verifier):
    """Run the row's tests apart from the agent: a status other than 0 fails, else the reward file or 1.0."""

    @attrs.frozen
    class Config:
        run: str = ""  # the command; "" takes the row's `tests` field
        timeout: float = attrs.field(default=300.0, validator=_positive)  # seconds, the command's own limit
        max_output_chars: int = attrs.field(default=4000, validator=_positive)  # of its output kept in the record
        files_field: str = "test_files"  # the row's field {path: content} written into $HERMES_TESTS_DIR first
        apart: bool = True  # false: the tests run in the agent's own context, where what it left can forge the reward
        clean: bool = False  # also grade in a fresh sandbox holding only the final working folder: its verdict counts

    name = "command"
    description = ("Run the row's tests (`tests`, or command:run=...) in the sample's sandbox after its session, apart "
                   "from what the agent left: a status other than 0 gives 0.0, else the number written to "
                   "$HERMES_REWARD_FILE (0 to 1), else 1.0.")

    @property
    def timeout(self) -> float:
        # command:clean=true grades twice, the second time in a sandbox it opens
        return self.config.timeout * 2 + 60 if self.config.clean else self.config.timeout

    def _tests_timeout(self, row) -> float:
        """The row's `tests_timeout` (a Harbor task's [verifier].timeout_sec), else command:timeout."""
        value = (getattr(row, "extra", None) or {}).get("tests_timeout")
        if type(value) in (int, float) and 0 < value < 1e7:
            return float(value)
        return self.config.timeout

    def timeout_for(self, row) -> float:
        """The whole verification's limit for this row (session/verification.py)."""
        timeout = self._tests_timeout(row)
        return timeout * 2 + 60 if self.config.clean else timeout

    def check_backend(self, backend) -> None:
        """Before any prompt: refuse a sandbox backend that cannot run tests apart from the agent, or, with
        ``clean``, cannot copy a working folder into a fresh sandbox."""
        from hermes_batch.errors import UsageError

        if self.config.clean and not self.config.apart:
            raise UsageError("--verifier command:clean=true grades apart from the agent; drop apart=false.")
        if self.config.clean and not getattr(backend, "copies_workdirs", False):
            raise UsageError(f"--verifier command:clean=true needs a sandbox backend that copies a working folder "
                             f"into a fresh sandbox, which the {backend.name} sandbox cannot here; use the local one "
                             "or docker's -S reuse=none.")
        why = getattr(backend, "tests_apart_missing", "")
        if self.config.apart and why:
            raise UsageError(
                f"--verifier command cannot keep the tests apart from what the agent leaves with the {backend.name} "
                f"sandbox ({why}), so an agent could write its own reward; use a sandbox that can (the local one "
                "with its compiled helper, docker, singularity, modal), or --verifier command:apart=false to grade "
                "in the agent's context anyway.")

    async def verify(self, ctx: VerifierContext) -> Verdict:
        command = self.config.run or _row_field(ctx, "tests")
        if not isinstance(command, str) or not command.strip():
            raise ValueError("no command: the row has no `tests` field (text) and --verifier command:run=... was not given")
        if "\0" in command:
            raise ValueError("the tests' command holds a NUL character")
        files = checked_files(_row_field(ctx, self.config.files_field), self.config.files_field)
        timeout = self._tests_timeout(ctx.row)
        harbor = isinstance(_row_field(ctx, "task"), str)  # a Harbor task's row: its reward.json counts too
        if not self.config.apart:
            run = await _in_agent_context(ctx.sandbox, command, files, timeout)
            return self._verdict(run, " (in the agent's context: command:apart=false)", timeout, harbor)
        run = await ctx.sandbox.run_tests(command, files, timeout)
        if not self.config.clean:
            return self._verdict(run, "", timeout, harbor)
        try:
            in_place = self._verdict(run, "", timeout, harbor)
        except (TimeoutError, ValueError) as exc:
            in_place = exc
        clean = self._verdict(await self._in_a_fresh_sandbox(ctx, command, files, timeout), "", timeout, harbor)
        if isinstance(in_place, Exception):
            said, disagree = f"{type(in_place).__name__}: {in_place}", True
        else:
            said, disagree = in_place.reason, in_place.reward != clean.reward
        return Verdict(clean.reward, f"clean: {clean.reason}; in place: {said}{'; they disagree' if disagree else ''}",
                       _bounded(f"{clean.output}\n[in place]\n{run.result.output}", self.config.max_output_chars),
                       disagree)

    def _verdict(self, run: TestsRun, where: str = "", timeout: Optional[float] = None, harbor: bool = False) -> Verdict:
        result = run.result
        output = _bounded(result.output, self.config.max_output_chars)
        if result.timed_out or result.exit_code is None:
            raise TimeoutError(f"the command ran past its {timeout or self.config.timeout:g} s (command:timeout=...)")
        if result.exit_code != 0:  # a failure, whatever a reward file says
            left = "; the reward file it wrote does not count" if run.reward is not None else ""
            return Verdict(0.0, f"exit status {result.exit_code}{left}{where}", output)
        if run.problem:
            raise ValueError(run.problem)
        if run.reward is not None:
            return Verdict(reward_from_file(run.reward, harbor), f"reward file, exit status 0{where}", output)
        return Verdict(1.0, f"exit status 0{where}", output)

    async def _in_a_fresh_sandbox(self, ctx: VerifierContext, command: str, files: tuple, timeout: float) -> TestsRun:
        """command:clean=true: the tests in a fresh sandbox of the sample's image holding only its final working folder."""
        if ctx.fresh_sandbox is None:
            raise ValueError("command:clean=true needs a fresh sandbox, which this run cannot open")
        fresh = await ctx.fresh_sandbox()
        try:
            await ctx.sandbox.copy_workdir_to(fresh)
            return await fresh.run_tests(command, files, timeout)
        finally:
            await fresh.close()


async def _in_agent_context(sandbox, command: str, files: tuple, timeout: float) -> TestsRun:
    """command:apart=false: the tests as the agent, in its working folder (what it left can change the result)."""
    folder = IN_CONTEXT_PREFIX + secrets.token_hex(8)
    for path, content in files:
        await sandbox.write_file(f"{folder}/{path}", content.encode("utf-8", "surrogatepass"))
    reward_file = f"{folder}/reward"
    script = (f"HERMES_TESTS_DIR=\"$(pwd)/{folder}\"; HERMES_REWARD_FILE=\"$(pwd)/{reward_file}\"; "
              "HERMES_RUN_UNTRUSTED=env; export HERMES_TESTS_DIR HERMES_REWARD_FILE HERMES_RUN_UNTRUSTED; "
              f"mkdir -p \"$HERMES_TESTS_DIR\" && rm -f \"$HERMES_REWARD_FILE\" || exit 125\n{command}")
    result = await sandbox.exec(script, timeout)
    try:
        reward = await sandbox.read_file(reward_file, REWARD_MAX_BYTES + 1)
    except FileNotFoundError:
        reward = None
    except OSError as exc:
        return TestsRun(result, None, f"the reward file cannot be read ({exc})")
    return TestsRun(result, reward)


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

