"""What the store cannot answer: runs recorded without a page ledger.

Which pages a response read, and whose bytes were in them, is known only where the engine recorded
its page reads and writes. A run (or a whole store) without that ledger answers every page-level
question with nothing - and nothing is not "no exposure". Every reader (the CLI, the report, the
dashboard) names such runs with the one sentence below, and says what the spans still answer.
"""
from __future__ import annotations

from typing import NamedTuple

PAGE_LEVEL = ("exposures", "scores", "tenant_scores", "tenants", "runs")   # answers that need the page ledger
SPANS_STILL = "its spans still answer impact (billed over the pool), ttft (below the prefill floor) and usage honesty"


class Coverage(NamedTuple):
    runs: int                   # kvledger runs in scope
    without_ledger: list[str]   # their boot ids, oldest first

    @property
    def none(self) -> bool:
        """No run in scope recorded a ledger: a page-level answer is wholly unknown."""
        return self.runs > 0 and len(self.without_ledger) == self.runs

    def sentences(self) -> list[str]:
        return [unanswerable(b) for b in self.without_ledger]


def unanswerable(boot: str) -> str:
    return (f"page-level exposure cannot be answered for run {boot}: no page ledger was recorded; "
            f"{SPANS_STILL}")


def coverage(runs) -> Coverage:
    """From the ``runs`` query's rows or a backend's ``page_ledgers()`` (``page_ledger`` per boot)."""
    import polars as pl
    if not runs.height or "page_ledger" not in runs.columns:
        return Coverage(runs.height, [])
    return Coverage(runs.height, runs.filter(~pl.col("page_ledger").fill_null(True))["boot"].to_list())
