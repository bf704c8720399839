"""provider_guard.json: the providers the guard excluded, kept in the run folder so a --resume excludes them too.

The file is read back, so it is not trusted: a plain file of at most ``MAX_BYTES``, each entry checked
(``provider_guard.exclusions_from_state``); anything else stops the resume with one sentence.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from ..errors import HermesBatchError, RunFolderError
from ..folder.durable import atomic_write_text, write_error
from ..folder.readback import read_small
from ..folder.runfolder import RunFolder
from ..model.provider_guard import Exclusion, ProviderGuard, exclusions_from_state

log = logging.getLogger("hermes_batch.run")

GUARD_FILE = "provider_guard.json"
MAX_BYTES = 256 * 1024


def load(folder: RunFolder) -> list[Exclusion]:
    """The exclusions of the run's earlier sessions ([] when none)."""
    path = folder.dir / GUARD_FILE
    advice = "move it away to run every provider again, or run the same command again"
    try:
        data = read_small(path, MAX_BYTES, advice=advice)
        if data is None:
            return []
        return exclusions_from_state(json.loads(data))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise RunFolderError(f"{path} is not what a run writes ({exc}); {advice}.") from None


def save(folder: RunFolder, guard: ProviderGuard) -> None:
    """Write the guard's exclusions (atomically: a kill leaves the old file or the new one)."""
    path = folder.dir / GUARD_FILE
    try:
        atomic_write_text(path, json.dumps({"excluded": [e.as_dict() for e in guard.exclusions]}, indent=2) + "\n")
    except OSError as exc:
        raise write_error(path, exc) from exc


def make_guard(config, folder: RunFolder, client) -> Optional[ProviderGuard]:
    """The run's guard, with the exclusions a resume keeps, saved to the folder as it makes new ones; None with
    --no_provider_guard."""
    if not config.provider_guard:
        return None
    excluded = load(folder) if config.resume else []
    guard = ProviderGuard(active=client.excludes_providers(), excluded=excluded)
    if excluded:
        log.warning("The provider guard of earlier sessions excluded %s; they stay excluded (remove %s from the run "
                    "folder to try them again).", ", ".join(guard.excluded), GUARD_FILE)

    def on_exclude(_exclusion) -> None:
        try:  # a few hundred bytes, rarely: written at once, so a kill right after still keeps it
            save(folder, guard)
        except HermesBatchError as exc:  # the run goes on; only a resume would try the provider again
            log.warning("%s", exc)

    guard.on_exclude = on_exclude
    return guard
