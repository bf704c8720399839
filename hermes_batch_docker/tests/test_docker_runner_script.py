"""The command runner's shell script under the POSIX shells images have (no Docker engine needed)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from hermes_batch_docker.agent import AGENT_SCRIPT, request_line
from hermes_batch_docker.sandbox import RUN_WRAPPER, WRITE_WRAPPER

SHELLS = [name for name in ("dash", "bash", "busybox") if shutil.which(name)]


def _command(shell: str) -> list:
    return [shell, "sh"] if shell == "busybox" else [shell]


@pytest.mark.skipif(not SHELLS, reason="none of dash, bash or busybox on this machine")
@pytest.mark.parametrize("shell", SHELLS)
def test_the_runner_script_runs_commands_as_an_exec_would(shell, tmp_path):
    runner = subprocess.Popen(
        [*_command(shell), "-c", AGENT_SCRIPT, "hermes-batch-runner", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        # a prompt's variables may have any name, the short ones the script could have used for its own included
        env={**os.environ, "w": "their-w", "s": "their-s", "c": "their-c", "n": "their-n"},
    )

    def request(nonce: str, op: str, args: list, data: bytes = b"") -> bytes:
        runner.stdin.write(request_line(nonce, op, args) + data)
        runner.stdin.flush()
        out = b""
        while not (b"\x1e" + nonce.encode() + b" " in out and out.endswith(b"\n")):
            chunk = runner.stdout.read1(65536)
            assert chunk, out
            out += chunk
        return out

    def run(nonce: str, command: str) -> tuple:
        out = request(nonce, "X", ["/bin/sh", "-c", RUN_WRAPPER, "sh", command])
        pid, _, rest = out.partition(b"\n")
        body, _, status = rest.rpartition(b"\x1e" + nonce.encode() + b" ")
        return int(pid), body, int(status)

    try:
        assert runner.stdout.readline().strip().isdigit()
        pid, body, status = run("n1", "echo out; echo err >&2; pwd; exit 3")
        assert (body, status) == (f"out\nerr\n{tmp_path}\n".encode(), 3)
        # its own process group and session; only stdin, stdout and stderr open; stdin is /dev/null
        pid, body, _ = run("n2", "ps -o pgid=,sid= -p $$ 2>/dev/null || cat /proc/$$/stat | cut -d' ' -f5,6; "
                               "ls /proc/$$/fd; readlink /proc/$$/fd/0")  # no pipe: its ends would be the shell's
        words = body.decode().split()
        assert words[:2] == [str(pid), str(pid)] and words[-4:] == ["0", "1", "2", "/dev/null"]
        _, body, status = run("n3", "(sleep 0.3; echo late) & echo now")  # over when its output is closed
        assert (body, status) == (b"now\nlate\n", 0)
        assert request("n4", "E", ["ODD=a b\n'c\"$x"]) == b"\x1en4 0\n"
        assert run("n5", 'printf %s "$ODD"')[1:] == (b"a b\n'c\"$x", 0)
        assert request("n5b", "E", ["o=my-o", "r=my-r", "v=my-v", "f1=my-f1"]) == b"\x1en5b 0\n"
        names = " ".join(f'"${name}"' for name in ("w", "s", "c", "n", "o", "r", "v", "f1"))
        assert run("n5c", f"printf '%s ' {names}")[1:] == (b"their-w their-s their-c their-n my-o my-r my-v my-f1 ", 0)

        def write(nonce: str, path: str, data: bytes) -> int:
            out = request(nonce, "I", ["/bin/sh", "-c", WRITE_WRAPPER, "sh", str(tmp_path / path), str(len(data))], data)
            return int(out.rpartition(b"\x1e" + nonce.encode() + b" ")[2])

        content = bytes(range(256)) * 300 + b"\nX n6 xecho\n"  # a line that would be a request, were it read as one
        assert write("w1", "new/deeper/file.bin", content) == 0
        assert (tmp_path / "new/deeper/file.bin").read_bytes() == content
        (tmp_path / "folder").mkdir()
        os.mkfifo(tmp_path / "fifo")
        assert write("w2", "folder", content) == 21  # refused, and every byte read all the same
        assert write("w3", "fifo", content) == 22
        assert write("w4", "new/deeper/file.bin", b"short") == 0
        assert (tmp_path / "new/deeper/file.bin").read_bytes() == b"short"
        assert run("n7", "echo still in step")[1:] == (b"still in step\n", 0)
    finally:
        runner.stdin.close()
        runner.wait(10)
    assert runner.returncode == 0
