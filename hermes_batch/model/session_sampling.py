"""Sampling fields of one session's requests, over the run's: a branch's own seed (--branch_at, --branches).

The K branches of a row send the same conversation at their first call of their own; a seed of each branch's
makes an endpoint that honours ``seed`` sample them apart, and records which sample each was.  A context
variable, as the call journal's prompt is: each session runs in a task of its own, and the prefix a branch
continues was started before the branch set its seed.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Optional

session_sampling: ContextVar[Optional[dict]] = ContextVar("hermes_batch_session_sampling", default=None)
