"""dedup: exact duplicates over normalised text (one DuckDB query), then MinHash LSH near-duplicates,
within this run and, incrementally, against everything kept by earlier runs.

Two halves. The costly one is sharded (`SIGNATURES`, a per-file stage): it plans one shard per kept file of the
parent, and `signature_shard` writes, for every row in the parent's order, its doc_id, source_id, normalised-text hash
(`exact_hash`), MinHash signature and LSH band keys, into the `dedup-signatures` dataset (committed like any
sharded stage, so a killed run rebuilds only unfinished shards). The global half, `dedup`, decides every row in
DuckDB over those files (`decide`): exact copies by a window over the hashes, LSH buckets by grouping the
unnested band keys, connected components by large-star/small-star rounds over the candidate edges
(`components`), then one `decision` table; it runs in a scratch database beside the dataset under a memory
limit (`memory_limit`, `orchestration.dedup_memory_limit`, default 2GB) and spills past it, so its memory does
not grow with the corpus. Kept rows, rejected rows and index rows are then written one parent file at a time.

Keep policy: within a cluster of duplicates, a document kept by an earlier dedup run (the persisted index)
wins; otherwise the document that comes first in the parent dataset's order (file order, then row order) is
kept; that order is the collect order of the raw inputs, so the earliest-seen copy survives. The kept row
records `cluster_id` (the kept document's `doc_id`) and `cluster_size` (copies in this run); every removed row
is rejected with reason `duplicate`, `duplicate_of` = the kept document's `doc_id` and `duplicate_kind` = `exact`
(same normalised text) or `near` (MinHash LSH); `detail` says both in words and, for a match in the index, names
the earlier dedup dataset that kept it. The stats count each kind (`counters`: `duplicate_exact`,
`duplicate_near`, and `duplicate_of_earlier_run` for matches in the index).

Signatures are `lifecycle.tasks.data.dedup.minhash.signatures` (vectorised, datasketch's permutations and `affine32` scheme); LSH
candidates are documents sharing one of `minhash.bands` band keys (`lifecycle.tasks.data.dedup.minhash.band_keys`, the rule of datasketch's
`MinHashLSH(params=(bands, rows))`). Near-duplicate clusters are connected components of the graph that links
each member of a bucket to the bucket's smallest node (this run's rows and the index's kept documents; index
documents are not linked to each other). With `verify_jaccard`, every pair sharing a bucket is checked before
it becomes an edge: the true Jaccard of the two shingle sets for two documents of this run (texts streamed from
DuckDB in batches), the signatures' Jaccard estimate against the index (whose texts are not kept).

Incremental index (`incremental=True`): the doc_id, normalised-text hash, band keys and signature of every kept
document are written into the dataset (`dedup-index.parquet`) and, after the dataset commit, published to
`<workdir>/dedup-index/<index-config-hash>/part-NNNNN.parquet` with `_index.json` written last (atomic renames,
under a file lock). A run is deduplicated against the parts published before the first part of its own parent
(all parts for a new parent), and the sha256 of that part list is part of the dataset fingerprint, so a cached
dataset is never reused against a different index and a rerun of the same inputs reproduces its dataset.
Limit: two runs in flight at once both dedup against the index as it was when they started, not against each
other.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from lifecycle.core.code import code_version
from lifecycle.core.dataset import (
    DatasetRef, DatasetWriter, StageStats, materialize, read_parquet, rejected_table, sha256_json,
)
from lifecycle.core.shards import PerFileStage, StageCode
from lifecycle.core.fs import atomic_write_bytes, atomic_write_json, sha256_file
from lifecycle.tasks.data.dedup import paragraphs as para
from lifecycle.tasks.data.dedup import substring as sub
from lifecycle.tasks.data.dedup.history import base_parts, collected_incrementally, locked as _locked
from lifecycle.tasks.data.dedup.paragraphs import ParagraphConfig
from lifecycle.tasks.data.dedup.params import MinHashConfig, SimHashConfig
from lifecycle.tasks.data.dedup.substring import SubstringConfig

NAME = "dedup"
SIG_STAGE = "dedup-signatures"  # the sharded first half: one signature file per parent file
INDEX_FILE = "dedup-index.parquet"  # the kept documents' index rows, inside the dataset
INDEX_MANIFEST = "_index.json"
REJECT_REASON = para.REJECT_REASON  # one reason for every removed copy; `duplicate_kind` says which step
DUPLICATE_KINDS = ("exact", "near", "paragraph", "substring")
BLOOM_FILE = para.BLOOM_FILE  # the paragraph Bloom filter after this run, inside the dataset
REJECTED_FIELDS = [pa.field("duplicate_of", pa.string()), pa.field("duplicate_kind", pa.string())]
DUCKDB_MEMORY = "2GB"  # the global half's DuckDB memory limit (it spills to disk beyond it)
BATCH_DOCS = 4096  # documents per vectorised signature batch (memory ~ batch x words)
_WORD = re.compile(r"\w+", re.UNICODE)

if TYPE_CHECKING:
    from datasketch import LeanMinHash


class DedupConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["minhash", "simhash"] = Field(
        "minhash", description="Near-duplicate method (`near`): MinHash LSH (`minhash`) or 64-bit SimHash with "
        "permuted-table blocking (`simhash`). See docs/dedup.md.")
    minhash: MinHashConfig = Field(MinHashConfig(), description="MinHash settings (shingles, permutations, bands, "
                                   "verify_jaccard), used when method is minhash; tombstones record them.")
    simhash: SimHashConfig = Field(SimHashConfig(), description="SimHash settings, used when method is simhash.")
    paragraphs: ParagraphConfig = Field(ParagraphConfig(), description="Paragraph-level exact dedup with a "
                                        "Bloom filter, after document dedup (tasks/data/dedup/paragraphs.py).")
    substring: SubstringConfig = Field(SubstringConfig(), description="Exact-substring dedup with suffix arrays "
                                       "(Lee et al. 2022), after paragraph dedup (tasks/data/dedup/substring.py).")

    exact: bool = Field(True, description="Drop exact duplicates of the normalised text (lowercase, collapsed whitespace).")
    near: bool = Field(True, description="Drop near-duplicates (`method`).")
    incremental: bool = Field(
        True, description="Also drop duplicates of documents kept by earlier dedup runs in this work dir, and "
        "add this run's kept documents to that index (<workdir>/dedup-index/).")

    @model_validator(mode="before")
    @classmethod
    def _minhash_section(cls, data):
        """The MinHash settings were top-level fields before they became the `minhash` section: name the new one."""
        moved = [k for k in MinHashConfig.model_fields if isinstance(data, dict) and k in data]
        if moved:
            raise PydanticCustomError("moved_field", "{old} moved into the `dedup.minhash` section: write {new}", {
                "old": ", ".join(f"`dedup.{k}`" for k in moved),
                "new": ", ".join(f"`dedup.minhash.{k}`" for k in moved)})
        return data


def fingerprint_config(cfg: DedupConfig) -> dict:
    """The config part of the dedup dataset's fingerprint: the method fields only where they are in use, so the
    default (MinHash, no paragraphs, no substrings) fingerprints exactly as before they existed. `substring.shard_bytes`
    never enters it: it changes no result. The `minhash` section's fields stand at the top, where they were before
    it was a section."""
    d = cfg.model_dump(mode="json")
    d.update(d.pop("minhash"))
    if cfg.method == "minhash":
        del d["method"]
    if cfg.method != "simhash":
        del d["simhash"]
    if not cfg.paragraphs.enabled:
        del d["paragraphs"]
    if cfg.substring.enabled:
        del d["substring"]["shard_bytes"]
    else:
        del d["substring"]
    return d


def shingles(text: str, n: int) -> set[bytes]:
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {" ".join(words).encode()} if words else set()
    return {" ".join(words[i : i + n]).encode() for i in range(len(words) - n + 1)}


def signature(sh: set[bytes], p: MinHashConfig) -> LeanMinHash:
    """datasketch's own per-document signature (SHA-1 shingle hashes): the reference the benchmark compares
    against. The stage itself uses `lifecycle.tasks.data.dedup.minhash.signatures`."""
    from datasketch import LeanMinHash, MinHash  # here, not at the top: datasketch imports scipy (seconds)

    m = MinHash(num_perm=p.num_perm, seed=p.seed)
    if sh:
        m.update_batch(list(sh))
    return LeanMinHash(m)


def duplicate_row(doc_id: str, source_id: str, kind: str, of: str | None, earlier: str | None,
                  method: str | None = None) -> dict:
    """The rejected row of a removed copy: reason `duplicate`, its kind and the doc_id it duplicates; `method`
    (e.g. "simhash, hamming <= 3") is named in the detail when it is not the default MinHash."""
    detail = f"{kind} duplicate of {of}" + (f" ({method})" if method else "") + (f"; {earlier}" if earlier else "")
    return {"doc_id": doc_id, "source_id": source_id, "reason": REJECT_REASON, "detail": detail,
            "duplicate_of": of, "duplicate_kind": kind}


# --------------------------------------------------------------------------------------------------
# first half, sharded: per parent file, the normalised-text hash, signature and band keys of every row


class SignatureConfig(BaseModel):
    """What a signature file depends on (a `DedupConfig` minus the decisions made from the signatures)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    params: MinHashConfig = Field(description="`dedup.minhash`, without `verify_jaccard` (a decision).")
    minhash: bool = Field(description="Compute signatures and band keys (false: exact dedup only, hashes alone).")
    simhash: SimHashConfig | None = Field(None, description="Compute SimHashes and their table keys instead.")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """As fingerprinted before `dedup.minhash` was a section: its signature fields at the top, beside the
        `minhash` flag; no `simhash` key without SimHash."""
        d = handler(self)
        d = {**self.params.signature_fields(), **{k: v for k, v in d.items() if k != "params"}}
        if d.get("simhash", 0) is None:
            del d["simhash"]
        return d


def signature_config(cfg: DedupConfig) -> SignatureConfig:
    need = cfg.near or cfg.incremental
    return SignatureConfig(params=cfg.minhash.model_copy(update={"verify_jaccard": None}),
                           minhash=need and cfg.method == "minhash",
                           simhash=cfg.simhash if need and cfg.method == "simhash" else None)


_EXACT_HASH = r"md5(regexp_replace(lower(trim(text)), '\s+', ' ', 'g'))"  # lower-case, collapsed whitespace


def warm_signatures(cfg: SignatureConfig) -> None:
    """Load numba and the compiled MinHash kernel once in the worker, before its shard processes fork
    (`lifecycle.core.shards.warm_worker`), instead of once in each (about 1 s)."""
    if cfg.minhash:
        from lifecycle.tasks.data.dedup import minhash as minhash_module

        p = cfg.params
        minhash_module.signatures(["warm up the kernel"], p.ngram, p.num_perm, p.seed)


def signature_shard(cfg: SignatureConfig, files: list[str], writer) -> StageStats:
    """One signature file per parent file, rows in the parent's order: doc_id, source_id, exact_hash and,
    with `minhash`, the MinHash signature and its LSH band keys (`lifecycle.tasks.data.dedup.minhash`, one numba kernel)."""
    from lifecycle.tasks.data.dedup import minhash as minhash_module  # numba: only where signatures are computed

    stats = StageStats()
    con = duckdb.connect()
    try:
        for path in files:
            t = con.sql(f"SELECT doc_id, source_id, {_EXACT_HASH} AS exact_hash, text FROM read_parquet($f, "
                        "file_row_number = true) ORDER BY file_row_number", params={"f": path}).to_arrow_table()
            text = t.column("text").combine_chunks()
            out = t.drop_columns(["text"])
            if cfg.minhash:
                p = cfg.params
                sig = np.zeros((t.num_rows, p.num_perm), np.uint32)
                for start in range(0, t.num_rows, BATCH_DOCS):  # a signature does not depend on its batch
                    sig[start : start + BATCH_DOCS] = minhash_module.signatures(
                        text.slice(start, BATCH_DOCS), p.ngram, p.num_perm, p.seed)
                keys = minhash_module.band_keys(sig, p.bands, p.rows)
                out = out.append_column("band_keys", _fixed_list(keys, pa.uint64()))
                out = out.append_column("signature", _fixed_list(sig, pa.uint32()))
            if cfg.simhash is not None:
                from lifecycle.tasks.data.dedup import simhash as simhash_module

                sh = cfg.simhash
                h = np.concatenate([simhash_module.simhashes(text.slice(s, BATCH_DOCS), sh.ngram)
                                    for s in range(0, t.num_rows, BATCH_DOCS)] or [np.zeros(0, np.uint64)])
                keys = simhash_module.table_keys(h, sh.k, sh.blocks)
                out = out.append_column("band_keys", _fixed_list(keys.reshape(len(h), -1), pa.uint64()))
                out = out.append_column("simhash", pa.array(h.view(np.int64), pa.int64()))
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


def _signature_config(parent: DatasetRef, cfg: DedupConfig) -> SignatureConfig:
    return signature_config(cfg)


# the sharded half: one signature file per kept file of the parent (small files grouped in a shard)
SIGNATURES = PerFileStage(SIG_STAGE, __package__, signature_shard, warm=warm_signatures, config=_signature_config)
plan_signatures = SIGNATURES.plan


# --------------------------------------------------------------------------------------------------
# the persisted index of kept documents (incremental dedup)


class Index:
    """The index parts an incremental run deduplicates against (read by DuckDB, never loaded whole).

    `match_own_doc_ids`: whether an index row with the doc_id of one of this run's rows counts as a copy of it.
    A doc_id is the hash of (source_id, text): the same document, not a copy. When collect re-reads every input
    (`collect.incremental: false`) a rerun after any upstream change (a filter threshold, a tombstone, a code
    upgrade) reaches dedup with the documents the last run kept: they are this run's corpus again, not
    duplicates of it, so those index rows are left out. An incremental collect reads only new or changed files,
    and a document it meets again was delivered again: it stays a duplicate of the run that kept it."""

    def __init__(self, directory: Path, parts: list[dict], match_own_doc_ids: bool = True):
        self.dir, self.parts, self.match_own_doc_ids = directory, parts, match_own_doc_ids
        self.state = sha256_json([(p["path"], p["sha256"]) for p in parts])
        for p in parts:  # the state names these bytes: refuse a part that changed or vanished
            if not (directory / p["path"]).exists() or sha256_file(directory / p["path"]) != p["sha256"]:
                raise RuntimeError(f"dedup index {directory / p['path']}: missing or not the sha256 in "
                                   f"{directory / INDEX_MANIFEST}; remove the index or restore the file")
        self.paths = [str(directory / p["path"]) for p in parts]
        self.counts = [pq.ParquetFile(p).metadata.num_rows for p in self.paths]
        self.num_rows = sum(self.counts)

    def __len__(self) -> int:
        return self.num_rows

    def dataset_of(self, part: int) -> str:
        return f"kept by an earlier run: datasets/{NAME}/{self.parts[part]['dataset'][:20]}"


MINHASH_SOURCE = Path(__file__).with_name("minhash.py")  # the signature code (not imported here: numba)
SIMHASH_SOURCE = Path(__file__).with_name("simhash.py")


def index_dir(workdir: str | Path, cfg: DedupConfig) -> Path:
    """One index per signature-compatible configuration (shingles, permutations, banding, signature code; for
    SimHash its settings and code)."""
    if cfg.method == "simhash":
        key = sha256_json({"method": "simhash", **cfg.simhash.model_dump(mode="json"),
                           "code": hashlib.sha256(MINHASH_SOURCE.read_bytes() + SIMHASH_SOURCE.read_bytes()).hexdigest()})
        return Path(workdir) / "dedup-index" / key[:16]
    key = sha256_json({**cfg.minhash.signature_fields(),
                       "minhash": hashlib.sha256(MINHASH_SOURCE.read_bytes()).hexdigest()})
    return Path(workdir) / "dedup-index" / key[:16]


def _read_parts(directory: Path) -> list[dict]:
    m = directory / INDEX_MANIFEST
    if not m.exists():
        return []
    return json.loads(m.read_text())["parts"]


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
# second half, global: exact copies, LSH candidates, clusters, keep policy -- all in DuckDB, which spills to
# disk past its memory limit, so this half's memory does not grow with the corpus. Every document is a node:
# the index's kept documents 0..m-1 (parts in order), then this run's rows m.. in parent order, so "the
# smallest node of a cluster" is the keep policy.


def _files_table(con: duckdb.DuckDBPyConnection, name: str, files: list[str], counts: list[int], base: int) -> None:
    """A small table (file, file_idx, base): global node of row r of file k = base_k + r."""
    starts = base + np.concatenate([[0], np.cumsum(counts, dtype=np.int64)[:-1]]).astype(np.int64)
    con.register(f"{name}_arrow", pa.table({"file": pa.array(files, pa.string()),
                                            "file_idx": pa.array(range(len(files)), pa.int32()),
                                            "base": pa.array(starts, pa.int64())}))
    con.execute(f"CREATE TABLE {name} AS SELECT * FROM {name}_arrow")
    con.unregister(f"{name}_arrow")


def _nodes(files_table: str, files: list[str], columns: str) -> str:
    """SQL: the rows of `files` (listed in `files_table`) with their global node, file_idx and row."""
    listed = "[" + ", ".join("'" + f.replace("'", "''") + "'" for f in files) + "]"
    return (f"SELECT f.base + s.file_row_number AS node, f.file_idx, s.file_row_number AS row, {columns} "
            f"FROM read_parquet({listed}, filename = true, file_row_number = true) s "
            f"JOIN {files_table} f ON s.filename = f.file")


def components(con: duckdb.DuckDBPyConnection) -> int:
    """Connected components of the undirected graph `edges(a, b)` (a > b) as `lab(node, l)`: l = the smallest
    node of the component, for every node on an edge. The large-star / small-star alternation of Kiveris et al.,
    "Connected Components in MapReduce and Beyond" (SoCC 2014): each step is one aggregate and one join over
    tables DuckDB can spill, it ends with every node linked to its component's minimum, in O(log^2 n) rounds
    (about log n in practice). Returns the rounds."""
    con.execute("CREATE OR REPLACE TABLE cc AS SELECT DISTINCT a, b FROM edges")
    rounds = 0
    while True:
        rounds += 1
        # large star: every larger neighbour of u links to the smallest node around u
        con.execute("""
            CREATE OR REPLACE TABLE cc2 AS
            WITH m AS (SELECT a AS u, min(b) AS m FROM cc GROUP BY a)
            SELECT DISTINCT e.a, coalesce(m.m, e.b) AS b FROM cc e LEFT JOIN m ON m.u = e.b""")
        # small star: u and its smaller neighbours link to the smallest of them
        con.execute("""
            CREATE OR REPLACE TABLE cc3 AS
            WITH m AS (SELECT a AS u, min(b) AS m FROM cc2 GROUP BY a)
            SELECT DISTINCT e.b AS a, m.m AS b FROM cc2 e JOIN m ON m.u = e.a WHERE e.b <> m.m
            UNION SELECT u, m FROM m""")
        changed = con.execute("SELECT (SELECT count(*) FROM (SELECT a, b FROM cc3 EXCEPT SELECT a, b FROM cc)) + "
                              "(SELECT count(*) FROM (SELECT a, b FROM cc EXCEPT SELECT a, b FROM cc3))").fetchone()[0]
        con.execute("DROP TABLE cc")
        con.execute("DROP TABLE cc2")
        con.execute("ALTER TABLE cc3 RENAME TO cc")
        if not changed:
            break
    con.execute("CREATE OR REPLACE TABLE lab AS SELECT a AS node, b AS l FROM cc "
                "UNION SELECT DISTINCT b, b FROM cc")
    con.execute("DROP TABLE cc")
    return rounds


def _verified_edges(con: duckdb.DuckDBPyConnection, cfg: DedupConfig, m: int, spill: Path) -> None:
    """`edges` = the candidate pairs (`pairs`) whose Jaccard is >= `verify_jaccard`: true shingle Jaccard of the
    two texts for a pair of this run's documents, the signatures' estimate against the index (whose texts are
    not kept). Pairs stream through in batches; the passing ones are written to a Parquet file in `spill`."""
    out = spill / "verified-edges.parquet"
    p = cfg.minhash
    schema = pa.schema([("a", pa.int64()), ("b", pa.int64())])
    with pq.ParquetWriter(out, schema) as w:
        queries = (
            ("SELECT p.a, p.b, x.text AS x, y.text AS y FROM pairs p JOIN texts x ON x.node = p.a "
             f"JOIN texts y ON y.node = p.b WHERE p.b >= {m}", "text"),
            ("SELECT p.a, p.b, x.signature AS x, y.signature AS y FROM pairs p JOIN sigs x ON x.node = p.a "
             f"JOIN index_sigs y ON y.node = p.b WHERE p.b < {m}", "signature"),
        )
        for sql, kind in queries:
            if kind == "signature" and not m:
                continue
            reader = con.sql(sql).to_arrow_reader(BATCH_DOCS)
            for batch in reader:
                if not batch.num_rows:
                    continue
                if kind == "text":
                    j = np.array([_jaccard(shingles(x, p.ngram), shingles(y, p.ngram)) for x, y in
                                  zip(batch.column("x").to_pylist(), batch.column("y").to_pylist())])
                else:
                    j = np.mean(_matrix(batch.column("x"), p.num_perm, np.uint32)
                                == _matrix(batch.column("y"), p.num_perm, np.uint32), axis=1)
                ok = pa.array(j >= p.verify_jaccard)
                w.write_table(pa.table({"a": batch.column("a"), "b": batch.column("b")}, schema=schema).filter(ok))
    con.execute("CREATE TABLE edges AS SELECT a, b FROM read_parquet($f)", {"f": str(out)})


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / max(1, len(a | b))


def decide(con: duckdb.DuckDBPyConnection, cfg: DedupConfig, files: list[str], sig_files: list[str],
           counts: list[int], index: Index | None, spill: Path) -> None:
    """Build the table `decision(node, file_idx, row, doc_id, source_id, kind, of_doc, part_idx, cluster_size)`,
    ordered by node: `kind` NULL (kept), 'exact' or 'near'; `of_doc` the doc_id a removed row duplicates and
    `part_idx` the index part that kept it (NULL: this run); `cluster_size` of a kept row."""
    m = index.num_rows if index is not None else 0
    _files_table(con, "sig_files", sig_files, counts, m)
    _files_table(con, "parent_files", files, counts, m)
    con.execute(f"CREATE TABLE docs AS {_nodes('sig_files', sig_files, 's.doc_id, s.source_id, s.exact_hash AS h')}")
    if m:
        _files_table(con, "index_files", index.paths, index.counts, 0)
        con.execute(f"CREATE TABLE idx AS {_nodes('index_files', index.paths, 's.doc_id, s.exact_hash AS h')}")
        if not index.match_own_doc_ids:  # this run's own documents, kept before: not copies of themselves
            con.execute("DELETE FROM idx WHERE doc_id IN (SELECT doc_id FROM docs)")
    else:
        con.execute("CREATE TABLE idx (node BIGINT, file_idx INT, row BIGINT, doc_id VARCHAR, h VARCHAR)")
    exact = "true" if cfg.exact else "false"
    # 1. exact: the first row (smallest node) with the same normalised text, here or in the index
    con.execute(f"""
        CREATE TABLE ex AS
        WITH g AS (SELECT node, h, min(node) OVER (PARTITION BY h) AS first_node,
                          count(*) OVER (PARTITION BY h) AS copies FROM docs),
             i AS (SELECT h, min(node) AS inode FROM idx GROUP BY h)
        SELECT g.node, {exact} AND (g.first_node <> g.node OR i.inode IS NOT NULL) AS dup,
               coalesce(i.inode, g.first_node) AS exact_of,
               -- a kept row's cluster_size counts this run's rows: its exact copies and its near duplicates'
               CASE WHEN NOT {exact} THEN 1 WHEN g.first_node = g.node AND i.inode IS NULL THEN g.copies ELSE 0
               END AS weight
        FROM g LEFT JOIN i USING (h)""")
    # 2. near: LSH buckets (band, key) of the exact survivors and the index; candidate edges
    if cfg.near:
        value = "s.simhash" if cfg.method == "simhash" else "s.signature"
        con.execute(f"CREATE VIEW sigs AS {_nodes('sig_files', sig_files, 's.band_keys, ' + value)}")
        con.execute(f"CREATE VIEW index_sigs AS SELECT * FROM ({_nodes('index_files', index.paths, 's.band_keys, ' + value)}) "
                    "WHERE node IN (SELECT node FROM idx)" if m else "CREATE VIEW index_sigs AS SELECT * FROM sigs WHERE false")
        con.execute("""
            CREATE TABLE bk AS
            SELECT node, generate_subscripts(band_keys, 1) AS band, unnest(band_keys) AS key
            FROM (SELECT s.node, s.band_keys FROM sigs s JOIN ex USING (node) WHERE NOT ex.dup
                  UNION ALL SELECT node, band_keys FROM index_sigs)""")
        if cfg.method == "simhash":  # every pair sharing a table key, kept when within Hamming distance k
            con.execute(f"""
                CREATE TABLE edges AS
                WITH pairs AS (SELECT DISTINCT x.node AS a, y.node AS b FROM bk x JOIN bk y
                                   ON x.band = y.band AND x.key = y.key AND y.node < x.node WHERE x.node >= {m}),
                     h AS (SELECT node, simhash FROM sigs UNION ALL SELECT node, simhash FROM index_sigs)
                SELECT p.a, p.b FROM pairs p JOIN h x ON x.node = p.a JOIN h y ON y.node = p.b
                WHERE bit_count(xor(x.simhash, y.simhash)) <= {cfg.simhash.k}""")
        elif cfg.minhash.verify_jaccard is None:  # every member to its bucket's smallest node: enough for components
            con.execute(f"""
                CREATE TABLE edges AS
                WITH buckets AS (SELECT band, key, min(node) AS first FROM bk GROUP BY band, key HAVING count(*) > 1)
                SELECT DISTINCT bk.node AS a, buckets.first AS b FROM bk JOIN buckets USING (band, key)
                WHERE bk.node <> buckets.first AND bk.node >= {m}""")
        else:  # every pair sharing a bucket (at least one of this run), each verified before it is merged
            con.execute(f"CREATE VIEW texts AS {_nodes('parent_files', files, 's.text')}")
            con.execute(f"""
                CREATE TABLE pairs AS
                SELECT DISTINCT x.node AS a, y.node AS b FROM bk x JOIN bk y
                    ON x.band = y.band AND x.key = y.key AND y.node < x.node
                WHERE x.node >= {m}""")
            _verified_edges(con, cfg, m, spill)
    else:
        con.execute("CREATE TABLE edges (a BIGINT, b BIGINT)")
    components(con)
    # 3. decisions, cluster sizes and the doc_id each removed row duplicates
    con.execute("""
        CREATE TABLE dec AS
        SELECT d.node, d.file_idx, d.row, d.doc_id, d.source_id, ex.weight,
               CASE WHEN ex.dup THEN 'exact' WHEN coalesce(lab.l, d.node) <> d.node THEN 'near' END AS kind,
               CASE WHEN ex.dup THEN ex.exact_of ELSE coalesce(lab.l, d.node) END AS of_node
        FROM docs d JOIN ex USING (node) LEFT JOIN lab USING (node)""")
    con.execute("""
        CREATE TABLE decision AS
        WITH sizes AS (SELECT of_node AS node, sum(weight) AS size FROM dec WHERE kind IS NULL OR kind = 'near'
                       GROUP BY of_node),
             named AS (SELECT node, doc_id, NULL::INT AS part_idx FROM docs
                       UNION ALL SELECT node, doc_id, file_idx FROM idx)
        SELECT dec.node, dec.file_idx, dec.row, dec.doc_id, dec.source_id, dec.kind,
               CASE WHEN dec.kind IS NOT NULL THEN named.doc_id END AS of_doc,
               CASE WHEN dec.kind IS NOT NULL THEN named.part_idx END AS part_idx,
               CASE WHEN dec.kind IS NULL THEN sizes.size::INT END AS cluster_size
        FROM dec LEFT JOIN named ON named.node = dec.of_node LEFT JOIN sizes ON sizes.node = dec.node
        ORDER BY dec.node""")
    for t in ("dec", "ex", "bk", "pairs", "edges", "lab", "docs"):
        con.execute(f"DROP TABLE IF EXISTS {t}")


# --------------------------------------------------------------------------------------------------
# the stage


def dedup(parent: DatasetRef, cfg: DedupConfig, writer: DatasetWriter, sigs: DatasetRef,
          index: Index | None = None, memory_limit: str = DUCKDB_MEMORY, bloom: para.Bloom | None = None,
          rereads: para.Rereads | None = None, report: dict | None = None) -> StageStats:
    """The global half: decide every row of `parent` from its signature dataset `sigs` (one file per parent
    file, same rows in the same order) in DuckDB (`decide`, at most `memory_limit`, spilling beyond it), then
    write kept rows, rejected rows and the index rows file by file: memory is one parent file at a time.
    With `bloom` (paragraph dedup on), the kept documents then lose their paragraphs seen before (`paragraphs`),
    in parent order, and the filter is written into the dataset (`BLOOM_FILE`). With `substring.enabled`, the kept
    documents of every file are set aside in the scratch directory while their text goes into the suffix arrays;
    once all are in, each file's kept rows lose their repeated spans (`substring`) and are written; `report` (a
    dict) then gets the suffix arrays' figures under "substring"."""
    method = f"simhash, hamming <= {cfg.simhash.k}" if cfg.method == "simhash" else None
    files = [str(p) for p in parent.files()]
    sig_files = [str(p) for p in sigs.files()]
    if len(sig_files) != len(files):
        raise RuntimeError(f"{sigs.dir}: {len(sig_files)} signature files for {len(files)} files of {parent.dir}")
    counts = [e["num_rows"] for e in sigs.manifest()["files"]]
    stats = StageStats()
    spill = Path(tempfile.mkdtemp(prefix=".spill-", dir=writer.tmp.parent))  # beside the dataset, never in it
    # a database file, not an in-memory one: its tables can leave memory, so memory_limit bounds the whole half
    con = duckdb.connect(str(spill / "dedup.duckdb"), config={
        "memory_limit": memory_limit, "temp_directory": str(spill / "duckdb"), "preserve_insertion_order": False})
    index_path = writer.path(INDEX_FILE)
    index_rows = 0
    index_schema = _index_schema(cfg)
    index_out = pq.ParquetWriter(index_path, index_schema, compression="zstd",
                                 write_page_checksum=True) if cfg.incremental else None
    suffixes = sub.SuffixDedup(spill / "substring", cfg.substring) if cfg.substring.enabled else None
    pending: list[tuple[Path, np.ndarray, str]] = []  # substring on: (kept rows set aside, keep mask, signature file)

    def emit(kept: pa.Table, rejected: list[dict], keep, sig_path: str) -> None:
        nonlocal index_rows
        stats.rows_kept += kept.num_rows
        if rejected:
            stats.rejected[REJECT_REASON] += len(rejected)
        stats.bytes_out += pc.sum(pc.binary_length(kept.column("text"))).as_py() or 0
        if kept.num_rows:
            writer.write_table(kept)
        if rejected:
            writer.write_table(rejected_table(rejected, NAME, REJECTED_FIELDS), kind="rejected")
        if index_out is not None:
            rows = pq.read_table(sig_path, columns=index_schema.names, page_checksum_verification=True).filter(keep)
            index_out.write_table(rows.cast(index_schema))
            index_rows += rows.num_rows

    try:
        if files:
            decide(con, cfg, files, sig_files, counts, index, spill)
        for k, (path, sig_path) in enumerate(zip(files, sig_files)):
            t = read_parquet(path)  # hashed against the parent manifest while read
            d = con.sql("SELECT doc_id, source_id, kind, of_doc, part_idx, cluster_size FROM decision "
                        "WHERE file_idx = $k ORDER BY row", params={"k": k}).to_arrow_table()
            if d.num_rows != t.num_rows or not d.column("doc_id").cast(pa.string()).equals(
                    t.column("doc_id").cast(pa.string())):
                raise RuntimeError(f"{path}: rows differ from its signature file {sig_path}; rebuild the signatures")
            keep = pc.is_null(d.column("kind"))
            kept = t.filter(keep)
            kept = kept.append_column("cluster_id", kept.column("doc_id"))
            kept = kept.append_column("cluster_size", d.column("cluster_size").filter(keep).cast(pa.int32()))
            rejected = []
            for r in d.filter(pc.invert(keep)).to_pylist():
                part = r["part_idx"]
                near = r["kind"] == "near"
                rejected.append(duplicate_row(r["doc_id"], r["source_id"], r["kind"], r["of_doc"],
                                              index.dataset_of(part) if part is not None else None,
                                              method if near else None))
                stats.counters["duplicate_simhash" if near and method else f"duplicate_{r['kind']}"] += 1
                if part is not None:
                    stats.counters["duplicate_of_earlier_run"] += 1
            if bloom is not None:
                kept, still, short = para.dedup_table(kept, bloom, cfg.paragraphs, stats, rereads)
                rejected += short
                mask = np.asarray(keep, dtype=bool).copy()  # final keep over the file's rows: index rows follow it
                mask[mask] = still
                keep = pa.array(mask)
            stats.rows_in += t.num_rows
            stats.bytes_in += pc.sum(pc.binary_length(t.column("text"))).as_py() or 0
            if suffixes is None:
                emit(kept, rejected, keep, sig_path)
                continue
            # substring dedup needs every file's text first: the rows rejected so far go out now, the kept wait
            if para.CUT_COLUMN not in kept.column_names:
                kept = kept.append_column(para.CUT_COLUMN, pa.array([[]] * kept.num_rows, para.CUT_TYPE))
            suffixes.add(kept.column("text"))
            stash = spill / "substring" / f"kept-{k:05d}.parquet"
            pq.write_table(kept, stash, compression="lz4")
            pending.append((stash, np.asarray(keep, dtype=bool).copy(), sig_path))
            if rejected:
                stats.rejected[REJECT_REASON] += len(rejected)
                writer.write_table(rejected_table(rejected, NAME, REJECTED_FIELDS), kind="rejected")
        if suffixes is not None:
            suffixes.build()
            for stash, mask, sig_path in pending:
                kept, still, short = sub.dedup_table(pq.read_table(stash), suffixes, cfg.substring, para.CUT_COLUMN,
                                                     para.CUT_TYPE, stats)
                stash.unlink()
                mask[mask] = still
                emit(kept, short, pa.array(mask), sig_path)
            if report is not None:
                report["substring"] = suffixes.report()
    finally:
        con.close()
        shutil.rmtree(spill, ignore_errors=True)
        if index_out is not None:
            index_out.close()
    if index_out is not None:
        writer.add_file(INDEX_FILE, num_rows=index_rows)
    else:
        index_path.unlink(missing_ok=True)
    if bloom is not None:
        atomic_write_bytes(writer.path(BLOOM_FILE), bloom.to_bytes())
        writer.add_file(BLOOM_FILE)
    return stats


def _index_schema(cfg: DedupConfig) -> pa.Schema:
    if cfg.method == "simhash":
        from lifecycle.tasks.data.dedup.simhash import num_tables

        return pa.schema([("doc_id", pa.string()), ("exact_hash", pa.string()),
                          ("band_keys", pa.list_(pa.uint64(), num_tables(cfg.simhash.k, cfg.simhash.blocks))),
                          ("simhash", pa.int64())])
    return pa.schema([("doc_id", pa.string()), ("exact_hash", pa.string()),
                      ("band_keys", pa.list_(pa.uint64(), cfg.minhash.bands)),
                      ("signature", pa.list_(pa.uint32(), cfg.minhash.num_perm))])


def run_dedup(parent: DatasetRef, cfg: DedupConfig, workdir: str, signatures: DatasetRef | None = None,
              memory_limit: str = DUCKDB_MEMORY) -> DatasetRef:
    """Dedup `parent` into a committed `dedup` dataset. `signatures`: its committed signature dataset (the flow
    builds it shard by shard on its task runner); built here, one shard after another, when not given.
    `memory_limit`: DuckDB's limit for the global half (not part of the fingerprint: it changes no decision).
    Paragraph dedup (`paragraphs.enabled`) starts from the published filter when `incremental`, from an empty
    one otherwise; its state is part of the fingerprint like the index's."""
    if signatures is None:
        signatures = SIGNATURES.run(parent, cfg, workdir)
    code = code_version(__package__)
    extra = {"signatures": {"stage": signatures.stage, "sha256": signatures.sha256,
                            "manifest": str(signatures.manifest_path)}}
    fp_config = fingerprint_config(cfg)
    index = bloom = rereads = None
    incremental_collect = collected_incrementally(parent) if cfg.incremental else False
    if cfg.incremental:
        directory = index_dir(workdir, cfg)
        with _locked(directory):
            index = Index(directory, base_parts(_read_parts(directory), parent), match_own_doc_ids=incremental_collect)
        # the index state is part of the fingerprint: a dataset is reused only against the same index
        fp_config["index_state"] = index.state
    if cfg.paragraphs.enabled:
        if cfg.incremental:
            bloom, fp_config["bloom_state"], known = para.base_bloom(workdir, cfg.paragraphs, parent)
            if known is not None and not incremental_collect:
                rereads = para.Rereads(known, cfg.paragraphs)
        else:
            bloom = para.Bloom.sized(cfg.paragraphs.capacity, cfg.paragraphs.fp_rate)

    def build(w: DatasetWriter) -> dict:
        report: dict = {}
        stats = dedup(parent, cfg, w, signatures, index, memory_limit, bloom, rereads, report)
        return {"stats": stats, "extra": {**extra, **({"paragraph_bloom": bloom.report(cfg.paragraphs)} if bloom else {}),
                                          **report}}

    ref = materialize(workdir, NAME, fp_config, code, build, parents=[parent])
    if cfg.incremental:
        publish(ref, parent, cfg, workdir)
        if bloom is not None:
            para.publish_bloom(ref, parent, cfg.paragraphs, workdir)
    return ref


# the sharded half on the shard runner, then `run_dedup` (one task) over its dataset (the registry's `signatures=`)
STAGE = StageCode(run=run_dedup, plan=SIGNATURES.plan, shard=SIGNATURES.shard, warm=SIGNATURES.warm)
