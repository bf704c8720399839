"""Formats made of a row's samples together (``--samples_per_prompt``): ``dpo`` pairs and ``rollouts`` groups.

Their sinks take trajectories as every sink does, in ``prompt_index`` order, and
hold the samples of one row until the next row begins: an export hands them a
row's kept and discarded samples one after the other (``--include all``, their
default), so one row is in memory at a time.

Messages are ``{"role", "content"}`` with roles ``system``, ``user``,
``assistant`` and ``tool`` (the chat form TRL and other trainers read), the
content being the turn's text as the ShareGPT record holds it: reasoning in
``<think>``, calls in ``<tool_call>`` and results in ``<tool_response>``
blocks (the Hermes format).  Every field is a string, a number or a bool, the
same type on every line, so ``datasets`` loads them.
"""

from __future__ import annotations

import json
import random
from typing import Optional, Sequence

import attrs

import hermes_batch
from hermes_batch.contract.writers import FileWriter, Sink
from hermes_batch.formats.records import Trajectory
from hermes_batch.formats.row_identity import prompt_text, row_key

ROLES = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}


def messages(trajectory: Trajectory) -> list[dict]:
    """The trajectory's turns as ``{"role", "content"}`` messages."""
    return [{"role": ROLES.get(turn.from_, turn.from_), "content": turn.value} for turn in trajectory.conversations]


def split_prompt(chat: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the prompt: the messages up to and including the first user message, the completion after it)."""
    for i, message in enumerate(chat):
        if message["role"] == "user":
            return chat[: i + 1], chat[i + 1:]
    return [], chat


def split_after_turns(chat: list[dict], turns: int) -> tuple[list[dict], list[dict]]:
    """(the prompt and the first ``turns`` assistant messages with their tool results: a branch's shared prefix,
    what follows it)."""
    seen = 0
    for i, message in enumerate(chat):
        if message["role"] == "assistant":
            if seen == turns:
                return chat[:i], chat[i:]
            seen += 1
    return chat, []


def _dumps(line: dict) -> str:
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"


class GroupSink(Sink):
    """A JSON Lines sink that sees a row's samples together: ``encode_group(row key, samples, notes)`` turns them
    into lines.  A row is its ``prompt_index`` and its content key (row_identity.py: each sample's record holds a
    key of its own)."""

    def __init__(self, path, encode_group):
        super().__init__(path)
        self.encode_group = encode_group
        self._row: Optional[tuple] = None
        self._samples: list[Trajectory] = []

    def add(self, trajectory: Trajectory) -> None:
        row = (trajectory.prompt_index, row_key(trajectory))
        if row != self._row:
            self._flush()
            self._row = row
        self._samples.append(trajectory)

    def _flush(self) -> None:
        if not self._samples:
            return
        samples, self._samples = self._samples, []
        # the order records are read in depends on which file holds them (kept or discarded): sort it away,
        # so the same run gives the same lines after a refilter
        samples.sort(key=lambda t: (t.metadata.sample_index, t.metadata.timestamp))
        for line in self.encode_group(self._row[1], samples, self.notes):
            self.write_line(line)

    def finish(self) -> None:
        self._flush()


def _note(notes: dict, what: str) -> None:
    notes[what] = notes.get(what, 0) + 1


@attrs.frozen
class DpoOptions:
    pairs_per_row: int = attrs.field(default=1, validator=attrs.validators.ge(0))  # 0: as many as the row allows
    seed: int = 0
    # pairs of branches of one prefix (--branch_at): the prompt holds the prefix, chosen and rejected what follows
    shared_prefix: bool = False


class DpoWriter(FileWriter):
    """Preference pairs: a passing (chosen) and a failing (rejected) sample of the same row and prompt.

    The pairing rule: a row's samples are grouped by their prompt (system and user message: the same
    tools offered); in each group, the samples that passed are the candidates for ``chosen`` and those
    every verifier scored below the pass mark for ``rejected`` (a sample whose verifier failed is
    neither).  Both lists, in ``sample_index`` order, are shuffled by a random generator seeded with
    ``seed`` and the row's content key, and paired in order, each sample in at most one pair, up to
    ``pairs_per_row`` pairs a row.  The same run and seed give the same pairs, whatever the order of
    the files or the splits.

    ``shared_prefix=true``: the samples are branches (--branch_at) grouped by the prefix they continue
    (``metadata.branch_of``) and its text: the pair's ``prompt`` ends with the prefix's turns, ``chosen``
    and ``rejected`` are what each branch did after it; samples of no branch are left out.
    """

    name = "dpo"
    description = ("dpo.jsonl: chosen/rejected pairs of a passing and a failing sample of one row "
                   "(dpo:pairs_per_row=0 for every pair a row allows, dpo:seed=N, dpo:shared_prefix=true for "
                   "branches of one prefix, --branch_at); needs --verifier")
    filename = "trajectories.dpo.jsonl"
    suffix = ".jsonl"
    Config = DpoOptions
    include = "all"  # export's default: the failing samples a verified filter discarded are the rejected ones
    unit = "pairs"

    def open(self, path) -> GroupSink:
        return GroupSink(path, self.encode_group)

    def encode_group(self, key: str, samples: Sequence[Trajectory], notes: dict) -> list[str]:
        by_prompt: dict[str, list] = {}
        shared = self.config.shared_prefix
        for traj in samples:
            if shared and not traj.metadata.branch_of:
                _note(notes, "samples of no shared prefix (--branch_at)")
                continue
            if shared:
                prompt, completion = split_after_turns(messages(traj), traj.metadata.branch_turn)
                group = json.dumps([traj.metadata.branch_of, prompt])
            else:
                prompt, completion = split_prompt(messages(traj))
                group = json.dumps(prompt)
            if completion:
                by_prompt.setdefault(group, []).append((traj, prompt, completion))
        passing = [s for group in by_prompt.values() for s in group if s[0].metadata.passed]
        failing = [s for group in by_prompt.values() for s in group
                   if s[0].metadata.verified and not s[0].metadata.passed]
        if not passing or not failing:
            _note(notes, "rows with no passing sample" if not passing else "rows with no failing sample")
            return []
        first = samples[0]
        rng = random.Random(f"{self.config.seed}\0{key}\0{first.prompt_index}")
        lines: list[str] = []
        budget = self.config.pairs_per_row or len(samples)
        prompts = list(by_prompt)
        rng.shuffle(prompts)
        for prompt_key in prompts:
            chosen = [s for s in by_prompt[prompt_key] if s[0].metadata.passed]
            rejected = [s for s in by_prompt[prompt_key] if s[0].metadata.verified and not s[0].metadata.passed]
            rng.shuffle(chosen)
            rng.shuffle(rejected)
            for (good, prompt, good_completion), (bad, _prompt, bad_completion) in zip(chosen, rejected):
                if len(lines) >= budget:
                    break
                branch = {"branch_of": good.metadata.branch_of, "branch_turn": good.metadata.branch_turn}
                lines.append(_dumps({
                    **(branch if shared else {}),
                    "prompt": prompt,
                    "chosen": good_completion,
                    "rejected": bad_completion,
                    "chosen_reward": float(good.metadata.reward),
                    "rejected_reward": float(bad.metadata.reward),
                    "chosen_sample_index": good.metadata.sample_index,
                    "rejected_sample_index": bad.metadata.sample_index,
                    "prompt_index": first.prompt_index,
                    "content_key": key,
                    "id": first.metadata.id,
                }))
        if not lines:
            _note(notes, "rows whose passing and failing samples had different prompts (tools offered)")
        return lines


def token_fields(side) -> dict:
    """A sample's token ids (--logprobs; docs/training-data.md#token-ids-and-logprobs): the conversation as the
    endpoint's tokenizer encodes it with a loss mask and logprobs over it, and per assistant turn its prompt's
    ids, its sampled ids and their logprobs.  Empty lists where the run kept none."""
    fields: dict = {"token_check": "", "input_ids": [], "loss_mask": [], "logprobs": [], "turns": []}
    if side is None:
        return fields
    sequence = list(side.sequence) if side.sequence is not None else []
    mask = [0] * len(sequence)
    logprobs = [0.0] * len(sequence)
    turns = []
    for turn, start, tokens in side.turns:
        ids = list(tokens.ids) if tokens is not None and tokens.ids is not None else []
        values = list(tokens.logprobs) if tokens is not None else []
        if start >= 0 and ids:
            mask[start:start + len(ids)] = [1] * len(ids)
            logprobs[start:start + len(ids)] = values
        turns.append({"turn": turn, "prompt_ids": sequence[:start] if start >= 0 else [],
                      "completion_ids": ids, "completion_logprobs": values})
    fields.update(token_check=side.check, input_ids=sequence, loss_mask=mask, logprobs=logprobs, turns=turns)
    return fields


class RolloutsWriter(FileWriter):
    """One line per row: its samples with their rewards, as GRPO-style trainers read groups of rollouts; with
    the token ids a --logprobs run kept beside its records (``token_fields``)."""

    name = "rollouts"
    description = "rollouts.jsonl: one line per row, its samples (messages) with their rewards (--samples_per_prompt)"
    filename = "trajectories.rollouts.jsonl"
    suffix = ".jsonl"
    include = "all"
    unit = "rows"
    token_ids = True  # export hands it each sample's side entry (Trajectory.tokens)

    def open(self, path) -> GroupSink:
        return GroupSink(path, self.encode_group)

    def encode_group(self, key: str, samples: Sequence[Trajectory], notes: dict) -> list[str]:
        first = samples[0]
        rewards = [float(t.metadata.reward) for t in samples]
        return [_dumps({
            "prompt": prompt_text(first) or "",
            "prompt_index": first.prompt_index,
            "content_key": key,
            "id": first.metadata.id,
            "samples": [
                {
                    "sample_index": t.metadata.sample_index,
                    "messages": messages(t),
                    "reward": float(t.metadata.reward),
                    "verified": bool(t.metadata.verified),
                    "passed": bool(t.metadata.passed),
                    "toolsets": "+".join(t.toolsets_used),
                    "end_reason": t.metadata.end_reason,
                    **token_fields(t.tokens),
                }
                for t in samples
            ],
            "rewards": rewards,
            "passed": sum(bool(t.metadata.passed) for t in samples),
            "mean_reward": sum(rewards) / len(rewards),
        })]


@hermes_batch.hookimpl
def register_writers(register):
    register(DpoWriter)
    register(RolloutsWriter)
