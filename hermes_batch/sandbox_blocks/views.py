"""The command lines of the namespace helper's container views, for the container backends' ``-S reuse=namespace``.

A container backend that reuses a container (Docker) or an instance (Apptainer)
for prompts one after another gives each prompt a view of its own made by
hermes-batch's static namespace helper (``namespace_view.h``, built by
``build_namespace_helper(static=True)`` and bound into the container): ``-O``
makes the view and runs the prompt's command runner in it, ``-J`` runs a command
inside it as a fresh process of the engine (whose output no process of the prompt
holds), ``-J ... -X`` kills every process of it but its first.  What differs
between backends (where the helper and the tags live, the lower layer, the
capabilities the prompt keeps, its user) is given to :class:`View`.
"""

from __future__ import annotations

from typing import Optional

import attrs

VIEW_ENDED = "the prompt's view of the container has ended"  # what the helper says when a view is gone


@attrs.frozen
class View:
    """One prompt's view of a reused container: how to make it, join it and stop its processes."""

    helper: str  # the helper's path inside the container
    tag: str  # the file (on a path of the container no view shows) naming the view's first process
    workdir: str
    memory_bytes: int  # the memory file system of its files
    mask: int = 0  # the capabilities its processes keep
    user: Optional[tuple] = None  # (uid, gid) or (uid, gid, home) its commands run as, else None (the root)
    own_network: bool = False  # a network namespace of its own, loopback only
    lower: Optional[str] = None  # the folder of the image's files, when the container's root cannot be the lower layer

    @property
    def env(self) -> dict:
        """What every process of the view gets besides the prompt's environment: the user's HOME, when known."""
        return {"HOME": self.user[2]} if self.user and len(self.user) > 2 and self.user[2] else {}

    def _options(self, workdir: Optional[str] = None) -> list:
        user = ["-i", f"{self.user[0]}:{self.user[1]}"] if self.user else []
        return ["-k", f"{self.mask:x}", *user, "-w", workdir or self.workdir]

    def open_argv(self, argv: list) -> list:
        """What makes the view and runs ``argv`` (the runner) as its first command."""
        lower = ["-L", self.lower] if self.lower else []
        network = ["-n"] if self.own_network else []
        return [self.helper, "-O", str(self.memory_bytes), "-T", self.tag, *lower, *network, *self._options(), "--", *argv]

    def join_argv(self, argv: list, pwd: Optional[str] = None) -> list:
        """What runs ``argv`` inside the view, lowered as its commands are, in ``pwd`` (default its working folder)."""
        return [self.helper, "-J", self.tag, *self._options(pwd), "--", *argv]

    def tests_argv(self, argv: list) -> list:
        """What runs ``argv`` inside the view as the container's root, with the capabilities the prompt's processes
        keep (``mask``, the container's own) and the view's seccomp filter, but not the prompt's user: a verifier's
        tests (``Sandbox.run_tests``), whom the agent's leftovers (file modes, read-only folders) must not stop.

        ``argv`` starts in ``/``; the helper's own program is ``/proc/self/exe`` there (the view does not show where
        the container binds it), which is how ``-G``, the tests' supervisor, is started in the view.
        """
        return [self.helper, "-J", self.tag, "-k", f"{self.mask:x}", "-w", "/", "--", *argv]

    def stop_argv(self) -> list:
        """What kills every process of the view but its first, which then outlives the runner."""
        return [self.helper, "-J", self.tag, "-X"]
