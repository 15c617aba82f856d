"""dedup: exact duplicates over normalised text (one DuckDB query), then MinHash LSH near-duplicates,
within this run and, incrementally, against everything kept by earlier runs.

Two halves. The costly one is sharded: `plan_signatures` plans one shard per kept file of the parent, and
`signature_shard` writes, for every row in the parent's order, its doc_id, source_id, normalised-text hash
(`exact_hash`), MinHash signature and LSH band keys, into the `dedup-signatures` dataset (committed like any
sharded stage, so a killed run rebuilds only unfinished shards). The global half, `dedup`, reads the hashes
and band keys back, decides every row and writes the kept rows file by file. Its memory is one hash, doc_id and
`bands` keys per document; texts are read back only for candidate pairs when `verify_jaccard` is set.

Keep policy: within a cluster of duplicates, a document kept by an earlier dedup run (the persisted index)
wins; otherwise the document that comes first in the parent dataset's order (file order, then row order) is
kept; that order is the collect order of the raw inputs, so the earliest-seen copy survives. The kept row
records `cluster_id` (the kept document's `doc_id`) and `cluster_size` (copies in this run); every removed row
is rejected with reason `duplicate`, `duplicate_of` = the kept document's `doc_id` and `duplicate_kind` = `exact`
(same normalised text) or `near` (MinHash LSH); `detail` says both in words and, for a match in the index, names
the earlier dedup dataset that kept it. The stats count each kind (`counters`: `duplicate_exact`,
`duplicate_near`, and `duplicate_of_earlier_run` for matches in the index).

Signatures are `tasks.minhash.signatures` (vectorised, datasketch's permutations and `affine32` scheme); LSH
candidates are documents sharing one of `bands` band keys (`tasks.minhash.band_keys`, the rule of datasketch's
`MinHashLSH(params=(bands, rows))`). Near-duplicate clusters are connected components of candidate pairs
(union-find), with an optional check of the true Jaccard of the shingle sets before a pair is merged (against
the index, whose texts are not re-read, the check uses the signatures' Jaccard estimate).

Incremental index (`incremental=True`): the doc_id, normalised-text hash, band keys and signature of every kept
document are written into the dataset (`dedup-index.parquet`) and, after the dataset commit, published to
`<workdir>/dedup-index/<index-config-hash>/part-NNNNN.parquet` with `_index.json` written last (atomic renames,
under a file lock). A run is deduplicated against the parts published before the first part of its own parent
(all parts for a new parent), and the sha256 of that part list is part of the dataset fingerprint, so a cached
dataset is never reused against a different index and a rerun of the same inputs reproduces its dataset.
Limits: the index's band keys (8 bytes x bands per kept doc) are loaded into memory; two runs in flight at
once both dedup against the index as it was when they started, not against each other.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import re
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from datasketch import LeanMinHash, MinHash
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.dataset import (
    DatasetRef, DatasetWriter, StagePlan, StageStats, atomic_write_bytes, atomic_write_json, code_version,
    materialize, plan_per_file, rejected_table, run_plan, sha256_file, sha256_json,
)
from tasks import minhash as minhash_module

STAGE = "dedup"
SIG_STAGE = "dedup-signatures"  # the sharded first half: one signature file per parent file
INDEX_FILE = "dedup-index.parquet"  # the kept documents' index rows, inside the dataset
INDEX_MANIFEST = "_index.json"
REJECT_REASON = "duplicate"  # one reason for every removed copy; `duplicate_kind` says exact or near
DUPLICATE_KINDS = ("exact", "near")
REJECTED_FIELDS = [pa.field("duplicate_of", pa.string()), pa.field("duplicate_kind", pa.string())]
BATCH_DOCS = 4096  # documents per vectorised signature batch (memory ~ batch x words)
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
    incremental: bool = Field(
        True, description="Also drop duplicates of documents kept by earlier dedup runs in this work dir, and "
        "add this run's kept documents to that index (<workdir>/dedup-index/).")

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows


def shingles(text: str, n: int) -> set[bytes]:
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {" ".join(words).encode()} if words else set()
    return {" ".join(words[i : i + n]).encode() for i in range(len(words) - n + 1)}


def signature(sh: set[bytes], cfg: DedupConfig) -> LeanMinHash:
    """datasketch's own per-document signature (SHA-1 shingle hashes): the reference the benchmark compares
    against. The stage itself uses `tasks.minhash.signatures`."""
    m = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
    if sh:
        m.update_batch(list(sh))
    return LeanMinHash(m)


def duplicate_row(doc_id: str, source_id: str, kind: str, of: str, earlier: str | None) -> dict:
    """The rejected row of a removed copy: reason `duplicate`, its kind and the doc_id it duplicates."""
    detail = f"{kind} duplicate of {of}" + (f"; {earlier}" if earlier else "")
    return {"doc_id": doc_id, "source_id": source_id, "reason": REJECT_REASON, "detail": detail,
            "duplicate_of": of, "duplicate_kind": kind}


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


# --------------------------------------------------------------------------------------------------
# first half, sharded: per parent file, the normalised-text hash, signature and band keys of every row


class SignatureConfig(BaseModel):
    """What a signature file depends on (a `DedupConfig` minus the decisions made from the signatures)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    ngram: int
    bands: int
    rows: int
    seed: int
    minhash: bool = Field(description="Compute signatures and band keys (false: exact dedup only, hashes alone).")

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows


def signature_config(cfg: DedupConfig) -> SignatureConfig:
    return SignatureConfig(ngram=cfg.ngram, bands=cfg.bands, rows=cfg.rows, seed=cfg.seed,
                           minhash=cfg.near or cfg.incremental)


_EXACT_HASH = r"md5(regexp_replace(lower(trim(text)), '\s+', ' ', 'g'))"  # lower-case, collapsed whitespace


def signature_shard(cfg: SignatureConfig, files: list[str], writer) -> StageStats:
    """One signature file per parent file, rows in the parent's order: doc_id, source_id, exact_hash and,
    with `minhash`, the MinHash signature and its LSH band keys (`tasks.minhash`, one numba kernel)."""
    stats = StageStats()
    con = duckdb.connect()
    try:
        for path in files:
            t = con.sql(f"SELECT doc_id, source_id, {_EXACT_HASH} AS exact_hash, text FROM read_parquet($f, "
                        "file_row_number = true) ORDER BY file_row_number", params={"f": path}).to_arrow_table()
            text = t.column("text").combine_chunks()
            out = t.drop_columns(["text"])
            if cfg.minhash:
                sig = np.zeros((t.num_rows, cfg.num_perm), np.uint32)
                for start in range(0, t.num_rows, BATCH_DOCS):  # a signature does not depend on its batch
                    sig[start : start + BATCH_DOCS] = minhash_module.signatures(
                        text.slice(start, BATCH_DOCS), cfg.ngram, cfg.num_perm, cfg.seed)
                keys = minhash_module.band_keys(sig, cfg.bands, cfg.rows)
                out = out.append_column("band_keys", _fixed_list(keys, pa.uint64()))
                out = out.append_column("signature", _fixed_list(sig, pa.uint32()))
            writer.write_table(out)
            stats.rows_in += t.num_rows
            stats.rows_kept += t.num_rows
            stats.bytes_in += pc.sum(pc.binary_length(text)).as_py() or 0
    finally:
        con.close()
    return stats


def _fixed_list(a: np.ndarray, t: pa.DataType) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(a.ravel(), t), a.shape[1])


def _matrix(col: pa.ChunkedArray | pa.Array, width: int, dtype) -> np.ndarray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks else pa.array([], pa.list_(pa.uint8(), width))
    return col.flatten().to_numpy().astype(dtype, copy=False).reshape(-1, width) if len(col) else np.zeros((0, width), dtype)


def plan_signatures(parent: DatasetRef, cfg: DedupConfig, workdir: str) -> StagePlan | DatasetRef:
    """One shard per kept file of `parent` (the committed signature dataset instead if it exists)."""
    return plan_per_file(workdir, SIG_STAGE, signature_config(cfg), code_version(sys.modules[__name__], minhash_module),
                         parent, signature_shard)


# --------------------------------------------------------------------------------------------------
# second half, global: exact copies, LSH candidates, clusters, keep policy


def exact_order(sig_files: list[str]) -> pa.Table:
    """One DuckDB query over the signature files: every row in parent order, with its normalised-text hash, the
    doc_id of the first row that has the same normalised text (itself when it is the first) and its copy number."""
    if not sig_files:  # an empty parent has no files, and read_parquet needs at least one
        return pa.table({c: pa.array([], t) for c, t in (("doc_id", pa.string()), ("source_id", pa.string()),
                         ("h", pa.string()), ("first_doc_id", pa.string()), ("copy_no", pa.int64()))})
    con = duckdb.connect()
    try:
        return con.sql(
            """
            WITH docs AS (
                SELECT doc_id, source_id, file_row_number, exact_hash AS h,
                       list_position($files, filename) AS file_idx
                FROM read_parquet($files, filename = true, file_row_number = true)
            )
            SELECT doc_id, source_id, h,
                   first_value(doc_id) OVER w AS first_doc_id,
                   row_number() OVER w AS copy_no
            FROM docs
            WINDOW w AS (PARTITION BY h ORDER BY file_idx, file_row_number)
            ORDER BY file_idx, file_row_number
            """,
            params={"files": sig_files},
        ).to_arrow_table()
    finally:
        con.close()


def _take(files: list[str], counts: np.ndarray, rows: np.ndarray, column: str) -> dict[int, object]:
    """{global row: value of `column`} for the given global rows (parent order) of files holding `counts` rows."""
    ends = np.cumsum(counts)
    out: dict[int, object] = {}
    rows = np.unique(rows)
    for k, path in enumerate(files):
        mine = rows[(rows >= ends[k] - counts[k]) & (rows < ends[k])]
        if len(mine):
            col = pq.read_table(path, columns=[column]).column(column).take(pa.array(mine - (ends[k] - counts[k])))
            out.update(zip(mine.tolist(), col.to_pylist()))
    return out


def _bucket_pairs(keys: np.ndarray, all_pairs: bool = False) -> np.ndarray:
    """(p, 2) array of candidate pairs from the band buckets holding more than one document, over all bands:
    (member, first member) for each bucket, which is enough for connected components, or every pair in the
    bucket when each pair is verified before it is merged."""
    out = [np.zeros((0, 2), np.int64)]
    for b in range(keys.shape[1]):
        order = np.argsort(keys[:, b], kind="stable")
        s = keys[order, b]
        start = np.r_[True, s[1:] != s[:-1]] if len(s) else np.zeros(0, bool)
        gid = np.cumsum(start) - 1
        first = order[start][gid]
        m = order != first
        if not all_pairs:
            out.append(np.stack([order[m], first[m]], axis=1))
            continue
        starts = np.flatnonzero(start)
        sizes = np.diff(np.r_[starts, len(s)])
        for g in np.flatnonzero(sizes > 1):
            members = order[starts[g] : starts[g] + sizes[g]]
            out.append(np.array(list(itertools.combinations(members, 2)), np.int64))
    return np.unique(np.concatenate(out), axis=0)


# --------------------------------------------------------------------------------------------------
# the persisted index of kept documents (incremental dedup)


class Index:
    """The index parts an incremental run deduplicates against (loaded lazily, column by column)."""

    def __init__(self, directory: Path, parts: list[dict]):
        self.dir, self.parts = directory, parts
        self.state = sha256_json([(p["path"], p["sha256"]) for p in parts])
        for p in parts:  # the state names these bytes: refuse a part that changed or vanished
            if not (directory / p["path"]).exists() or sha256_file(directory / p["path"]) != p["sha256"]:
                raise RuntimeError(f"dedup index {directory / p['path']}: missing or not the sha256 in "
                                   f"{directory / INDEX_MANIFEST}; remove the index or restore the file")
        tables = [pq.read_table(directory / p["path"], columns=["doc_id", "exact_hash", "band_keys"]) for p in parts]
        self.part_of = np.concatenate([np.full(t.num_rows, k) for k, t in enumerate(tables)] or [np.zeros(0, int)])
        self.doc_ids = [d for t in tables for d in t.column("doc_id").to_pylist()]
        self.exact_hash = [h for t in tables for h in t.column("exact_hash").to_pylist()]
        self._keys = tables
        self._sig: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.doc_ids)

    def keys(self, bands: int) -> np.ndarray:
        cols = [t.column("band_keys").combine_chunks() for t in self._keys]
        return np.concatenate([c.flatten().to_numpy().reshape(-1, bands) for c in cols] or [np.zeros((0, bands), np.uint64)])

    def signatures(self, num_perm: int) -> np.ndarray:
        if self._sig is None:
            cols = [pq.read_table(self.dir / p["path"], columns=["signature"]).column("signature").combine_chunks()
                    for p in self.parts]
            self._sig = np.concatenate([c.flatten().to_numpy().reshape(-1, num_perm) for c in cols]
                                       or [np.zeros((0, num_perm), np.uint32)])
        return self._sig

    def dataset_of(self, node: int) -> str:
        p = self.parts[int(self.part_of[node])]
        return f"kept by an earlier run: datasets/{STAGE}/{p['dataset'][:20]}"


def index_dir(workdir: str | Path, cfg: DedupConfig) -> Path:
    """One index per signature-compatible configuration (shingles, permutations, banding, signature code)."""
    key = sha256_json({"ngram": cfg.ngram, "bands": cfg.bands, "rows": cfg.rows, "seed": cfg.seed,
                       "minhash": code_version(minhash_module)})
    return Path(workdir) / "dedup-index" / key[:16]


@contextmanager
def _locked(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_parts(directory: Path) -> list[dict]:
    m = directory / INDEX_MANIFEST
    if not m.exists():
        return []
    return json.loads(m.read_text())["parts"]


def base_parts(parts: list[dict], parent: DatasetRef) -> list[dict]:
    """The parts a run over `parent` deduplicates against: those published before the first part of the same
    parent (so a rerun reproduces its dataset and never dedups against itself), else all of them."""
    for k, p in enumerate(parts):
        if p["parent_sha256"] == parent.sha256:
            return parts[:k]
    return parts


def publish(ref: DatasetRef, parent: DatasetRef, cfg: DedupConfig, workdir: str | Path) -> None:
    """Append a committed dataset's kept documents to the index (once): part file first, `_index.json` last."""
    directory = index_dir(workdir, cfg)
    with _locked(directory):
        parts = _read_parts(directory)
        if any(p["dataset"] == ref.fingerprint for p in parts):
            return
        src = ref.dir / INDEX_FILE
        name = f"part-{len(parts):05d}.parquet"
        atomic_write_bytes(directory / name, src.read_bytes())
        parts.append({"path": name, "sha256": sha256_file(directory / name), "num_rows": ref.num_rows,
                      "dataset": ref.fingerprint, "dataset_path": str(ref.dir), "parent_sha256": parent.sha256,
                      "base_state": ref.manifest()["config"].get("index_state")})
        atomic_write_json(directory / INDEX_MANIFEST, {"config": cfg.model_dump(mode="json"), "parts": parts})


# --------------------------------------------------------------------------------------------------
# the stage


def dedup(parent: DatasetRef, cfg: DedupConfig, writer: DatasetWriter, sigs: DatasetRef,
          index: Index | None = None) -> StageStats:
    """The global half: decide every row of `parent` from its signature dataset `sigs` (one file per parent
    file, same rows in the same order) and write kept rows, rejected rows and the index rows."""
    files = [str(p) for p in parent.files()]
    sig_files = [str(p) for p in sigs.files()]
    if len(sig_files) != len(files):
        raise RuntimeError(f"{sigs.dir}: {len(sig_files)} signature files for {len(files)} files of {parent.dir}")
    counts = np.array([e["num_rows"] for e in sigs.manifest()["files"]], dtype=np.int64)
    stats = StageStats()
    rejected: list[dict] = []
    # 1. exact: decided globally in DuckDB over the hashes (and against the index's normalised-text hashes)
    order = exact_order(sig_files)
    n = order.num_rows
    m = len(index) if index is not None else 0  # union-find nodes: index docs 0..m-1, then this run's docs
    doc_ids = order.column("doc_id").to_pylist()
    first_ids = order.column("first_doc_id").to_pylist()
    hashes = order.column("h").to_pylist()
    copy_no = order.column("copy_no").to_numpy()
    exact_dup = (copy_no > 1) if cfg.exact else np.zeros(n, dtype=bool)
    exact_idx = np.full(n, -1)  # index node this doc is an exact copy of
    if cfg.exact and m:
        first_node: dict[str, int] = {}
        for node, h in enumerate(index.exact_hash):
            first_node.setdefault(h, node)
        exact_idx = np.array([first_node.get(h, -1) for h in hashes], dtype=np.int64)
        exact_dup |= exact_idx >= 0

    # 2. LSH band keys of the exact survivors (computed by the shards)
    survivors = np.flatnonzero(~exact_dup)
    keys = np.zeros((len(survivors), cfg.bands), np.uint64)
    if cfg.near and len(survivors):
        keys = np.concatenate([_matrix(pq.read_table(f, columns=["band_keys"]).column("band_keys"), cfg.bands,
                                       np.uint64) for f in sig_files])[survivors]

    # 3. near: connected components of candidate pairs, this run's docs and the index's
    uf = _UnionFind(m + n)
    if cfg.near:
        pairs = _bucket_pairs(keys, all_pairs=cfg.verify_jaccard is not None)  # positions in `survivors`
        shingle_sets: dict[int, set[bytes]] = {}
        if cfg.verify_jaccard is not None and len(pairs):  # texts of the candidates only, read back
            texts = _take(files, counts, survivors[np.unique(pairs)], "text")
            shingle_sets = {i: shingles(t, cfg.ngram) for i, t in texts.items()}
        for a, b in pairs:
            va, vb = m + int(survivors[a]), m + int(survivors[b])
            if cfg.verify_jaccard is not None:
                if uf.find(va) == uf.find(vb):
                    continue
                sa, sb = shingle_sets[va - m], shingle_sets[vb - m]
                if len(sa & sb) / max(1, len(sa | sb)) < cfg.verify_jaccard:
                    continue
            uf.union(va, vb)
        if m and len(survivors):
            ik = index.keys(cfg.bands)
            matches = []  # (survivor position, index node)
            for b in range(cfg.bands):
                o = np.argsort(ik[:, b], kind="stable")
                s = ik[o, b]
                lo, hi = np.searchsorted(s, keys[:, b], "left"), np.searchsorted(s, keys[:, b], "right")
                matches += [(a, int(node)) for a in np.flatnonzero(hi > lo) for node in o[lo[a] : hi[a]]]
            mine = {}
            if cfg.verify_jaccard is not None and matches:  # the index's texts are not kept: signature estimate
                mine = _take(sig_files, counts, survivors[np.unique([a for a, _ in matches])], "signature")
            for a, node in matches:
                if cfg.verify_jaccard is not None and np.mean(
                        index.signatures(cfg.num_perm)[node] == np.array(mine[int(survivors[a])])) < cfg.verify_jaccard:
                    continue
                uf.union(node, m + int(survivors[a]))
    roots = np.array([uf.find(v) for v in range(m + n)], dtype=np.int64)

    # 4. write kept rows (with cluster ids) and rejected rows, in parent order
    # cluster size of a kept doc = its exact copies + its near-duplicates' exact copies (this run's rows)
    copies = Counter(first_ids) if cfg.exact else Counter(doc_ids)
    weight = np.zeros(m + n, dtype=np.int64)
    weight[m:] = [0 if exact_dup[j] else copies[doc_ids[j]] for j in range(n)]
    cluster_size = np.bincount(roots, weights=weight, minlength=m + n).astype(np.int64)
    source_ids = order.column("source_id").to_pylist()
    index_rows = []  # the kept docs' signature rows, for the index
    i = 0
    for path, sig_path in zip(files, sig_files):
        t = pq.read_table(path)
        keep_mask = []
        cluster_ids, cluster_sizes = [], []
        for row in range(t.num_rows):
            stats.rows_in += 1
            assert t.column("doc_id")[row].as_py() == doc_ids[i], "parent order changed under dedup"
            root = roots[m + i]
            if exact_dup[i] or root != m + i:
                kind, node = ("exact", int(exact_idx[i])) if exact_dup[i] else ("near", int(root) if root < m else -1)
                of = index.doc_ids[node] if node >= 0 else (first_ids[i] if kind == "exact" else doc_ids[root - m])
                rejected.append(duplicate_row(doc_ids[i], source_ids[i], kind, of,
                                              index.dataset_of(node) if node >= 0 else None))
                stats.rejected[REJECT_REASON] += 1
                stats.counters[f"duplicate_{kind}"] += 1
                if node >= 0:
                    stats.counters["duplicate_of_earlier_run"] += 1
                keep_mask.append(False)
            else:
                keep_mask.append(True)
                cluster_ids.append(doc_ids[i])
                cluster_sizes.append(int(cluster_size[m + i]))
                stats.rows_kept += 1
            i += 1
        mask = pa.array(keep_mask, type=pa.bool_())
        kept = t.filter(mask)
        kept = kept.append_column("cluster_id", pa.array(cluster_ids, pa.string()))
        kept = kept.append_column("cluster_size", pa.array(cluster_sizes, pa.int32()))
        stats.bytes_in += sum(len(s.encode()) for s in t.column("text").to_pylist())
        stats.bytes_out += sum(len(s.encode()) for s in kept.column("text").to_pylist())
        if kept.num_rows:
            writer.write_table(kept)
        if cfg.incremental:
            index_rows.append(pq.read_table(sig_path, columns=["doc_id", "exact_hash", "band_keys", "signature"])
                              .filter(mask))
    if rejected:
        writer.write_table(rejected_table(rejected, STAGE, REJECTED_FIELDS), kind="rejected")
    if cfg.incremental:
        schema = pa.schema([("doc_id", pa.string()), ("exact_hash", pa.string()),
                            ("band_keys", pa.list_(pa.uint64(), cfg.bands)),
                            ("signature", pa.list_(pa.uint32(), cfg.num_perm))])
        writer.write_table(pa.concat_tables(index_rows) if index_rows else schema.empty_table(), kind="extra",
                           name=INDEX_FILE)
    return stats


def run_dedup(parent: DatasetRef, cfg: DedupConfig, workdir: str, signatures: DatasetRef | None = None) -> DatasetRef:
    """Dedup `parent` into a committed `dedup` dataset. `signatures`: its committed signature dataset (the flow
    builds it shard by shard on its task runner); built here, one shard after another, when not given."""
    if signatures is None:
        signatures = run_plan(plan_signatures(parent, cfg, workdir))
    code = code_version(sys.modules[__name__], minhash_module)
    extra = {"signatures": {"stage": signatures.stage, "sha256": signatures.sha256,
                            "manifest": str(signatures.manifest_path)}}
    if not cfg.incremental:
        return materialize(workdir, STAGE, cfg, code,
                           lambda w: {"stats": dedup(parent, cfg, w, signatures), "extra": extra}, parents=[parent])
    directory = index_dir(workdir, cfg)
    with _locked(directory):
        index = Index(directory, base_parts(_read_parts(directory), parent))
    # the index state is part of the fingerprint: a dataset is reused only against the same index
    fp_config = {**cfg.model_dump(mode="json"), "index_state": index.state}
    ref = materialize(workdir, STAGE, fp_config, code,
                      lambda w: {"stats": dedup(parent, cfg, w, signatures, index), "extra": extra}, parents=[parent])
    publish(ref, parent, cfg, workdir)
    return ref
