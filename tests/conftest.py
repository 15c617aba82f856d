import gzip
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORPUS = sorted((ROOT / "corpus" / "python-docs").glob("*.jsonl.gz"))

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def corpus_records(n: int) -> list[dict]:
    """The first n records of the bundled (real, human-written) corpus."""
    out = []
    with gzip.open(CORPUS[0], "rt", encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) == n:
                break
    return out


@pytest.fixture
def lifecycle_cmd():
    return [sys.executable, "-m", "lifecycle.cli"]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long fault-injection runs; skipped unless LIFECYCLE_SLOW=1")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LIFECYCLE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with LIFECYCLE_SLOW=1 .venv/bin/python -m pytest -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def make_collect(workdir, tables, fixture: str = "tests"):
    """A committed `collect` dataset holding the given document tables (one Parquet file each)."""
    from lifecycle.core.dataset import StageStats, materialize

    def build(writer):
        for t in tables:
            writer.write_table(t)
        n = sum(t.num_rows for t in tables)
        return {"stats": StageStats(rows_in=n, rows_kept=n)}

    return materialize(workdir, "collect", {"fixture": fixture}, "test", build)
