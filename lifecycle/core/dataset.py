"""Datasets on disk: a directory of Parquet files whose `_manifest.json` is written last.

Every stage output is one dataset directory, named by a content fingerprint of its inputs' sha256,
the stage config and the stage's code. A committed manifest with that fingerprint means the stage is
done: that one mechanism gives resumption, caching and lineage.

Commit protocol (see `DatasetWriter.commit`): every file is written to a temporary name, fsynced and
renamed; the manifest is written the same way, last; then the whole temporary directory is renamed to
its final fingerprint name. A directory without `_manifest.json` is never read.

Nothing on disk is trusted because it exists (README "Operations: failures"):
- reuse (`find_committed`, hence `materialize`, `plan_stage`, `commit_plan`) checks the manifest parses and names
  this fingerprint, every file's size, and every file's sha256 unless the file's stat signature (size, mtime,
  ctime, inode) is the one recorded the last time its sha256 matched (`.verified-<name>.json` beside the
  dataset: a file written to since, even with its mtime put back, has a new ctime and is hashed again);
- whole-file reads (`read_parquet`: `DatasetRef.read`, `map_tables`, dedup) hash the bytes they read and compare
  them with the manifest; every Parquet file is written with page CRCs and read with them verified;
- a damaged dataset is moved aside to `<workdir>/damaged/<stage>/<name>-<time>/` with a warning naming the file
  and what failed, and rebuilt. `lifecycle verify` re-hashes everything (`verify_dataset`).
Those checks live in lifecycle/core/integrity.py; this module re-exports them.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict
from lifecycle.core.fs import sha256_file, fsync_path, atomic_write_json
from lifecycle.core.integrity import (  # the manifest and its checks; re-exported: callers import them from here
    DAMAGED_DIR as DAMAGED_DIR,
    MANIFEST,
    SCHEMA_VERSION,
    DatasetDamaged as DatasetDamaged,
    canonical_json as canonical_json,
    committed_datasets as committed_datasets,
    load_manifest,
    open_parquet as open_parquet,
    quarantine,
    read_parquet,
    sha256_json,
    verify_dataset,
)

# Columns every document dataset carries, from collect on. Later stages add columns
# (dedup: cluster_id, cluster_size; scrub: pii_<type> counts) and never drop these.
DOC_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),  # stable: sha256(source_id, raw text)[:16], assigned by collect
        ("source_id", pa.string()),  # the input's `id`, or `file:line` when it has none
        ("text", pa.string()),
        ("source", pa.string()),  # input `source` field, else the input file path
        ("url", pa.string()),
        ("meta", pa.string()),  # other input fields, as a JSON object
    ]
)

# Columns every rejected-rows file carries (stages may add more, e.g. `duplicate_of`).
REJECTED_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("source_id", pa.string()),
        ("stage", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]
)


class AccountingError(RuntimeError):
    """Rows in != rows kept + rows rejected for a stage."""


# --------------------------------------------------------------------------------------------------
# stats


@dataclass
class StageStats:
    """Funnel numbers of one stage. Merge partial stats (per shard) with `+`."""

    rows_in: int = 0
    rows_kept: int = 0
    rejected: Counter = field(default_factory=Counter)
    bytes_in: int = 0
    bytes_out: int = 0
    counters: Counter = field(default_factory=Counter)

    def __add__(self, other: "StageStats") -> "StageStats":
        return StageStats(
            self.rows_in + other.rows_in,
            self.rows_kept + other.rows_kept,
            self.rejected + other.rejected,
            self.bytes_in + other.bytes_in,
            self.bytes_out + other.bytes_out,
            self.counters + other.counters,
        )

    @classmethod
    def from_dict(cls, d: dict) -> "StageStats":
        return cls(d["rows_in"], d["rows_kept"], Counter(d["rejected_by_reason"]), d["bytes_in"], d["bytes_out"],
                   Counter(d.get("counters", {})))

    @property
    def rows_rejected(self) -> int:
        return sum(self.rejected.values())

    def to_dict(self) -> dict:
        return {
            "rows_in": self.rows_in,
            "rows_kept": self.rows_kept,
            "rows_rejected": self.rows_rejected,
            "rejected_by_reason": dict(sorted(self.rejected.items())),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            **({"counters": dict(sorted(self.counters.items()))} if self.counters else {}),
        }


# --------------------------------------------------------------------------------------------------
# references passed between tasks


class RawFile(BaseModel):
    """A raw input file, identified by its full sha256."""

    model_config = ConfigDict(frozen=True)
    path: str
    """The file's name as text (`tasks/data/collect/inputs.py` `shown`: bytes that are not UTF-8 as `\\xNN`)."""
    sha256: str
    bytes: int
    path_bytes: str | None = None
    """Hex of the name's raw bytes, only when they are not UTF-8 (`path` is then an escaped form)."""


class DatasetRef(BaseModel):
    """What tasks pass to each other: where a committed dataset is and what it is. Never the rows."""

    model_config = ConfigDict(frozen=True)
    stage: str
    path: str
    fingerprint: str
    sha256: str
    num_rows: int
    reused: bool = False

    @property
    def dir(self) -> Path:
        return Path(self.path)

    @property
    def manifest_path(self) -> Path:
        return Path(self.path) / MANIFEST

    def manifest(self) -> dict:
        return load_manifest(self.dir)

    def files(self, kind: str = "files") -> list[Path]:
        return [Path(self.path) / f["path"] for f in self.manifest()[kind]]

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """All kept rows as one table (small datasets and tests; stages should stream `files()`). Each file's
        bytes are checked against the manifest's sha256 as they are read (`read_parquet`)."""
        paths = self.files()
        if not paths:
            return pa.table({})
        return pa.concat_tables([read_parquet(p, columns=columns) for p in paths])

    def read_rejected(self) -> pa.Table:
        paths = self.files("rejected")
        if not paths:
            return REJECTED_SCHEMA.empty_table()
        return pa.concat_tables([read_parquet(p) for p in paths], promote_options="default")

    @classmethod
    def from_dir(cls, path: str | Path, reused: bool = False) -> "DatasetRef":
        m = load_manifest(path)
        return cls(
            stage=m["stage"],
            path=str(Path(path).resolve()),
            fingerprint=m["fingerprint"],
            sha256=m["sha256"],
            num_rows=m["num_rows"],
            reused=reused,
        )


def fingerprint(stage: str, config: Any, code: str, parents: Iterable[DatasetRef] = (), inputs: Iterable[RawFile] = ()) -> str:
    return sha256_json(
        {
            "stage": stage,
            "schema": SCHEMA_VERSION,
            "code": code,
            "config": config.model_dump(mode="json") if isinstance(config, BaseModel) else config,
            # a parent counts by its fingerprint (which code and config made it) and its content
            "parents": [(p.fingerprint, p.sha256) for p in parents],
            "inputs": [(r.path, r.sha256) + ((r.path_bytes,) if r.path_bytes else ()) for r in inputs],
        }
    )


def dataset_dir(workdir: str | Path, stage: str, fp: str) -> Path:
    return Path(workdir) / "datasets" / stage / fp[:20]


def find_committed(workdir: str | Path, stage: str, fp: str) -> DatasetRef | None:
    """The committed dataset of this fingerprint if its files match its manifest; None when there is none (or
    it was damaged: then it is moved aside with a warning, and the caller rebuilds it)."""
    d = dataset_dir(workdir, stage, fp)
    if not (d / MANIFEST).exists():
        return None
    problems = verify_dataset(d, fingerprint=fp, full=False)
    if problems:
        quarantine(d, problems)
        return None
    return DatasetRef.from_dir(d, reused=True)


# --------------------------------------------------------------------------------------------------
# writing


class _FileWriter:
    """Writes Parquet (and other) files into `self.tmp`, fsyncs each and records (path, sha256, bytes, rows)."""

    tmp: Path

    def __init__(self) -> None:
        self._entries: dict[str, list[dict]] = {"files": [], "rejected": [], "extra": []}

    def _register(self, kind: str, rel: str, num_rows: int | None) -> None:
        p = self.tmp / rel
        entry = {"path": rel, "sha256": sha256_file(p), "bytes": p.stat().st_size}
        if num_rows is not None:
            entry["num_rows"] = num_rows
        self._entries[kind].append(entry)

    def write_table(self, table: pa.Table, kind: str = "files", name: str | None = None) -> None:
        """Write one Parquet file (kind: files = kept rows, rejected = rejected rows, extra)."""
        n = len(self._entries[kind])
        rel = name or f"{'part' if kind == 'files' else kind}-{n:05d}.parquet"
        path = self.tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, compression="zstd", write_page_checksum=True)
        fsync_path(path)
        self._register(kind, rel, table.num_rows)

    def add_file(self, rel: str, kind: str = "extra", num_rows: int | None = None) -> Path:
        """Register a non-Parquet file the caller already wrote under `self.tmp / rel` (fsynced here)."""
        path = self.tmp / rel
        fsync_path(path)
        self._register(kind, rel, num_rows)
        return path

    def path(self, rel: str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class DatasetWriter(_FileWriter):
    """Builds one dataset in a temporary directory and commits it atomically."""

    def __init__(self, workdir: str | Path, stage: str, fp: str, tmp: Path | None = None):
        """`tmp`: build in this directory and keep what is already there (the shards of a sharded stage);
        by default a fresh private directory."""
        super().__init__()
        self.stage = stage
        self.fingerprint = fp
        self.final = dataset_dir(workdir, stage, fp)
        if tmp is None:
            # leftovers of a killed build of the same dataset (the work-dir lock rules out a live one)
            for stale in self.final.parent.glob(f".tmp-{self.final.name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = self.final.with_name(f".tmp-{self.final.name}-{os.getpid()}")
        self.tmp = tmp
        self.tmp.mkdir(parents=True, exist_ok=True)

    def commit(
        self,
        *,
        config: Any,
        code: str,
        parents: Iterable[DatasetRef] = (),
        inputs: Iterable[RawFile] = (),
        stats: StageStats | None = None,
        num_rows: int | None = None,
        extra: dict | None = None,
    ) -> DatasetRef:
        kept_rows = sum(e.get("num_rows", 0) for e in self._entries["files"]) if num_rows is None else num_rows
        rejected_rows = sum(e.get("num_rows", 0) for e in self._entries["rejected"])
        if stats is not None:
            if stats.rows_kept != kept_rows or stats.rows_rejected != rejected_rows:
                raise AccountingError(
                    f"{self.stage}: stats say kept={stats.rows_kept} rejected={stats.rows_rejected}, "
                    f"files hold kept={kept_rows} rejected={rejected_rows}"
                )
            if stats.rows_in != stats.rows_kept + stats.rows_rejected:
                raise AccountingError(
                    f"{self.stage}: rows in ({stats.rows_in}) != kept ({stats.rows_kept}) + rejected "
                    f"({stats.rows_rejected})"
                )
        content = sha256_json({k: [(e["path"], e["sha256"]) for e in v] for k, v in self._entries.items()})
        parents = list(parents)
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "stage": self.stage,
            "fingerprint": self.fingerprint,
            "sha256": content,
            "num_rows": kept_rows,
            "num_rejected": rejected_rows,
            **self._entries,
            "parents": [
                {"stage": p.stage, "fingerprint": p.fingerprint, "sha256": p.sha256, "manifest": str(p.manifest_path)}
                for p in parents
            ],
            "inputs": [r.model_dump(exclude_none=True) for r in inputs],
            "config": config.model_dump(mode="json") if isinstance(config, BaseModel) else config,
            "code_version": code,
            "stats": stats.to_dict() if stats is not None else None,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **(extra or {}),
        }
        atomic_write_json(self.tmp / MANIFEST, manifest)
        if self.final.exists():  # a leftover without a manifest (crash before the rename) or a racing twin
            if (self.final / MANIFEST).exists():
                shutil.rmtree(self.tmp)
                return DatasetRef.from_dir(self.final, reused=True)
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)
        fsync_path(self.final.parent)
        return DatasetRef.from_dir(self.final)


def materialize(
    workdir: str | Path,
    stage: str,
    config: Any,
    code: str,
    build: Callable[[DatasetWriter], dict],
    parents: Iterable[DatasetRef] = (),
    inputs: Iterable[RawFile] = (),
) -> DatasetRef:
    """Return the committed dataset for (stage, config, code, parents, inputs), building it if needed.

    `build(writer)` writes the files and returns keyword arguments for `writer.commit` (stats, extra...).
    """
    parents, inputs = list(parents), list(inputs)
    fp = fingerprint(stage, config, code, parents, inputs)
    done = find_committed(workdir, stage, fp)
    if done is not None:
        return done
    writer = DatasetWriter(workdir, stage, fp)
    try:
        commit_kwargs = build(writer) or {}
        return writer.commit(config=config, code=code, parents=parents, inputs=inputs, **commit_kwargs)
    except BaseException:
        writer.abort()
        raise


def rejected_table(rows: list[dict], stage: str, extra_fields: list[pa.Field] = ()) -> pa.Table:
    schema = REJECTED_SCHEMA
    for f in extra_fields:
        schema = schema.append(f)
    cols = {name: [r.get(name) for r in rows] for name in schema.names}
    cols["stage"] = [stage] * len(rows)
    return pa.table(cols, schema=schema)
