"""collect's ledger `<workdir>/collected.parquet`: the raw files (path, sha256) completed runs collected, which an
incremental run skips (`new_inputs`); the flow appends to it when a run completes (`record_collected`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lifecycle.core.dataset import DatasetRef, RawFile
from lifecycle.core.fs import atomic_write_bytes

LEDGER = "collected.parquet"
LEDGER_SCHEMA = pa.schema([("path", pa.string()), ("sha256", pa.string()), ("bytes", pa.int64()),
                           ("collect_sha256", pa.string()), ("collected_at", pa.string())])


def read_ledger(workdir: str) -> pa.Table:
    p = Path(workdir) / LEDGER
    return pq.read_table(p) if p.exists() else LEDGER_SCHEMA.empty_table()


def _ledger_keys(ledger: pa.Table) -> set[tuple[str, str]]:
    return set(zip(ledger.column("path").to_pylist(), ledger.column("sha256").to_pylist()))


def new_inputs(inputs: list[RawFile], workdir: str) -> list[RawFile]:
    seen = _ledger_keys(read_ledger(workdir))
    return [r for r in inputs if (r.path, r.sha256) not in seen]


def record_collected(workdir: str, ref: DatasetRef) -> int:
    """Append the raw files of a completed run's collect dataset to the ledger (atomically); returns how
    many were new to it."""
    old = read_ledger(workdir)
    m = ref.manifest()
    seen = _ledger_keys(old)
    rows = [{**r, "collect_sha256": m["sha256"], "collected_at": m["created_at"]} for r in m["inputs"]
            if (r["path"], r["sha256"]) not in seen]
    if rows:
        table = pa.concat_tables([old, pa.Table.from_pylist(rows, schema=LEDGER_SCHEMA)])
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf)
        atomic_write_bytes(Path(workdir) / LEDGER, buf.getvalue().to_pybytes())
    return len(rows)
