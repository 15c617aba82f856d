"""collect: raw input files into Parquet document shards.

Inputs (matched by glob patterns, read in sorted order):
- JSONL, plain, `.gz` or `.zst`: one JSON object per line with a required string `text` and optional `id`,
  `source`, `url`; every other field is kept in the `meta` JSON column. Blank lines are not records.
- Parquet with a `text` column (and optional `id`, `source`, `url`; other columns go to `meta`).
- `.txt`, `.rst`, `.md`, `.markdown`, plain, `.gz` or `.zst`: the whole file is one document, as it is (the
  markup stays: the techdocs preset's `skip_markup_lines` tells the Gopher rules to read past it).
- `.html`/`.htm`: one page; its main text is extracted with trafilatura (`tasks/data/collect/extract.py`).
- `.warc`/`.warc.gz`: every `response` record is one page (HTML through trafilatura, `text/plain` as is), with
  `url` = WARC-Target-URI and `source_id` = WARC-Record-ID.

Bad input never stops the stage and never disappears: each bad record becomes a rejected row naming
the file, the line (or row, or byte offset) and a reason code, while the rest of the file keeps flowing:
`invalid_utf8`, `invalid_json`, `json_too_deep`, `not_an_object`, `missing_text`, `text_not_string`,
`empty_text`, `too_large`, `nul_bytes`, `truncated_gzip` / `truncated_zstd` / `truncated_warc` (what was read
before the break is kept), `empty_file`, `unreadable_parquet`, `missing_text_column`, `no_main_text`,
`unsupported_content_type`.

Size rule (memory stays bounded by it, whatever the input): a document whose UTF-8 text is larger than
`max_doc_bytes` (8 MiB) is rejected as `too_large`. A JSONL line longer than `max_line_bytes` is rejected
as `too_large` after reading at most `max_line_bytes + 1` bytes of it (the rest of the line is skipped in
1 MiB chunks, never held); text and `.html` files and WARC payloads over `max_doc_bytes` are rejected
by their size, unread (a compressed text file after decompressing `max_doc_bytes + 1` bytes of it).

Incremental collection (`incremental: true`; `lifecycle serve` turns it on): files whose (path, sha256)
is in the work dir's ledger `collected.parquet` are skipped, so a recurring run over a growing input
directory collects only what is new (a file whose content changed is new). Every run appends its files
to the ledger when it completes, so a run that crashed is redone in full by the next one.

Forgotten documents (`lifecycle forget`): when the work dir has a tombstone ledger (`tasks/data/collect/
tombstones.py`), every document that is an exact or near copy of a tombstoned one is rejected as `forgotten`
(the detail names the tombstone, never the text); the ledger's digest is part of the fingerprint. With no ledger
the stage is what it was: same rows, doc_ids and reasons.

Beside this module: config.py (`CollectConfig`), readers.py (one reader per input kind, and the byte ranges a
large JSONL file is split into), ledger.py (`collected.parquet`), tombstones.py, inputs.py, streams.py, extract.py.
"""

from __future__ import annotations

import hashlib
import os
import sys

import pyarrow as pa

from lifecycle.core.code import code_version
from lifecycle.core.dataset import (
    DOC_SCHEMA, MANIFEST, DatasetRef, RawFile, StageStats, dataset_dir, fingerprint, rejected_table,
)
from lifecycle.core.shards import StageCode, StagePlan, group_files, heartbeat, plan_stage, run_plan
from lifecycle.core.fs import is_remote, is_url
from lifecycle.core.paths import confine_matches
from lifecycle.core import fs
from lifecycle.tasks.data.collect.inputs import path_bytes, raw_name, remote_problem, shown, walk_glob
from lifecycle.tasks.data.collect.config import _ROW_OVERHEAD, CollectConfig, CollectRun, part_bytes
from lifecycle.tasks.data.collect.ledger import new_inputs, record_collected as record_collected
from lifecycle.tasks.data.collect.readers import (
    READERS, WHERE, InputError, file_kind, parse_item, read_jsonl, split_file, splittable,
)
from lifecycle.tasks.data.collect.tombstones import REASON as FORGOTTEN, ForgetFilter

NAME = "collect"
POSITIONS = "raw-positions.parquet"  # per shard: where each kept row came from (an `extra` file)
POSITIONS_SCHEMA = pa.schema([("doc_id", pa.string()), ("source_id", pa.string()), ("raw_path", pa.string()),
                              ("record", pa.int64()), ("byte_start", pa.int64()), ("byte_end", pa.int64())])


def resolve_inputs(patterns: list[str]) -> list[RawFile]:
    """Expand the globs (sorted) and fingerprint every file by its full sha256."""
    return [RawFile(path=shown(p), path_bytes=path_bytes(p), sha256=fs.sha256_file(p), bytes=fs.size(p))
            for p in match_inputs(patterns)]


def _warn_special(pattern: str) -> None:
    """Say which matches of a local pattern are neither regular files nor directories (a FIFO would block a
    reader, a socket or a device is no input): they are skipped, with one warning each."""
    import glob
    import logging
    import stat

    for p in sorted(glob.glob(pattern)):
        try:
            mode = os.stat(p).st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
            logging.getLogger("lifecycle").warning("collect.inputs: pattern %r matches %s, %s: skipped",
                                                   shown(pattern), p, kind)


def match_inputs(patterns: list[str]) -> list[str]:
    """The files the globs match (sorted), each of a known type. A local file is taken once, under the first
    spelling found, however many paths (symlinks, loops, overlapping patterns) lead to it."""
    paths: list[str] = []
    seen: set = set()
    for pattern in patterns:
        local = not is_url(pattern)
        try:
            matched = walk_glob(pattern) if local and "**" in pattern else fs.glob_files(pattern)
        except Exception as e:
            if not is_remote(pattern):
                raise
            raise InputError(remote_problem(pattern, e)) from e
        if local and "**" not in pattern:  # a `**` walk (walk_glob) keeps to regular files and bounds symlink loops
            _warn_special(pattern)
        if not matched:
            raise InputError(f"collect.inputs: pattern {shown(pattern)!r} matches no file")
        if not is_remote(pattern):  # local (file:// too): no symlink or `..` leads out of the pattern's dir
            confine_matches(pattern, matched, error=InputError)
        for m in matched:
            if local:
                st = os.stat(m)
                key = (st.st_dev, st.st_ino)
            else:
                key = m
            if key not in seen:
                seen.add(key)
                paths.append(m)
    for p in paths:
        file_kind(p)  # fail on an unknown type before any work starts
    return paths


def make_doc_id(source_id: str, text: str) -> str:
    return hashlib.sha256(f"{source_id}\x00{text}".encode("utf-8", "surrogatepass")).hexdigest()[:16]


def collect_shard(cfg: CollectConfig, paths: list[str], writer) -> StageStats:
    """Read the shard's input files in order; kept rows in files of at most `rows_per_shard` rows and about
    `max_part_bytes` bytes of held text (or `part_bytes(cfg)`, if smaller), rejected rows beside (in files of
    `part_bytes(cfg)`), so a shard's memory is bounded by `max_memory_bytes` whatever its files decompress to,
    and a later stage's by `max_part_bytes`."""
    stats = StageStats()
    out = _Parts(cfg, writer, stats)
    forgotten = f.matcher() if (f := getattr(cfg, "forgotten", None)) else None
    for entry in paths:
        path, part = parse_item(entry)
        name = shown(path)
        for item in (read_jsonl(path, cfg, part) if part else READERS[file_kind(path)](path, cfg)):
            stats.rows_in += 1
            heartbeat()
            if item[0] == "bad":
                _, sid, reason, detail = item
                out.reject(make_doc_id(sid, ""), sid, reason, f"{name}: {detail}")
                continue
            rec = item[1]
            where = rec.pop(WHERE, (None, None, None))
            nbytes = len(rec["text"].encode("utf-8", "surrogatepass"))
            stats.bytes_in += nbytes
            reason, detail = _refused(rec["text"], nbytes, name, cfg, forgotten)
            if reason:
                out.reject(make_doc_id(rec["source_id"], rec["text"]), rec["source_id"], reason, detail)
                continue
            rec["doc_id"] = make_doc_id(rec["source_id"], rec["text"])
            out.keep(rec, name, where)
            stats.rows_kept += 1
            stats.bytes_out += nbytes
            out.flush()
    out.close()
    return stats


def _refused(text: str, nbytes: int, name: str, cfg: CollectConfig, forgotten) -> tuple[str | None, str | None]:
    """(reason, detail) when a well-formed record is still rejected: NUL bytes, too large, or forgotten."""
    if "\x00" in text:
        return "nul_bytes", f"{name}: text holds NUL bytes"
    if nbytes > cfg.max_doc_bytes:
        return "too_large", f"{name}: {nbytes} bytes > max_doc_bytes={cfg.max_doc_bytes}"
    if forgotten is not None and (hit := forgotten.match(text)):
        return FORGOTTEN, f"{name}: {hit[1]} copy of tombstone {hit[0]} ({hit[3]})"
    return None, None


class _Parts:
    """A collect shard's kept rows, rejected rows and raw positions, written out as parts as they reach their
    byte budgets (`part_bytes`; kept rows also `max_part_bytes` and `rows_per_shard`)."""

    def __init__(self, cfg: CollectConfig, writer, stats: StageStats):
        self.cfg, self.writer, self.stats = cfg, writer, stats
        self.kept: list[dict] = []
        self.rejected: list[dict] = []
        self.positions: dict[str, list] = {n: [] for n in POSITIONS_SCHEMA.names}
        self.budget = part_bytes(cfg)
        self.kept_budget = min(self.budget, cfg.max_part_bytes)
        self.held = self.held_rejected = 0  # bytes of the strings buffered in `kept` / `rejected`

    def flush(self, final: bool = False) -> None:
        if self.kept and (final or len(self.kept) >= self.cfg.rows_per_shard or self.held >= self.kept_budget):
            self.writer.write_table(pa.Table.from_pylist(self.kept, schema=DOC_SCHEMA))
            self.kept.clear()
            self.held = 0
        if self.rejected and (final or self.held_rejected >= self.budget):
            self.writer.write_table(rejected_table(self.rejected, NAME), kind="rejected")
            self.rejected.clear()
            self.held_rejected = 0

    def reject(self, doc_id: str, sid: str, reason: str, detail: str) -> None:
        self.rejected.append({"doc_id": doc_id, "source_id": sid, "reason": reason, "detail": detail})
        self.stats.rejected[reason] += 1
        self.held_rejected += _ROW_OVERHEAD + sys.getsizeof(sid) + sys.getsizeof(detail)
        if self.held_rejected >= self.budget:
            self.flush()

    def keep(self, rec: dict, name: str, where: tuple) -> None:
        for k, v in zip(POSITIONS_SCHEMA.names, (rec["doc_id"], rec["source_id"], name, *where)):
            self.positions[k].append(v)
        self.kept.append(rec)
        self.held += _ROW_OVERHEAD + sum(sys.getsizeof(v) for v in rec.values() if v is not None)

    def close(self) -> None:
        self.flush(final=True)
        if self.positions["doc_id"]:
            self.writer.write_table(pa.table(self.positions, schema=POSITIONS_SCHEMA), kind="extra", name=POSITIONS)


MIN_SHARD_BYTES = 256 << 10  # `min_shards` never cuts shards smaller than this


def shard_inputs(inputs: list[RawFile], shard_bytes: int, split_bytes: int = 0, min_shards: int = 1) -> list[list[str]]:
    """Consecutive input files, grouped so that a group holds at most `shard_bytes` raw bytes, or 1/min_shards of
    the input when that is smaller (256 KiB at least); a larger file is a group of its own (`group_files`). An
    uncompressed JSONL file larger than `split_bytes`, or than that share of the input, becomes shards of its own,
    one per line-aligned byte range of about that many bytes (`split_file`); `split_bytes=0` never splits. A
    function of the inputs and these settings alone."""
    share = max(MIN_SHARD_BYTES, -(-sum(raw.bytes for raw in inputs) // min_shards))
    size_cap = min(shard_bytes, share)
    split = min(split_bytes, share) if split_bytes else 0
    shards: list[list[str]] = []
    pending: list[tuple[str, int]] = []  # whole files since the last split one
    for raw in inputs:
        path = raw_name(raw.path, raw.path_bytes)  # the name to open
        if split and splittable(raw, split):
            shards += group_files(pending, size_cap) + [[part.item()] for part in split_file(path, split)]
            pending = []
        else:
            pending.append((path, raw.bytes))
    return shards + group_files(pending, size_cap)


def _run_inputs(cfg: CollectConfig, workdir: str, inputs: list[RawFile] | None) -> tuple[CollectConfig, list[RawFile]]:
    """The config (with the work dir's forget list) and the input files this run collects."""
    inputs = resolve_inputs(cfg.inputs) if inputs is None else inputs
    if cfg.incremental:
        inputs = new_inputs(inputs, workdir)
    forgotten = ForgetFilter.from_workdir(workdir)
    if forgotten is not None:
        cfg = CollectRun(**cfg.model_dump(), forgotten=forgotten)
    return cfg, inputs


def collect_committed(cfg: CollectConfig, workdir: str, inputs: list[RawFile] | None = None) -> bool:
    """Whether this run's collect dataset is committed already (its manifest is there; `plan_collect` verifies
    it). Cheap: no shard planning, no file read. The flow starts its Dask workers early only when it is not."""
    cfg, inputs = _run_inputs(cfg, workdir, inputs)
    fp = fingerprint(NAME, cfg, code_version(__package__), [], inputs)
    return (dataset_dir(workdir, NAME, fp) / MANIFEST).exists()


def plan_collect(cfg: CollectConfig, workdir: str, inputs: list[RawFile] | None = None) -> StagePlan | DatasetRef:
    cfg, inputs = _run_inputs(cfg, workdir, inputs)
    return plan_stage(workdir, NAME, cfg, code_version(__package__), collect_shard,
                      shard_inputs(inputs, cfg.shard_bytes, cfg.split_bytes, cfg.min_shards), inputs=inputs)


def run_collect(cfg: CollectConfig, workdir: str, inputs: list[RawFile] | None = None) -> DatasetRef:
    return run_plan(plan_collect(cfg, workdir, inputs))


# sharded over its raw inputs (no parent): its own plan, not a per-file stage's
STAGE = StageCode(run=run_collect, plan=plan_collect, shard=collect_shard)
