"""Which prompts of the dataset a session runs: the finished ones are found by content key and left out.

A fresh run has finished nothing.  A resume first repairs the run folder (an interrupted refilter's
files, records renumbered for a changed dataset or --batch_size, torn tails), then matches the digests of
the finished records against the dataset's row keys: one per row, or with --samples_per_prompt one per
sample.  Nothing here calls a model; the engine runs ``read_run_folder`` off the event loop.
"""

from __future__ import annotations

import logging
from typing import Union

from ..folder import offloop, reindex, rowkeys, unfinished
from ..folder.record_index import RecordIndex
from ..folder.runfolder import RunFolder
from . import samples
from .adaptive import Rule
from .checkpoint import Checkpoints, repair_torn_tails
from .config import RunConfig
from .plan import RunPlan

log = logging.getLogger("hermes_batch.run")

Match = Union[rowkeys.ResumeMatch, samples.SampleMatch]


def sampling(config: RunConfig) -> bool:
    """True when each row runs as several samples (--samples_per_prompt above 1)."""
    return config.per_row > 1


def nothing_finished(config: RunConfig, keys: rowkeys.RowKeys) -> Match:
    """The match of a run with no finished record: every valid row (every sample of it) runs."""
    if sampling(config):
        return samples.SampleMatch(None, 0, 0, total=samples.total_samples(keys, config.per_row,
                                                                          config.max_samples))
    return rowkeys.match_finished(keys, None)


def prompts_to_run(match: Match, config: RunConfig, plan: RunPlan) -> int:
    """How many prompts (samples) this session runs."""
    return match.to_run if sampling(config) else plan.dataset.valid - match.skipped


def read_run_folder(folder: RunFolder, config: RunConfig, plan: RunPlan, keys: rowkeys.RowKeys,
                    checkpoints: Checkpoints, index: RecordIndex) -> Match:
    """What a resume starts from, the folder repaired: the rows left, from the indexes and the row keys."""
    unfinished.recover_files(folder)  # an interrupted refilter's files, before anything reads them
    if reindex.recover(folder):  # it drops the indexes of the files it rewrote
        checkpoints.renumbered()
    repair_torn_tails(folder)
    _reindex(folder, config, plan, checkpoints)
    if sampling(config):
        adaptive = config.allocation == "adaptive"
        passed = samples.passed_digests(folder) if config.stop_on_success or adaptive else None
        rule = Rule(config.target_passes, config.max_failures) if adaptive else None
        match = samples.match(keys, index.finished_digests(), config.per_row, config.max_samples, passed, rule)
    else:
        match = rowkeys.match_finished(keys, index.finished_digests())
    size = config.batch_size
    checkpoints.completed_batches |= rowkeys.batches_finished(keys, match.left, size)
    if match.left is not None:  # a batch with a prompt to run again (it failed) is not complete
        checkpoints.not_complete(index // size for index in offloop.stoppable(match.left, 1 << 16))
    return match


def _reindex(folder: RunFolder, config: RunConfig, plan: RunPlan, checkpoints: Checkpoints) -> None:
    # prompt_index stays "the row of the current file": renumber the records if the file changed
    if not reindex.needs_check(folder, plan.dataset_fingerprint, config.batch_size):
        return
    if reindex.same_dataset(folder, plan.dataset_fingerprint):
        # only --batch_size changed: the records keep their prompt_index and move to their new batch files
        result = reindex.refile(folder, config.batch_size)
        log.info("--batch_size %d: %d record(s) moved to the batch files of that size.", config.batch_size, result.moved)
    else:
        result = reindex.reindex(folder, config.dataset_file, config.batch_size)
        reindex.warn(result)
    if result.rewritten:  # the records moved (their indexes were dropped with the old files)
        checkpoints.renumbered()
