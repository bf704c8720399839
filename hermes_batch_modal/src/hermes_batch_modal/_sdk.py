"""The ``modal`` SDK, imported on first use.

Importing it takes about a second of CPU; every ``hermes-batch`` command loads the
installed plugins, so only the runs and commands that use Modal should pay for it.
"""

from __future__ import annotations


class _OnFirstUse:
    def __getattr__(self, name: str):
        import modal
        import modal.config
        import modal.exception

        return getattr(modal, name)


modal = _OnFirstUse()
