"""Verification's first step, ending the session's processes, where a sandbox cannot: said once per kind of sandbox."""

from __future__ import annotations

import logging

from hermes_batch.errors import SandboxError
from hermes_batch.session import verification


class CannotStop:
    async def stop_processes(self):
        return False


class Broken:
    async def stop_processes(self):
        raise SandboxError("the container is gone")


async def test_a_sandbox_that_cannot_stop_its_processes_is_warned_about_once(caplog, monkeypatch):
    monkeypatch.setattr(verification, "_said_cannot_stop", set())
    with caplog.at_level(logging.WARNING, logger="hermes_batch.prompt"):
        await verification._stop_processes(CannotStop())
        await verification._stop_processes(CannotStop())
        await verification._stop_processes(Broken())  # the verifiers' own commands fail and say it: logged, not raised
    said = [r.getMessage() for r in caplog.records]
    assert sum("CannotStop cannot end the processes" in m for m in said) == 1
    assert any("the container is gone" in m for m in said)
