"""The compiled first process of a local sandbox's namespace: ``namespace_init.c``, built once per machine.

It does in one small program what ``unshare``, ``setpriv`` and the bash
helper do in three (see :mod:`~hermes_batch.local_sandbox.launchers`),
and starts each command with one fork of itself instead of two of bash: about
a third of the CPU a prompt's sandbox costs with the programs.  It is built
with the machine's C compiler (``$CC``, else ``cc`` or ``gcc``), statically
linked where the C library allows, into the user's cache folder
(``$XDG_CACHE_HOME/hermes-batch``, else ``~/.cache/hermes-batch``), under a
name that holds the source's digest, so a changed source is built again.
Without a compiler, or where the cache folder is not the user's alone, the
sandbox uses the programs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from .control import not_ours_alone

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("namespace_init.c")
SOURCES = tuple(Path(__file__).with_name(name) for name in ("namespace_init.c", "namespace_view.h", "grading.h"))  # the first includes the others
BUILD_TIMEOUT_S = 120.0
WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def program_path(folder: Path, name: str = "hermes-batch-namespace") -> Path:
    """Where in ``folder`` the program built from this version of the source, for this machine's type, is."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES)).hexdigest()[:16]
    return Path(folder) / f"{name}-{digest}-{platform.machine() or 'unknown'}"


def cache_dir() -> Path:
    """The folder of the built program: the user's cache folder's ``hermes-batch``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hermes-batch"


def compiler() -> Optional[list]:
    """The C compiler's argv: ``$CC`` (split as a shell would), else ``cc`` or ``gcc``; None without one."""
    named = shlex.split(os.environ.get("CC", ""))
    if named:
        return named if shutil.which(named[0]) else None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def build(folder: Optional[Path] = None, name: str = "hermes-batch-namespace", static: bool = False) -> tuple:
    """(path of the built program, None), built now unless it already was; (None, why not) where it cannot be.

    With ``static`` only a statically linked program will do (one that runs in any
    container image, whatever its C library), under its own name.

    The program is looked for, and built, in ``folder`` (default
    :func:`cache_dir`), which must be a folder of this user's that nobody else
    may write to: whoever could write there could replace the program every
    sandbox of this user runs as the first process of its namespace.
    """
    folder = Path(folder) if folder is not None else cache_dir()
    target = program_path(folder, name + ("-static" if static else ""))
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = not_ours_alone(folder, stat.S_ISDIR, WRITABLE_BY_OTHERS)
        if why:
            return None, f"its folder {folder} {why}"
        if os.path.lexists(target):
            why = not_ours_alone(target, stat.S_ISREG, WRITABLE_BY_OTHERS)
            return (None, f"{target} {why}") if why else (str(target), None)
    except OSError as exc:
        return None, f"its folder {folder} cannot be used ({exc.strerror or exc})"
    argv = compiler()
    if argv is None:
        return None, "no C compiler was found (cc, gcc or $CC)"
    fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=folder)
    os.close(fd)
    try:
        errors = ""
        # static where the C library has an archive (a third of the start); only static with ``static``
        for flags in (["-static"],) if static else (["-static"], []):
            try:
                done = subprocess.run(
                    [*argv, "-O2", *flags, "-o", partial, str(SOURCE)], capture_output=True,
                    timeout=BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                return None, f"the C compiler could not run ({exc})"
            if done.returncode == 0:
                os.chmod(partial, 0o755)
                os.replace(partial, target)
                # Builds of other versions stay: a run of another installed version may be using one.
                log.info("Built the local sandbox's namespace helper %s.", target)
                return str(target), None
            errors = done.stderr.decode(errors="replace").strip()
        last = errors.splitlines()[-1] if errors else "no message"
        return None, f"{' '.join(argv)} could not build {SOURCE.name} ({last})"
    finally:
        if os.path.lexists(partial):
            os.unlink(partial)
