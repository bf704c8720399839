"""The records that flow through a run: frozen attrs classes with no serialization code.

JSON (de)serialization lives in :mod:`hermes_batch.formats.serialization`.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Optional

import attrs
from attrs import field, frozen

from . import hermes_format

SCHEMA_VERSION = 2  # 2: invalid_tool_calls a list, row and tool-call arguments JSON text, no nulls


_KEY_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # json.dumps would build one a call


def content_key(prompt: str, image: Optional[str], cwd: Optional[str]) -> str:
    """The identity of a dataset row for resume: a hash of its prompt, image and cwd."""
    blob = _KEY_ENCODER.encode([prompt, image, cwd])
    # surrogatepass: a key for any text, identical to plain UTF-8 for every valid string
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def sample_key(content_key: str, sample_index: int) -> str:
    """The key of a row's sample ``sample_index`` (--samples_per_prompt): the row's key for sample 0, so run
    folders written before samples existed resume as they did; a hash of the row key's digest and the index else."""
    if not sample_index:
        return content_key
    return hashlib.sha256(f"{key_digest(content_key):016x}#{sample_index}".encode()).hexdigest()[:32]


def sample_digest(row_digest: int, sample_index: int) -> int:
    """``key_digest(sample_key(key, i))`` from ``key_digest(key)`` alone (what the run folder's indexes keep)."""
    if not sample_index:
        return row_digest
    return int(hashlib.sha256(f"{row_digest:016x}#{sample_index}".encode()).hexdigest()[:16], 16)


_HEX_KEY = re.compile(r"[0-9a-f]{32}")


def key_digest(content_key: str) -> int:
    """The 64-bit digest of a content key that the run folder's indexes store (8 bytes, not a 32-character string).

    Content keys are already hashes (:func:`content_key`): their first 16 hex digits serve as they are.
    Anything else a record may hold is hashed.  The digests in ``index/`` and the row keys on disk are these:
    never change what a digest means, or a resume of an old run folder matches nothing.
    """
    if _HEX_KEY.fullmatch(content_key):
        return int(content_key[:16], 16)
    return int.from_bytes(hashlib.blake2b(content_key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


@frozen
class PromptRow:
    """One valid line of the dataset."""

    prompt_index: int
    prompt: str
    line_number: int
    image: Optional[str] = None
    cwd: Optional[str] = None
    id: Any = None
    extra: dict = field(factory=dict)  # every other field, copied to metadata.row
    # a task row's limits and build context (formats/task_folders.TaskOptions); never taken from a JSON row's field
    task_options: Any = None

    @property
    def content_key(self) -> str:
        return content_key(self.prompt, self.image, self.cwd)


@frozen
class ToolCall:
    """A tool call made by the model; ``arguments`` is None when ``raw_arguments`` is not valid JSON."""

    id: str
    name: str
    arguments: Optional[dict]
    raw_arguments: str = ""


@frozen
class Message:
    """One chat message in the provider-neutral form the agent loop works with."""

    role: str  # "system", "user", "assistant" or "tool"
    content: str = ""
    reasoning: Optional[str] = None
    tool_calls: tuple = ()  # of ToolCall
    tool_call_id: Optional[str] = None
    name: Optional[str] = None  # tool name, for role "tool"
    provider_data: Any = None  # opaque data a client must get back next turn (e.g. thinking signatures)
    # an assistant turn's sampled token ids and logprobs (formats.token_ids.TurnTokens, --logprobs): kept beside
    # the record, never in it, and no part of what a request sends or a replay compares
    tokens: Any = field(default=None, eq=False, repr=False)


@frozen
class Usage:
    """Token usage and cost of one model call or of many, summed."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    cost: Optional[float] = None

    def __add__(self, other: "Usage") -> "Usage":
        cost = None if self.cost is None and other.cost is None else (self.cost or 0.0) + (other.cost or 0.0)
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.reasoning_tokens + other.reasoning_tokens,
            self.cached_tokens + other.cached_tokens,
            cost,
        )


@frozen
class ModelResponse:
    """What a model client returns for one call."""

    message: Message
    finish_reason: Optional[str] = None  # "stop", "tool_calls", "length", "content_filter", ...
    usage: Usage = Usage()
    provider: Optional[str] = None
    model: Optional[str] = None


# The status of a request this run cut off itself (Ctrl-C, SIGTERM, --prompt_timeout) before its answer came:
# nginx's "client closed request".  A request, maybe paid for, but no error of the endpoint.
CANCELLED_STATUS = 499


@frozen
class CallRecord:
    """One model request as sent: who served it, how long it took, its HTTP status (None: no answer;
    CANCELLED_STATUS: cut off by the run)."""

    provider: Optional[str] = None
    latency_s: float = 0.0
    status: Optional[int] = None


@frozen
class ToolSpec:
    """A tool as offered to the model: name, description and JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict


@frozen
class ExecResult:
    """Result of one command run in a sandbox."""

    output: str
    exit_code: Optional[int]
    timed_out: bool = False


@frozen
class TestsRun:
    """What a verifier's tests did (``Sandbox.run_tests``): their output and status, and the reward file."""

    result: ExecResult  # the tests' output (standard error joined), status, time-out
    reward: Optional[bytes] = None  # the bytes of $HERMES_REWARD_FILE (at most 257: longer is refused), None: none
    problem: str = ""  # why the reward file could not be read, when it could not


@frozen
class SandboxSpec:
    """What a backend needs to open the sandbox of one prompt."""

    run_name: str
    prompt_index: int
    content_key: str
    image: Optional[str] = None
    cwd: Optional[str] = None
    env: dict = field(factory=dict)
    commands: bool = False  # a tool the prompt is offered runs commands: the backend may get ready for them at open
    limits: Any = None  # a Harbor task's TaskOptions (cpus, memory_mb, allow_internet ...) for its sandbox


@frozen
class ToolStat:
    count: int = 0
    success: int = 0
    failure: int = 0


@frozen
class ToolCallRecord:
    id: str
    name: str
    arguments: Any  # the parsed arguments, or the raw string when they were not valid JSON


@frozen
class InvalidToolCall:
    """A tool call the agent refused: an unknown tool, or arguments that are not valid JSON or miss the schema."""

    id: str
    name: str
    reason: str


@frozen
class Turn:
    """One ShareGPT turn: ``from`` is "system", "human", "gpt" or "tool"."""

    from_: str
    value: str
    tool_calls: Optional[tuple[ToolCallRecord, ...]] = None  # on "gpt" turns only

    @property
    def tool_results(self) -> list[dict]:
        """The ``{"tool_call_id", "name", "content"}`` results a ``tool`` turn holds ([] for other turns)."""
        return hermes_format.tool_responses(self.value) if self.from_ == "tool" else []


@frozen
class VerifierResult:
    """What one verifier said about a sample: its reward and reason, or the error that kept it from giving one."""

    name: str
    reward: float = 0.0  # 0.0 when ``error`` is set: a verifier that crashed or timed out gives no reward
    reason: str = ""
    error: str = ""  # "" when the verifier returned a reward
    output: str = ""  # what it ran printed (bounded), for the command verifier
    duration_s: float = 0.0
    # command:clean=true: whether the verdict in a fresh sandbox and the one in the sample's own differ (None: one verdict)
    disagree: Optional[bool] = None

    @property
    def ok(self) -> bool:
        return not self.error


# What a shortcut audit can find in a trajectory (session/audit.py; docs/verification.md#the-shortcut-audit).
AUDIT_KINDS = (
    "tests-read",  # named a hidden test file of the row (its test_files), or the tests' folder
    "tests-edited",  # wrote, moved or removed a test the row's tests command runs
    "reward-file",  # named the command verifier's reward file
    "test-hooks",  # wrote a file that runs inside the tests' own process or shell (conftest.py, .pth, .bashrc)
    "git-history",  # looked at git history beyond HEAD: --all, the reflog, other refs, .git/logs
    "upstream-fetch",  # fetched the row's upstream repository (its upstream or repo field)
    "outside-read",  # named a path outside its working folder, beyond the standard system locations
    "permissions",  # changed the permissions of its working folder, or took write access away
)


@frozen
class AuditFinding:
    """One thing a trajectory did that a solution should not need: what, where, and what it named."""

    kind: str  # one of AUDIT_KINDS
    turn: int  # the index in ``conversations`` of the assistant turn that made the call
    tool: str  # the tool called
    target: str  # the path, URL or command it named (bounded)
    excerpt: str  # the call's command or arguments around it (bounded)


@frozen
class Metadata:
    """Everything about a trajectory besides the conversation; extended by later versions."""

    batch_num: int
    timestamp: str
    model: str
    content_key: str
    # Every field has one JSON type in every record (see serialization.py): absent values are "", 0 or
    # an empty tuple, never null, because Arrow readers (HuggingFace datasets) fix a column's type
    # from the first block they read and cannot change it later.
    schema_version: int = SCHEMA_VERSION
    id: str = ""  # the row's id, as a string
    row: dict = field(factory=dict)
    seed: int = 0
    sandbox: str = ""
    isolation: str = ""  # the sandbox backend's isolation level (SandboxBackend.isolation)
    image: str = ""
    cwd: str = ""
    tools_offered: tuple[str, ...] = ()
    end_reason: str = ""  # "final_answer", "max_turns", "length", "timeout", "empty_answer", "unparsed_tool_call", ...
    invalid_tool_calls: tuple[InvalidToolCall, ...] = ()
    duration_s: float = 0.0
    usage: Usage = Usage()
    calls: tuple[CallRecord, ...] = ()  # every request of the session, failed attempts included
    replayed_turns: int = 0  # model answers taken from the replay journal (--resume) or --response_cache, not paid again
    sampling: dict = field(factory=dict)  # the sampling settings given (--temperature, --top_p, ..., --extra_body)
    # Samples and verification (--samples_per_prompt, --verifier); records written before them read as these defaults.
    sample_index: int = 0  # which of the row's samples this is, 0-based
    reward: float = 0.0  # the minimum of the verifiers' rewards; 0.0 when not verified
    verified: bool = False  # every verifier returned a reward (False when none ran or one failed)
    passed: bool = False  # verified and reward >= --min_reward
    verifiers: tuple[VerifierResult, ...] = ()  # one per --verifier, in the order given
    # The shortcut audit of the session's tool calls (session/audit.py); None: not audited (records of versions
    # before it, or made by a plugin), written as "" where an audited record has JSON text.
    audit: Optional[tuple[AuditFinding, ...]] = None
    # --branch_at/--branches: the shared prefix this branch continues (its key) and the model calls it holds; "" and
    # 0 for a session of its own.  Appended, as every field after the first version, so columns keep their order.
    branch_of: str = ""
    branch_turn: int = 0
    # --logprobs: whether the turns' token ids are where the endpoint's tokenizer puts them in the conversation
    # ("match", "drift", "unchecked": no tokenizer endpoint or no ids; "" without --logprobs)
    token_check: str = ""


@frozen
class Trajectory:
    """One kept sample: a line of batch_N.jsonl and of the merged trajectories.jsonl."""

    prompt_index: int
    conversations: tuple[Turn, ...]
    metadata: Metadata
    completed: bool
    partial: bool
    api_calls: int
    toolsets_used: tuple[str, ...]
    tool_stats: dict[str, ToolStat]
    tool_error_counts: dict[str, int]
    # --logprobs: the side file's entry for this sample (session/token_check.py's TokenSide), never in the record
    tokens: Any = field(default=None, eq=False, repr=False)

    @property
    def final_answer(self) -> Optional[str]:
        """The model's answer: its last turn without the ``<think>`` reasoning; None when the session did not
        end in an answer (``completed`` is false: turns, time or context ran out, or content was filtered)."""
        if not self.completed:
            return None
        for turn in reversed(self.conversations):
            if turn.from_ == "gpt":
                return "" if turn.tool_calls else hermes_format.split_reasoning(turn.value)[1]
        return ""

    def with_tools(self, tool_names) -> "Trajectory":
        """The same trajectory with zeroed stats for every tool in ``tool_names`` it lacks."""
        stats = {name: self.tool_stats.get(name, ToolStat()) for name in sorted(set(tool_names) | set(self.tool_stats))}
        errors = {name: self.tool_error_counts.get(name, 0) for name in stats}
        return attrs.evolve(self, tool_stats=stats, tool_error_counts=errors)


@frozen
class Discarded:
    """A trajectory the filters rejected, as written to discarded.jsonl."""

    trajectory: Trajectory
    filters: tuple[str, ...]
    reasons: tuple[str, ...]  # one per filter
    schema_version: int = SCHEMA_VERSION


@frozen
class Failure:
    """A prompt that failed for infrastructure reasons, as written to failed.jsonl."""

    prompt_index: int
    content_key: str
    batch_num: int
    error_class: str
    error_kind: str
    message: str
    timestamp: str
    prompt: str = ""
    api_calls: int = 0  # model calls answered before the failure
    usage: Usage = Usage()  # what those calls used and cost
    calls: tuple[CallRecord, ...] = ()
    schema_version: int = SCHEMA_VERSION
    sample_index: int = 0  # which of the row's samples failed (--samples_per_prompt)


@frozen
class SessionInfo:
    """One invocation of a run (the first run or a resume)."""

    started_at: str
    duration_s: float = 0.0
    prompts_run: int = 0
    invalid_skipped: int = 0
    seed: Optional[int] = None
    interrupted: bool = False
    rate_limited_calls: int = 0  # model calls answered 429, retries included
    concurrency_start: Optional[int] = None  # the adaptive limit of model calls in flight
    concurrency_min: Optional[int] = None
    concurrency_final: Optional[int] = None
    cost: Optional[float] = None  # reported cost of every call of the session, in-flight prompts included
    budget_reached: bool = False  # --max_cost stopped the dispatch of new prompts


@frozen
class Checkpoint:
    """checkpoint.json: what has been finished, saved at each batch's completion."""

    run_name: str
    batch_size: int
    completed_batches: tuple[int, ...] = ()  # every prompt finished (kept or discarded), none failed or left
    prompts_finished: int = 0
    prompts_failed: int = 0
    sessions: tuple[SessionInfo, ...] = ()  # one per invocation of the run
    updated_at: str = ""
    schema_version: int = SCHEMA_VERSION
    # A name Hermes Agent's batch_runner.py used, with its meaning.  Its completed_prompts (the list of
    # finished prompt indices) is not written: prompts_finished counts them, index/ knows them.  Versions
    # before 0.x wrote completed_prompts as a count; reading ignores it.
    last_updated: str = ""
