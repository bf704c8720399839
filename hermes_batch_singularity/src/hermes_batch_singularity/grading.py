"""A verifier's tests apart from the agent (``Sandbox.run_tests``): what they hold in an instance, and when they cannot.

The tests are one exec of the instance (of the prompt's view with ``-S
reuse=namespace``) that runs hermes-batch's static helper as their supervisor
(``-G``): the helper and the tests' script go on the exec's standard input
(``hermes_batch.grading.launcher``), so nothing of them is in the instance
before the session ended.  Who the tests are is who the instance's execs are:

- as root, the instance's root with TESTS_CAPABILITIES (``--no-privs
  --add-caps``), so the agent's leftovers (modes, read-only folders) cannot stop
  them, and none that would let them out of the instance (no CAP_SYS_ADMIN); the
  agent's commands ran as root without any capability.  ``$HERMES_RUN_UNTRUSTED``
  then has no namespaces (mapping root into a user namespace needs CAP_SETFCAP)
  and keeps the agent's code from the tests' files with Landlock alone: without
  Landlock it would refuse, so the backend says so at start (TESTS_APART_MISSING).
  With ``-S reuse=namespace`` the same, inside the prompt's view (the helper's
  ``-J`` keeps TESTS_MASK of what it holds).
- as an ordinary user, that user, as the agent was (Apptainer gives an instance
  no other): they own what the agent left and can change its modes;
  ``$HERMES_RUN_UNTRUSTED`` makes a user namespace of its own (PID and mount
  namespaces: the reward hidden, the grading folder read-only, nothing left
  running), and Landlock where the kernel has it.
"""

from __future__ import annotations

from typing import Optional

from hermes_batch import build_namespace_helper, grading

# What the tests hold as root: enough to read and write whatever the agent left (whatever its modes), give the
# reward's folder its own owner, and take every capability away from the agent's code; nothing to mount with.
TESTS_CAPABILITIES = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_KILL", "CAP_SETPCAP")
_NUMBERS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_KILL": 5,
            "CAP_SETPCAP": 8}
TESTS_MASK = sum(1 << _NUMBERS[name] for name in TESTS_CAPABILITIES)  # -k of the helper's -J in a view
NO_LANDLOCK = (
    "Apptainer runs as root here and its commands without capabilities (--no-privs), and this kernel has no "
    "Landlock, which is what keeps the agent's code that the tests run ($HERMES_RUN_UNTRUSTED, as root) away from "
    "the tests' files"
)


def build_helper(folder: str) -> tuple:
    """``(path of the static helper, None)``, built once into ``folder``, or ``(None, why not)``."""
    return build_namespace_helper(folder, static=True)


NEITHER = (
    "this kernel has neither Landlock nor user namespaces for an ordinary user, so the agent's code that the tests "
    "run ($HERMES_RUN_UNTRUSTED, as the same user as the tests) could not be kept away from the tests' files"
)


def user_namespaces() -> bool:
    """Whether this kernel lets an ordinary user make a user namespace (what run-untrusted does as that user)."""
    for path, off in (("/proc/sys/user/max_user_namespaces", "0"), ("/proc/sys/kernel/unprivileged_userns_clone", "0")):
        try:
            with open(path) as f:
                if f.read().strip() == off:
                    return False
        except OSError:
            pass  # not this kernel's knob
    return True


def missing(helper_problem: Optional[str], as_root: bool) -> str:
    """``tests_apart_missing`` of a singularity backend: "" when its sandboxes can run tests apart."""
    if helper_problem:
        return f"hermes-batch's static helper, which runs the tests apart, could not be built ({helper_problem})"
    if grading.landlock_abi() >= 1:
        return ""
    if as_root:
        return NO_LANDLOCK
    return "" if user_namespaces() else NEITHER
