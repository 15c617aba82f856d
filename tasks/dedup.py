"""dedup: exact duplicates over normalised text (one DuckDB query), then MinHash LSH near-duplicates.

Keep policy: within a cluster of duplicates, the document that comes first in the parent dataset's
order (file order, then row order) is kept; that order is the collect order of the raw inputs, so the
earliest-seen copy survives. The kept row records `cluster_id` (the kept document's `doc_id`) and
`cluster_size`; every removed row is rejected with reason `exact_duplicate` or `near_duplicate` and
`duplicate_of` = the kept document's `doc_id`.

Near-duplicate clusters are connected components of LSH candidate pairs (union-find), with an optional
check of the true Jaccard similarity of the shingle sets before a pair is merged.
"""

from __future__ import annotations

import re
import sys
from collections import Counter

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from datasketch import LeanMinHash, MinHash, MinHashLSH
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.dataset import DatasetRef, DatasetWriter, StageStats, code_version, materialize, rejected_table

STAGE = "dedup"
_WORD = re.compile(r"\w+", re.UNICODE)


class DedupConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    exact: bool = Field(True, description="Drop exact duplicates of the normalised text (lowercase, collapsed whitespace).")
    near: bool = Field(True, description="Drop MinHash LSH near-duplicates.")
    ngram: int = Field(5, ge=1, description="Word n-gram size of the shingles (FineWeb: 5).")
    bands: int = Field(14, ge=1, description="LSH bands (FineWeb: 14 bands x 8 rows = 112 permutations).")
    rows: int = Field(8, ge=1, description="LSH rows per band.")
    seed: int = Field(1, description="Seed of the MinHash permutations.")
    verify_jaccard: float | None = Field(
        None, ge=0, le=1, description="If set, merge a candidate pair only when its true shingle Jaccard is >= this."
    )

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows


def shingles(text: str, n: int) -> set[bytes]:
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {" ".join(words).encode()} if words else set()
    return {" ".join(words[i : i + n]).encode() for i in range(len(words) - n + 1)}


def signature(sh: set[bytes], cfg: DedupConfig) -> LeanMinHash:
    m = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
    if sh:
        m.update_batch(list(sh))
    return LeanMinHash(m)


class _UnionFind:
    def __init__(self, n: int):
        self.parent = np.arange(n)

    def find(self, i: int) -> int:
        p = self.parent
        while p[i] != i:
            p[i] = p[p[i]]
            i = p[i]
        return i

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:  # the smaller index (earlier document) is the root, so it is the one kept
            self.parent[max(ra, rb)] = min(ra, rb)


def exact_order(files: list[str]) -> pa.Table:
    """One DuckDB query over the parent's files: every row in parent order, with the doc_id of the first
    row that has the same normalised text (itself when it is the first) and its copy number."""
    con = duckdb.connect()
    try:
        return con.sql(
            r"""
            WITH docs AS (
                SELECT doc_id, source_id, file_row_number,
                       list_position($files, filename) AS file_idx,
                       md5(regexp_replace(lower(trim(text)), '\s+', ' ', 'g')) AS h
                FROM read_parquet($files, filename = true, file_row_number = true)
            )
            SELECT doc_id, source_id,
                   first_value(doc_id) OVER w AS first_doc_id,
                   row_number() OVER w AS copy_no
            FROM docs
            WINDOW w AS (PARTITION BY h ORDER BY file_idx, file_row_number)
            ORDER BY file_idx, file_row_number
            """,
            params={"files": files},
        ).to_arrow_table()
    finally:
        con.close()


def dedup(parent: DatasetRef, cfg: DedupConfig, writer: DatasetWriter) -> StageStats:
    files = [str(p) for p in parent.files()]
    stats = StageStats()
    rejected: list[dict] = []
    # 1. exact: decided globally in DuckDB
    order = exact_order(files)
    n = order.num_rows
    doc_ids = order.column("doc_id").to_pylist()
    first_ids = order.column("first_doc_id").to_pylist()
    copy_no = order.column("copy_no").to_numpy()
    exact_dup = (copy_no > 1) if cfg.exact else np.zeros(n, dtype=bool)

    # 2. near: MinHash LSH over the exact survivors, read file by file
    uf = _UnionFind(n)
    if cfg.near:
        lsh = MinHashLSH(num_perm=cfg.num_perm, params=(cfg.bands, cfg.rows))
        sigs: dict[int, LeanMinHash] = {}
        shingle_sets: dict[int, set[bytes]] = {}
        i = 0
        for path in files:
            for text in pq.read_table(path, columns=["text"]).column("text").to_pylist():
                if not exact_dup[i]:
                    sh = shingles(text, cfg.ngram)
                    sigs[i] = signature(sh, cfg)
                    if cfg.verify_jaccard is not None:
                        shingle_sets[i] = sh
                    lsh.insert(i, sigs[i], check_duplication=False)
                i += 1
        for i, sig in sigs.items():
            for j in lsh.query(sig):
                if j == i:
                    continue
                if cfg.verify_jaccard is not None:
                    a, b = shingle_sets[i], shingle_sets[j]
                    if len(a & b) / max(1, len(a | b)) < cfg.verify_jaccard:
                        continue
                uf.union(i, j)
    roots = np.array([uf.find(i) for i in range(n)], dtype=np.int64)

    # 3. write kept rows (with cluster ids) and rejected rows, in parent order
    # cluster size of a kept doc = its exact copies + its near-duplicates' exact copies
    copies = Counter(first_ids) if cfg.exact else Counter(doc_ids)
    weight = np.array([0 if exact_dup[j] else copies[doc_ids[j]] for j in range(n)], dtype=np.int64)
    cluster_size = np.bincount(roots, weights=weight, minlength=n).astype(np.int64)
    source_ids = order.column("source_id").to_pylist()
    i = 0
    for path in files:
        t = pq.read_table(path)
        keep_mask = []
        cluster_ids, cluster_sizes = [], []
        for row in range(t.num_rows):
            stats.rows_in += 1
            assert t.column("doc_id")[row].as_py() == doc_ids[i], "parent order changed under dedup"
            if exact_dup[i]:
                rejected.append({"doc_id": doc_ids[i], "source_id": source_ids[i],
                                 "reason": "exact_duplicate", "detail": None, "duplicate_of": first_ids[i]})
                stats.rejected["exact_duplicate"] += 1
                keep_mask.append(False)
            elif roots[i] != i:
                rep = doc_ids[roots[i]]
                rejected.append({"doc_id": doc_ids[i], "source_id": source_ids[i],
                                 "reason": "near_duplicate", "detail": None, "duplicate_of": rep})
                stats.rejected["near_duplicate"] += 1
                keep_mask.append(False)
            else:
                keep_mask.append(True)
                cluster_ids.append(doc_ids[i])
                cluster_sizes.append(int(cluster_size[i]))
                stats.rows_kept += 1
            i += 1
        kept = t.filter(pa.array(keep_mask, type=pa.bool_()))
        kept = kept.append_column("cluster_id", pa.array(cluster_ids, pa.string()))
        kept = kept.append_column("cluster_size", pa.array(cluster_sizes, pa.int32()))
        stats.bytes_in += sum(len(s.encode()) for s in t.column("text").to_pylist())
        stats.bytes_out += sum(len(s.encode()) for s in kept.column("text").to_pylist())
        if kept.num_rows:
            writer.write_table(kept)
    if rejected:
        writer.write_table(rejected_table(rejected, STAGE, [pa.field("duplicate_of", pa.string())]), kind="rejected")
    return stats


def run_dedup(parent: DatasetRef, cfg: DedupConfig, workdir: str) -> DatasetRef:
    def build(writer: DatasetWriter) -> dict:
        return {"stats": dedup(parent, cfg, writer)}

    return materialize(workdir, STAGE, cfg, code_version(sys.modules[__name__]), build, parents=[parent])
