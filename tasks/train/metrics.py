"""Rank 0's metrics.jsonl: one JSON record per line (kind train, eval, rollback, restore, ...), read live by the
supervisor and forwarded to MLflow."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _record(line: str) -> dict | None:
    """A metrics line, or None for a blank or torn one (a SIGKILL can cut the last write short)."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


class Metrics:
    """Rank 0's metrics.jsonl; on start it drops records past the resume step (they belong to a lost run)."""

    def __init__(self, path: Path, resume_step: int, enabled: bool):
        self.path, self.enabled = path, enabled
        self.truncate(resume_step)

    def truncate(self, step: int) -> None:
        """Drop records past `step` (a rollback discards that part of the trajectory)."""
        if self.enabled and self.path.exists():
            keep = [line for line in self.path.read_text().splitlines() if (rec := _record(line)) is not None
                    and rec.get("step", 0) <= step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()), flush=True)
