"""One answer to "is the run that left this behind still alive": the folder lock, the viewer and every backend."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from hermes_batch import SandboxBackend
from hermes_batch.folder.liveness import owner_alive


@pytest.fixture(scope="module")
def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_process_of_this_machine_is_alive_until_it_ends(dead_pid):
    assert owner_alive(os.getppid()) and owner_alive(str(os.getppid()), socket.gethostname())
    assert not owner_alive(dead_pid) and not owner_alive(dead_pid, socket.gethostname())
    assert owner_alive(1)  # another user's process: kill(pid, 0) is refused, yet it runs


def test_a_process_of_another_machine_cannot_be_checked_and_is_taken_to_run(dead_pid):
    assert owner_alive(dead_pid, "another-host")
    assert owner_alive(dead_pid, "")  # no host recorded where one belongs: not known to be this one
    assert not owner_alive(dead_pid, socket.gethostname()[:63])  # as a label or tag holds a long name


@pytest.mark.parametrize("pid", [None, "", "x", 0, -1, "-5"])
def test_a_pid_that_is_none_belongs_to_no_one(pid):
    assert not owner_alive(pid)


def test_this_process_leftovers_are_alive_while_their_session_is():
    assert owner_alive(os.getpid(), session="ab12", live_sessions={"ab12"})
    assert not owner_alive(os.getpid(), session="ab12", live_sessions={"cd34"})
    assert not owner_alive(os.getpid(), session=None, live_sessions={"cd34"})
    assert owner_alive(os.getpid())  # the lock: no sessions, this process is alive


def test_backends_reach_it_through_the_public_api(dead_pid):
    assert SandboxBackend.owner_alive is owner_alive
    from hermes_batch_docker import engine
    from hermes_batch_singularity.instances import InstanceName

    host, pid = socket.gethostname(), str(dead_pid)
    assert not engine.owner_alive({engine.LABEL_HOST: host, engine.LABEL_PID: pid})
    assert engine.owner_alive({engine.LABEL_HOST: "elsewhere", engine.LABEL_PID: pid})
    assert engine.owner_alive({engine.LABEL_PID: pid})  # no host label: another engine user's, left alone
    assert not InstanceName("n", "r", "0000", "0000", 0, dead_pid, "ab12").owner_alive()
    assert InstanceName("n", "r", "0000", "0000", 0, os.getpid(), "ab12").owner_alive() is False


def test_a_lock_left_by_a_dead_run_on_a_folder_without_flock_is_taken_over(tmp_path, monkeypatch, dead_pid):
    import errno
    import fcntl
    import json

    from hermes_batch.errors import RunFolderError
    from hermes_batch.folder.lock import LOCK_NAME, RunFolderLock

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "no locks")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    holder = {"pid": dead_pid, "host": socket.gethostname()}
    (tmp_path / LOCK_NAME).write_text(json.dumps(holder))
    with RunFolderLock(tmp_path):
        pass
    (tmp_path / LOCK_NAME).write_text(json.dumps(dict(holder, pid=os.getppid())))
    with pytest.raises(RunFolderError, match=f"in use by another run \\(pid {os.getppid()}"):
        RunFolderLock(tmp_path).acquire()
