"""The tags on every sandbox of a run, and finding and terminating the ones a crashed run left running."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from pathlib import Path
from typing import Optional

from hermes_batch import SandboxBackend

from ._sdk import modal


log = logging.getLogger("hermes_batch.modal")

TAG_MARK = "hermes-batch"  # value "1" on every sandbox hermes-batch makes, so listing never touches others'
TAG_RUN = "hermes-batch.run"
TAG_RUN_DIR = "hermes-batch.run-dir"  # a hash of the run folder's path (tags are short)
TAG_PROMPT = "hermes-batch.prompt"
TAG_CONTENT_KEY = "hermes-batch.content-key"
TAG_HOST = "hermes-batch.host"
TAG_PID = "hermes-batch.pid"
TAG_SESSION = "hermes-batch.session"

# Sessions of this process whose sandboxes are still in use (several runs can share a process in tests).
LIVE_SESSIONS: set[str] = set()


def run_dir_tag(run_dir) -> str:
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def sandbox_tags(run_name: str, run_dir, prompt_index: int, content_key: str, session: str) -> dict:
    return {
        TAG_MARK: "1",
        TAG_RUN: run_name,
        TAG_RUN_DIR: run_dir_tag(run_dir),
        TAG_PROMPT: str(prompt_index),
        TAG_CONTENT_KEY: content_key[:32],
        TAG_HOST: socket.gethostname()[:63],
        TAG_PID: str(os.getpid()),
        TAG_SESSION: session,
    }


def owner_alive(tags: dict) -> bool:
    """Whether the hermes-batch process that made a sandbox may still run.

    Only a process of this machine can be checked; one of another machine is taken to be running.
    """
    return SandboxBackend.owner_alive(tags.get(TAG_PID), tags.get(TAG_HOST, ""),
                                      session=tags.get(TAG_SESSION), live_sessions=LIVE_SESSIONS)


async def find(client: modal.Client, app_id: str, **tags: str) -> list[tuple[modal.Sandbox, dict]]:
    """Running sandboxes of hermes-batch in the app whose tags include ``tags``, each with all its tags."""
    wanted = {TAG_MARK: "1", **tags}
    found = []
    async for sandbox in modal.Sandbox.list.aio(app_id=app_id, tags=wanted, client=client):
        try:
            found.append((sandbox, await sandbox.get_tags.aio()))
        except modal.exception.NotFoundError:
            continue  # it ended in between
    return found


async def terminate(sandbox: modal.Sandbox) -> bool:
    """Terminate a sandbox; False when it had already ended."""
    try:
        await sandbox.terminate.aio()
        return True
    except modal.exception.NotFoundError:
        return False
    finally:
        try:
            await sandbox.detach.aio()
        except Exception:  # releasing a connection; nothing to act on
            pass


async def terminate_all(found: list[tuple[modal.Sandbox, dict]]) -> int:
    terminated = 0
    for sandbox, _tags in found:
        try:
            terminated += await terminate(sandbox)
        except modal.exception.Error as exc:
            log.warning("Could not terminate the Modal sandbox %s: %s", sandbox.object_id, exc)
    return terminated


async def lookup_app(client: modal.Client, name: str) -> Optional[str]:
    """The id of the app ``name``, or None when it does not exist."""
    try:
        app = await modal.App.lookup.aio(name, client=client)
    except modal.exception.NotFoundError:
        return None
    return app.app_id
