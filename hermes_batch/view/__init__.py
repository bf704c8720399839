"""Seeing a run: ``report.html`` and ``hermes-batch view``, over a streamed index of the run folder.

The report and the viewer share their rendering (:mod:`.render`, charts drawn
as SVG by :mod:`.charts`) and their numbers (:mod:`.summary`, from the index
of :mod:`.index`).
"""

from __future__ import annotations

from .index import RunIndex
from .report import REPORT_NAME, write_report

__all__ = ["REPORT_NAME", "RunIndex", "write_report"]
