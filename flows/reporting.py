"""`Reporter`: what the flow tells whoever watches a run (`lifecycle run`'s console, `lifecycle.console.RunConsole`).

The flow takes its reporter as an argument (`lifecycle_flow(..., reporter=...)`) and hands it to what reports.
This base class tells no one: served deployments and in-process callers get it.
"""

from __future__ import annotations


class Reporter:
    """Progress of a flow run. Stage names are strings; `stats` are a manifest's `stats` (rows_in, rows_kept,
    rows_rejected, rejected_by_reason, ...)."""

    def stage_started(self, stage: str) -> None:
        pass

    def shards_done(self, stage: str, done: int, total: int, stats: dict) -> None:
        """`done` of `total` shards are published; `stats` merges theirs."""

    def train_metrics(self, record: dict) -> None:
        """One new metrics.jsonl record of the training ranks (`kind` train, eval or rollback)."""

    def progress(self, stage: str, text: str) -> None:
        """Where a single-task stage is (evaluate: 'part 2/4: generation, 16 prompts')."""

    def stage_done(self, stage: str, outcome: str, stats: dict | None = None, detail: str = "") -> None:
        """`outcome`: computed, resumed or reused; `detail`: a short phrase for what is not in `stats`."""

    def note(self, text: str) -> None:
        """A line worth a reader's attention that belongs to no stage line (a warm start, nothing to do)."""
