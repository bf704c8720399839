"""The ``blockbox`` sandbox: a folder per prompt, its commands in one PID namespace, from hermes-batch's blocks."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from hermes_batch import (
    ChildProcess, ConfigError, ExecResult, Sandbox, SandboxBackend, SandboxError, SandboxFolder, remove_tree,
    run_command,
)

# The namespace's first process: says it is ready, then reaps orphans until it is killed.
INIT = "echo ready; while :; do sleep 3600 & wait $!; done"
USER = () if os.geteuid() == 0 else ("--user", "--map-current-user")


class BlockboxBackend(SandboxBackend):
    name = "blockbox"
    description = "A folder per prompt; its commands share one PID namespace (util-linux unshare and nsenter)."
    ignores_images = True

    async def check(self) -> None:
        if not (shutil.which("unshare") and shutil.which("nsenter")):
            raise ConfigError("The blockbox sandbox needs unshare and nsenter; install util-linux.")

    async def open(self, spec) -> "Blockbox":
        self.run.scratch_dir.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=f"p{spec.prompt_index}-", dir=self.run.scratch_dir)).resolve()
        cwd = root / (spec.cwd or "").lstrip("/")
        cwd.mkdir(parents=True, exist_ok=True)
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(root), "LANG": "C.UTF-8", **spec.env}
        sandbox = Blockbox(root, cwd, env)
        try:
            await sandbox.start()
        except (OSError, RuntimeError) as exc:
            await sandbox.close()
            raise SandboxError(f"Could not start the namespace of the blockbox sandbox {root}: {exc}") from exc
        return sandbox


class Blockbox(Sandbox):
    own_pid_namespace = True  # the namespace's first process is INIT alone: stop_processes ends the rest

    def __init__(self, root: Path, cwd: Path, env: dict):
        self.root, self.cwd, self.env = root, cwd, env
        self.folder = SandboxFolder(str(root), str(cwd))  # link-safe paths, FIFOs and devices refused
        self.init = None  # unshare, the parent of the namespace's first process
        self.init_pid = None
        self.closed = False

    @property
    def workdir(self) -> str:
        return str(self.cwd)

    async def start(self) -> None:
        argv = ["unshare", *USER, "--pid", "--fork", "--mount-proc", "--kill-child", "/bin/sh", "-c", INIT]
        self.init = await ChildProcess.start(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=self.env)
        if await asyncio.to_thread(self.init.stdout.readline) != b"ready\n":
            raise RuntimeError("unshare could not make a namespace")
        with open(f"/proc/{self.init.pid}/task/{self.init.pid}/children") as f:
            self.init_pid = int(f.read().split()[0])

    async def exec(self, command: str, timeout: float) -> ExecResult:
        if self.closed:
            raise SandboxError("The blockbox sandbox was already closed.")
        enter = ["nsenter", "-t", str(self.init_pid), *(("--user", "--preserve-credentials") if USER else ()),
                 "--pid", "--mount", f"--wd={self.cwd}", "/bin/sh", "-c", command]
        try:  # a timeout, the process group killed, bounded output; returns when the command ends
            result = await run_command(enter, timeout, cwd=str(self.cwd), env=self.env)
        except OSError as exc:
            raise SandboxError(f"Could not run a command in the blockbox sandbox {self.root}: {exc}") from exc
        if self.init.exited.done():  # a command ended it (sh, its first process, takes some signals): say so
            raise SandboxError(f"The namespace of the blockbox sandbox {self.root} has ended.")
        return result

    async def read_file(self, path: str, max_bytes=None) -> bytes:
        return await asyncio.to_thread(self.folder.read, path, max_bytes)

    async def write_file(self, path: str, data: bytes) -> None:
        await asyncio.to_thread(self.folder.write, path, data)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.init is not None:
            self.init.kill()  # --kill-child: the namespace's first process dies, and the kernel kills the rest
            await self.init.exited
            self.init.reap()
            self.init.stdout.close()
        self.folder.close()
        await asyncio.to_thread(remove_tree, self.root)  # any depth: shutil.rmtree recurses
