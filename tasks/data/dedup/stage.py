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

Beside this module: config.py (`DedupConfig`), signatures.py (the sharded half), decide.py (the global half in
DuckDB), index.py (the persisted index), and the optional steps paragraphs.py and substring.py.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lifecycle.core.code import code_version
from lifecycle.core.dataset import (
    DatasetRef, DatasetWriter, StageStats, materialize, read_parquet, rejected_table,
)
from lifecycle.core.shards import StageCode
from lifecycle.core.fs import atomic_write_bytes
from lifecycle.tasks.data.dedup import paragraphs as para
from lifecycle.tasks.data.dedup import substring as sub
from lifecycle.tasks.data.dedup.history import base_parts, collected_incrementally, locked as _locked
from lifecycle.tasks.data.dedup.config import (
    INDEX_FILE, INDEX_MANIFEST as INDEX_MANIFEST, NAME, SIG_STAGE as SIG_STAGE, DedupConfig, fingerprint_config,
)
from lifecycle.tasks.data.dedup.decide import components as components, decide
from lifecycle.tasks.data.dedup.index import Index, _read_parts, index_dir, publish
from lifecycle.tasks.data.dedup.signatures import (
    SIGNATURES, plan_signatures as plan_signatures, shingles as shingles, signature as signature,
    signature_config as signature_config,
)

REJECT_REASON = para.REJECT_REASON  # one reason for every removed copy; `duplicate_kind` says which step
DUPLICATE_KINDS = ("exact", "near", "paragraph", "substring")
BLOOM_FILE = para.BLOOM_FILE  # the paragraph Bloom filter after this run, inside the dataset
REJECTED_FIELDS = [pa.field("duplicate_of", pa.string()), pa.field("duplicate_kind", pa.string())]
DUCKDB_MEMORY = "2GB"  # the global half's DuckDB memory limit (it spills to disk beyond it)


def duplicate_row(doc_id: str, source_id: str, kind: str, of: str | None, earlier: str | None,
                  method: str | None = None) -> dict:
    """The rejected row of a removed copy: reason `duplicate`, its kind and the doc_id it duplicates; `method`
    (e.g. "simhash, hamming <= 3") is named in the detail when it is not the default MinHash."""
    detail = f"{kind} duplicate of {of}" + (f" ({method})" if method else "") + (f"; {earlier}" if earlier else "")
    return {"doc_id": doc_id, "source_id": source_id, "reason": REJECT_REASON, "detail": detail,
            "duplicate_of": of, "duplicate_kind": kind}


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
    out = _Output(writer, cfg, stats)
    suffixes = sub.SuffixDedup(spill / "substring", cfg.substring) if cfg.substring.enabled else None
    pending: list[tuple[Path, np.ndarray, str]] = []  # substring on: (kept rows set aside, keep mask, signature file)
    try:
        if files:
            decide(con, cfg, files, sig_files, counts, index, spill)
        for k, (path, sig_path) in enumerate(zip(files, sig_files)):
            t, keep, kept, rejected = _file_decisions(con, k, path, sig_path, index, method, stats)
            if bloom is not None:
                kept, still, short = para.dedup_table(kept, bloom, cfg.paragraphs, stats, rereads)
                rejected += short
                mask = np.asarray(keep, dtype=bool).copy()  # final keep over the file's rows: index rows follow it
                mask[mask] = still
                keep = pa.array(mask)
            stats.rows_in += t.num_rows
            stats.bytes_in += pc.sum(pc.binary_length(t.column("text"))).as_py() or 0
            if suffixes is None:
                out.emit(kept, rejected, keep, sig_path)
                continue
            pending.append(_set_aside(kept, rejected, keep, sig_path, spill / "substring" / f"kept-{k:05d}.parquet",
                                      suffixes, out))
        if suffixes is not None:
            _substring_pass(suffixes, pending, cfg, stats, out, report)
    finally:
        con.close()
        shutil.rmtree(spill, ignore_errors=True)
        out.close_index()
    out.finish(bloom)
    return stats


def _file_decisions(con: duckdb.DuckDBPyConnection, k: int, path: str, sig_path: str, index: Index | None,
                    method: str | None, stats: StageStats) -> tuple[pa.Table, pa.Array, pa.Table, list[dict]]:
    """One parent file's rows, `decide`'s keep mask over them, its kept rows (with cluster_id and cluster_size)
    and its rejected rows (counted in `stats`)."""
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
    return t, keep, kept, rejected


def _set_aside(kept: pa.Table, rejected: list[dict], keep, sig_path: str, stash: Path, suffixes: sub.SuffixDedup,
               out: "_Output") -> tuple[Path, np.ndarray, str]:
    """Substring dedup needs every file's text first: the rows rejected so far go out now, the kept wait in
    `stash` while their text goes into the suffix arrays."""
    if para.CUT_COLUMN not in kept.column_names:
        kept = kept.append_column(para.CUT_COLUMN, pa.array([[]] * kept.num_rows, para.CUT_TYPE))
    suffixes.add(kept.column("text"))
    pq.write_table(kept, stash, compression="lz4")
    if rejected:
        out.reject(rejected)
    return stash, np.asarray(keep, dtype=bool).copy(), sig_path


def _substring_pass(suffixes: sub.SuffixDedup, pending: list[tuple[Path, np.ndarray, str]], cfg: DedupConfig,
                    stats: StageStats, out: "_Output", report: dict | None) -> None:
    """Every file's set-aside kept rows lose their repeated spans, then are written."""
    suffixes.build()
    for stash, mask, sig_path in pending:
        kept, still, short = sub.dedup_table(pq.read_table(stash), suffixes, cfg.substring, para.CUT_COLUMN,
                                             para.CUT_TYPE, stats)
        stash.unlink()
        mask[mask] = still
        out.emit(kept, short, pa.array(mask), sig_path)
    if report is not None:
        report["substring"] = suffixes.report()


class _Output:
    """Where dedup writes: kept and rejected rows into the dataset, the kept rows' index rows into INDEX_FILE
    (incremental), the paragraph filter into BLOOM_FILE."""

    def __init__(self, writer: DatasetWriter, cfg: DedupConfig, stats: StageStats):
        self.writer, self.stats = writer, stats
        self.index_path = writer.path(INDEX_FILE)
        self.index_rows = 0
        self.index_schema = _index_schema(cfg)
        self.index_out = pq.ParquetWriter(self.index_path, self.index_schema, compression="zstd",
                                          write_page_checksum=True) if cfg.incremental else None

    def emit(self, kept: pa.Table, rejected: list[dict], keep, sig_path: str) -> None:
        self.stats.rows_kept += kept.num_rows
        if rejected:
            self.stats.rejected[REJECT_REASON] += len(rejected)
        self.stats.bytes_out += pc.sum(pc.binary_length(kept.column("text"))).as_py() or 0
        if kept.num_rows:
            self.writer.write_table(kept)
        if rejected:
            self.writer.write_table(rejected_table(rejected, NAME, REJECTED_FIELDS), kind="rejected")
        if self.index_out is not None:
            rows = pq.read_table(sig_path, columns=self.index_schema.names,
                                 page_checksum_verification=True).filter(keep)
            self.index_out.write_table(rows.cast(self.index_schema))
            self.index_rows += rows.num_rows

    def reject(self, rejected: list[dict]) -> None:
        self.stats.rejected[REJECT_REASON] += len(rejected)
        self.writer.write_table(rejected_table(rejected, NAME, REJECTED_FIELDS), kind="rejected")

    def close_index(self) -> None:
        if self.index_out is not None:
            self.index_out.close()

    def finish(self, bloom: para.Bloom | None) -> None:
        if self.index_out is not None:
            self.writer.add_file(INDEX_FILE, num_rows=self.index_rows)
        else:
            self.index_path.unlink(missing_ok=True)
        if bloom is not None:
            atomic_write_bytes(self.writer.path(BLOOM_FILE), bloom.to_bytes())
            self.writer.add_file(BLOOM_FILE)


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
