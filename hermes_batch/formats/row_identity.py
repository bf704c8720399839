"""Which dataset row a record is a sample of, for what reads a run's samples by row (export splits, dpo, rollouts).

Under ``--samples_per_prompt`` each sample but the first has a content key of its own (a hash of the row's key
and its index), so the row's key is not in its record.  It is the key of the record's prompt, image and cwd, which
the sample key confirms; where it cannot be rebuilt (a prompt the run redacted, say) the sample's own key stands.
"""

from __future__ import annotations

from typing import Optional

from .records import Trajectory, content_key, sample_key


def prompt_text(trajectory: Trajectory) -> Optional[str]:
    """The first user message of ``trajectory`` (the row's prompt as the run gave it), None without one."""
    for turn in trajectory.conversations:
        if turn.from_ == "human":
            return turn.value
    return None


def row_key(trajectory: Trajectory) -> str:
    """The content key of the row ``trajectory`` is a sample of (its own key for sample 0 and for older records)."""
    meta = trajectory.metadata
    if not meta.sample_index:
        return meta.content_key
    prompt = prompt_text(trajectory)
    if prompt is not None:
        cwd = meta.cwd or None
        for image in dict.fromkeys((None, meta.image or None)):  # the row's image, or none when the backend chose it
            key = content_key(prompt, image, cwd)
            if sample_key(key, meta.sample_index) == meta.content_key:
                return key
    return meta.content_key
