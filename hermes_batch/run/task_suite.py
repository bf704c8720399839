"""``--tasks DIR``: a folder of Harbor task folders as the dataset of ``{"task": PATH}`` rows it stands for."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..folder.durable import atomic_write_text
from ..formats.task_folders import find_tasks


def suite_dataset(tasks: Path, output_dir: Path, run_name: str) -> Path:
    """The dataset file of the suite ``tasks`` (one row per task folder, sorted by name), written beside the run
    folders as ``.tasks/RUN_NAME-DIGEST.jsonl``: the same suite gives the same file, which a resume reads again."""
    lines = "".join(json.dumps({"task": path}) + "\n" for path in find_tasks(os.fspath(tasks))).encode()
    folder = Path(output_dir) / ".tasks"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run_name}-{hashlib.sha256(lines).hexdigest()[:12]}.jsonl"
    if not path.exists():
        atomic_write_text(path, lines.decode())
    return path
