"""The files of an export: where they go, which of them it owns, and how a new set replaces the old one whole.

An export names what it wrote in a manifest beside its files: ``.hermes-batch-export.json``
in a folder of split files, ``.<name>.hermes-batch-export.json`` beside a file named by
``--output``.  A file listed there, and unchanged since, is the export's own: the next
export into the same place replaces it, or removes it when the new set lacks it (the
``validation.jsonl`` of an earlier ``--split``).  Any other existing file is refused
unless ``--force``, nothing else is ever removed, and no export writes into a run
folder except under its ``exports/``.

The new set is written whole to temporary files first.  A folder that holds only the
export's own files is built anew beside it and exchanged with it in one step
(``renameat2(RENAME_EXCHANGE)``), so readers, and a kill at any moment, see the old
set or the new one.  Elsewhere (files among the user's own, a file system without the
exchange) the manifest naming the new set and its temporary files is written first,
as the commit point, and the files are then renamed into place with Ctrl-C and SIGTERM
held off; a kill inside those few renames leaves that manifest, and the next export
into the same place finishes the switch before anything else.  The next export also
removes a killed export's temporary files.  Exports into one place take turns (a lock
on the folder).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import signal
import stat
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

import attrs

from ..errors import RunFolderWriteError, UsageError
from ..folder.durable import TEMP_MARK, _fsync_dir, atomic_write_text, is_temp_file, write_error

log = logging.getLogger(__name__)

MANIFEST = ".hermes-batch-export.json"
MANIFEST_VERSION = 1
TRAIN = "train"
EXPORTS = "exports"  # the part of a run folder exports may write
_RUN_FILES = ("run.json", "checkpoint.json", "discarded.jsonl", "failed.jsonl")
_BATCH_RE = re.compile(r"batch_\d+\.jsonl")
_NO_LOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EBADF}
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EBUSY, errno.EPERM}


@attrs.frozen
class Target:
    """Where an export's files go: ``names`` (split -> file name) in ``folder``, named by the manifest ``manifest``."""

    folder: Path  # symlinks resolved
    names: dict
    manifest: str
    whole_folder: bool  # a folder of split files, which the export may exchange whole
    shown: str  # the folder or file as the user gave it, for messages

    def path(self, name: str) -> Path:
        return self.folder / name


def target_for(run_dirs: Sequence[Path], name: str, suffix: str, output: Optional[Path], splits: dict) -> Target:
    """The target of an export in format ``name`` (files ending in ``suffix``); UsageError where it may not write.

    ``output`` ending in ``suffix`` is a file (``stem.<split><suffix>`` with splits); any other ``output`` is a
    folder of ``<split><suffix>`` files; without ``output``, the one run's ``exports/<name>/``.
    """
    splits_all = [TRAIN, *splits]
    if output is None:
        if len(run_dirs) != 1:
            raise UsageError(f"Exporting several runs needs --output: a folder, or a file ending in {suffix}.")
        folder, shown = Path(run_dirs[0]) / EXPORTS / name, str(Path(run_dirs[0]) / EXPORTS / name)
        names, manifest, whole = {s: f"{s}{suffix}" for s in splits_all}, MANIFEST, True
    elif output.suffix == suffix and not output.is_dir():
        folder, shown = output.parent, str(output)
        stem = output.name[: -len(suffix)]
        names = {TRAIN: output.name} if not splits else {s: f"{stem}.{s}{suffix}" for s in splits_all}
        manifest, whole = f".{output.name}{MANIFEST}", False
    else:
        folder, shown = output, str(output)
        names, manifest, whole = {s: f"{s}{suffix}" for s in splits_all}, MANIFEST, True
    folder = Path(os.path.realpath(folder))
    _refuse_run_folders(folder, shown)
    _refuse_non_folders(folder, shown, suffix)
    return Target(folder, names, manifest, whole, shown)


def _refuse_non_folders(folder: Path, shown: str, suffix: str) -> None:
    """UsageError when the folder the export would write in is, or lies under, something that is no folder
    (a plain file): creating it would fail as a disk error (exit 74) for what is a mistake in the command."""
    for place in (folder, *folder.parents):
        if not os.path.lexists(place):
            continue
        if not place.is_dir():
            what = "is a file" if place == folder else f"is under {place}, which is a file"
            raise UsageError(
                f"--output {shown} {what}, not a folder; pass a folder for the export's files, or a file name "
                f"ending in {suffix}."
            )
        return


def _is_run_folder(path: Path, scan: bool) -> bool:
    if any(os.path.lexists(path / name) for name in _RUN_FILES):
        return True
    if not scan:
        return False
    try:
        return any(_BATCH_RE.fullmatch(entry.name) for entry in os.scandir(path))
    except OSError:
        return False


def _refuse_run_folders(folder: Path, shown: str) -> None:
    """UsageError when ``folder`` is (inside) a run folder, anywhere but its ``exports/``: its files are records."""
    for place in (folder, *folder.parents):
        if _is_run_folder(place, scan=place == folder):
            if folder.relative_to(place).parts[:1] != (EXPORTS,):
                raise UsageError(
                    f"--output {shown} is inside the run folder {place}, whose files are the run's own records; "
                    f"pass an --output outside it, or under {place / EXPORTS}."
                )
            return


# --- the manifest --------------------------------------------------------------------------------------------


def _identity(path: Path) -> Optional[dict]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def read_manifest(target: Target) -> dict:
    """The target's manifest ({} when there is none, or it is unreadable: then the export owns nothing there)."""
    path = target.path(target.manifest)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s); the files it named are treated as not written by an export.", path, exc)
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return {}
    data["files"] = {name: entry for name, entry in data["files"].items() if _plain(name)}
    if not _switch_is_ours(data):
        log.warning("%s names files to switch that no export writes; ignored.", path)
        data.pop("switching", None)
        data.pop("remove", None)
    return data


def _switch_is_ours(manifest: dict) -> bool:
    """An interrupted switch renames only the export's own temporary files (in the folder, or in the new folder
    beside it) to plain names, and removes only plain names."""
    switching, remove = manifest.get("switching") or {}, manifest.get("remove") or {}
    if not isinstance(switching, dict) or not isinstance(remove, dict):
        return False
    for name, tmp in switching.items():
        parts = tmp.split("/") if isinstance(tmp, str) else []
        fine = (len(parts) == 1 and is_temp_file(parts[0])) or \
            (len(parts) == 3 and parts[0] == ".." and is_temp_file(parts[1]) and parts[2] == name)
        if not (_plain(name) and fine):
            return False
    return all(_plain(name) for name in remove)


def _plain(name) -> bool:
    """A file name an export writes: no folder part, not hidden."""
    return isinstance(name, str) and bool(name) and "/" not in name and not name.startswith(".")


def _owned(manifest: dict, folder: Path, name: str) -> bool:
    """True when ``name`` is a file the manifest lists and nobody changed since (same size and mtime)."""
    entry = manifest.get("files", {}).get(name)
    now = _identity(folder / name)
    return isinstance(entry, dict) and now is not None and all(entry.get(k) == v for k, v in now.items())


def _write_manifest(folder: Path, name: str, data: dict) -> None:
    try:
        atomic_write_text(folder / name, json.dumps(data, indent=2) + "\n")
    except RunFolderWriteError as exc:
        cause = exc.__cause__
        if isinstance(cause, OSError):
            raise write_error(folder / name, cause, started=False) from cause
        raise


# --- taking turns ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(target: Target) -> Iterator[bool]:
    """Hold the target folder's lock (creating the folder); yields whether this export created the folder.

    An ``flock`` on the folder itself, which leaves no file behind; a folder exchanged while another export
    waited is locked again under its new identity.  Where the file system has no ``flock``, exports are not
    kept apart.
    """
    created = not target.folder.exists()
    try:
        target.folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(target.folder, exc, started=False, doing="Creating") from exc
    while True:
        try:
            fd = os.open(target.folder, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise write_error(target.folder, exc, started=False, doing="Opening") from exc
        try:
            _flock(fd, target)
            if os.fstat(fd).st_ino == os.stat(target.folder).st_ino:
                break
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # exchanged (or removed) while we waited: lock what is there now
        target.folder.mkdir(parents=True, exist_ok=True)
    try:
        yield created
    finally:
        os.close(fd)


def _flock(fd: int, target: Target) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        log.warning("Waiting for another export into %s to end ...", target.folder)
    except OSError as exc:
        if exc.errno in _NO_LOCK:
            return
        raise
    fcntl.flock(fd, fcntl.LOCK_EX)


def remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


# --- before writing: finish or clean up what an earlier export left, and check what may be replaced --------------


@attrs.frozen
class Plan:
    """What the export will do: where its sinks write, and which files of the previous set go."""

    target: Target
    staging: Path  # where the sinks write: the folder itself, or a new folder to exchange with it
    stale: dict  # name -> identity: files of the previous set the new one lacks (removed at the switch)
    left_alone: tuple  # files of the previous set that were changed since, so are not the export's any more


def prepare(target: Target, *, force: bool) -> Plan:
    """Finish an interrupted switch, remove dead temporary files, and refuse what the export may not replace.

    Call it holding :func:`locked`.
    """
    manifest = read_manifest(target)
    if manifest.get("switching"):
        _finish_switch(target, manifest)
        log.warning("Finished the switch to the files of an export into %s that was interrupted.", target.shown)
        manifest = read_manifest(target)
    _remove_temporary(target)
    for split, name in target.names.items():
        path = target.path(name)
        if path.is_dir() and not path.is_symlink():
            raise UsageError(f"{path} is a folder; pass --output a file name ending in {Path(name).suffix} or a folder.")
        if os.path.lexists(path) and not force and not _owned(manifest, target.folder, name):
            why = "was changed since the export wrote it" if name in manifest.get("files", {}) else \
                "was not written by hermes-batch export"
            raise UsageError(f"{path} exists and {why}; pass --force to replace it, or choose another --output.")
    wanted = set(target.names.values())
    stale, left = {}, []
    for name in manifest.get("files", {}):
        if name in wanted:
            continue
        if _owned(manifest, target.folder, name):
            stale[name] = _identity(target.path(name))
        elif os.path.lexists(target.path(name)):
            left.append(name)
    staging = target.folder
    if target.whole_folder and _only_own_files(target, manifest):
        staging = _new_swap_folder(target)
    return Plan(target, staging, stale, tuple(sorted(left)))


def _only_own_files(target: Target, manifest: dict) -> bool:
    own = {target.manifest, *(n for n in manifest.get("files", {}) if _owned(manifest, target.folder, n))}
    try:
        return all(entry.name in own for entry in os.scandir(target.folder))
    except OSError:
        return False


def _swap_prefix(target: Target) -> str:
    return f".{target.folder.name}{TEMP_MARK}"


def _new_swap_folder(target: Target) -> Path:
    if _is_run_folder(target.folder.parent, scan=False):
        return target.folder  # a run's own exports/ folder: nothing of the export's beside the run's records
    while True:
        path = target.folder.parent / f"{_swap_prefix(target)}{secrets.token_hex(8)}.tmp"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError:
            return target.folder  # the parent cannot be written: switch the files in place


def _remove_temporary(target: Target) -> None:
    """Temporary files of exports into this folder that were killed (every export here holds the lock), and
    the new folders of killed exchanges beside it."""
    removed = 0
    for entry in os.scandir(target.folder):
        if is_temp_file(entry.name) and not entry.is_dir(follow_symlinks=False):
            removed += _unlink(Path(entry.path))
    if target.whole_folder:
        prefix = _swap_prefix(target)
        for entry in os.scandir(target.folder.parent):
            if entry.name.startswith(prefix) and is_temp_file(entry.name) and entry.is_dir(follow_symlinks=False):
                removed += _remove_swap_folder(Path(entry.path))
    if removed:
        log.warning("Removed %d temporary file(s) of an export into %s that was interrupted.", removed, target.shown)


_SPLIT_FILE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9]+")


def _remove_swap_folder(path: Path, manifest_name: str = MANIFEST, *, previous: bool = False) -> int:
    """A folder built beside the target (abandoned, or the previous set after the exchange): the files an export
    wrote there (temporary files, split files, the manifest and what it lists unchanged), then the folder.

    ``previous``: it is known to be the previous set, so only what its manifest lists goes.  Anything else (a
    file the user put in the target folder at the instant of the exchange) stays, and so does the folder.
    """
    listed = read_manifest(Target(path, {}, manifest_name, True, str(path)))
    removed, others = 0, []
    for entry in os.scandir(path):
        name = entry.name
        if entry.is_dir(follow_symlinks=False):
            others.append(name)
        elif (is_temp_file(name) or name == manifest_name or (not previous and _SPLIT_FILE.fullmatch(name))
              or _owned(listed, path, name)):
            removed += _unlink(Path(entry.path))
        else:
            others.append(name)
    if others:
        log.warning("Kept %s: it holds %s, which no export wrote.", path, ", ".join(sorted(others)))
    remove_if_empty(path)
    return removed


def _unlink(path: Path) -> int:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise write_error(path, exc, started=False, doing="Removing") from exc
    return 1


# --- the switch -----------------------------------------------------------------------------------------------


def publish(plan: Plan, written: dict, info: dict) -> None:
    """Make the sealed files ``written`` (name -> its temporary path in ``plan.staging``) the target's set.

    ``info`` goes into the manifest (format, runs, splits, counts).
    """
    target = plan.target
    files = {name: {**_identity(tmp), **info.get("counts", {}).get(name, {})} for name, tmp in written.items()}
    manifest = {"hermes_batch_export": MANIFEST_VERSION, **{k: v for k, v in info.items() if k != "counts"},
                "files": files}
    exchanged = False
    try:
        if plan.staging != target.folder:
            for name, tmp in written.items():
                os.replace(tmp, plan.staging / name)
            written = {name: plan.staging / name for name in written}
            _write_manifest(plan.staging, target.manifest, manifest)
            os.chmod(plan.staging, stat.S_IMODE(os.stat(target.folder).st_mode))  # the folder keeps its mode
            _fsync_dir(plan.staging)
            # unless something appeared in the folder while the export ran (it must stay: switch file by file)
            exchanged = _only_own_files(target, read_manifest(target)) and _exchange(plan.staging, target.folder)
        if not exchanged:
            switching = {name: os.path.relpath(tmp, target.folder) for name, tmp in written.items()}
            pending = {**manifest, "switching": switching, "remove": plan.stale}
            # the commit point: the new set is the export's from here on; a killed switch is finished by the next export
            _write_manifest(target.folder, target.manifest, pending)
    except BaseException:
        for tmp in written.values():
            _unlink(tmp)
        if plan.staging != target.folder:
            _remove_swap_folder(plan.staging)
        raise
    if exchanged:
        _fsync_dir(target.folder.parent)
        _remove_swap_folder(plan.staging, previous=True)
        return
    with _signals_held():
        _finish_switch(target, pending)
    if plan.staging != target.folder:
        _remove_swap_folder(plan.staging)


def _finish_switch(target: Target, manifest: dict) -> None:
    folder = target.folder
    for name, tmp in manifest["switching"].items():
        try:
            os.replace(folder / tmp, folder / name)
        except FileNotFoundError:
            pass  # renamed before the interruption
    for name, identity in (manifest.get("remove") or {}).items():
        if _identity(folder / name) == identity:
            _unlink(folder / name)
    _fsync_dir(folder)
    final = {k: v for k, v in manifest.items() if k not in ("switching", "remove")}
    _write_manifest(folder, target.manifest, final)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends (in the main thread; elsewhere they reach the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def _exchange(new: Path, old: Path) -> bool:
    """Swap two folders in one step; False where the system or file system cannot (then nothing changed)."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(old), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(old))


def other_data_files(target: Target, suffix: str) -> list:
    """Files in a folder target that end like the export's but are not its own: ``load_dataset(data_dir=)`` reads them too."""
    if not target.whole_folder:
        return []
    own = set(target.names.values())
    try:
        return sorted(e.name for e in os.scandir(target.folder)
                      if e.name.endswith(suffix) and e.name not in own and not e.name.startswith((".", "_")))
    except OSError:
        return []
