"""More quality filters for hermes-batch (distribution hermes-batch-filters, entry point ``filters``).

Per-record filters (``--filter`` of ``run``, ``export`` and ``refilter``):
``max-tool-errors``, ``min-tool-calls``, ``final-answer``, ``repetition``, ``length``.
Whole-run filter (``export`` and ``refilter`` only): ``near-duplicates``.
Options follow ``--filter NAME[:OPTIONS]`` (see ``hermes_batch.contract.plugin_options``).
"""

import hermes_batch

from .near_duplicates import NearDuplicatesFilter
from .rules import FinalAnswerFilter, LengthFilter, MaxToolErrorsFilter, MinToolCallsFilter, RepetitionFilter

FILTERS = (MaxToolErrorsFilter, MinToolCallsFilter, FinalAnswerFilter, RepetitionFilter, LengthFilter, NearDuplicatesFilter)

__all__ = [cls.__name__ for cls in FILTERS]


@hermes_batch.hookimpl
def register_filters(register):
    for cls in FILTERS:
        register(cls)
