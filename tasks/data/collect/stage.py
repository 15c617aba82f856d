"""collect: raw input files into Parquet document shards.

Inputs (matched by glob patterns, read in sorted order):
- JSONL, plain, `.gz` or `.zst`: one JSON object per line with a required string `text` and optional `id`,
  `source`, `url`; every other field is kept in the `meta` JSON column. Blank lines are not records.
- Parquet with a `text` column (and optional `id`, `source`, `url`; other columns go to `meta`).
- `.txt`, `.rst`, `.md`, `.markdown`, plain, `.gz` or `.zst`: the whole file is one document, as it is (the
  markup stays: the techdocs preset's `skip_markup_lines` tells the Gopher rules to read past it).
- `.html`/`.htm`: one page; its main text is extracted with trafilatura (`tasks/extract.py`).
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
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lifecycle.core.code import code_version
from lifecycle.core.dataset import (
    DOC_SCHEMA, MANIFEST, DatasetRef, RawFile, StageStats, dataset_dir, fingerprint, rejected_table,
)
from lifecycle.core.shards import StageCode, StagePlan, group_files, heartbeat, plan_stage, run_plan
from lifecycle.core.fs import atomic_write_bytes
from lifecycle.core.fs import is_remote, is_url
from lifecycle.core.paths import confine_matches
from lifecycle.core import fs
from lifecycle.tasks.data.collect.inputs import path_bytes, raw_name, remote_problem, shown, walk_glob
from lifecycle.tasks.data.collect.streams import COMPRESSED, STREAM_ERRORS, open_stream, truncated_reason
from lifecycle.tasks.data.collect.tombstones import REASON as FORGOTTEN, ForgetFilter

NAME = "collect"
KNOWN_FIELDS = ("id", "text", "source", "url")
WHERE = "_where"  # a reader's (record number, byte start, byte end) of a record in its raw file, beside the row
POSITIONS = "raw-positions.parquet"  # per shard: where each kept row came from (an `extra` file)
POSITIONS_SCHEMA = pa.schema([("doc_id", pa.string()), ("source_id", pa.string()), ("raw_path", pa.string()),
                              ("record", pa.int64()), ("byte_start", pa.int64()), ("byte_end", pa.int64())])


BASE_MEMORY = 192 << 20  # a collect process before its rows: the interpreter, pyarrow, trafilatura, warcio (~125 MiB)
_ROW_OVERHEAD = 400  # a buffered row beyond its strings: its dict (7 keys) and list slot


def part_bytes(cfg: "CollectConfig") -> int:
    """Bytes of strings a shard buffers before it writes a part (`max_memory_bytes`' description)."""
    return (cfg.max_memory_bytes - BASE_MEMORY - 4 * cfg.max_line_bytes) // 8


class CollectConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    inputs: list[str] = Field(description=(
        "Glob patterns of input files (.jsonl, .jsonl.gz, .jsonl.zst, .parquet, .txt, .rst, .md, .markdown "
        "(each also .gz/.zst), .html, .warc, .warc.gz)."))
    max_doc_bytes: int = Field(
        8 << 20,
        gt=0,
        description="Documents whose UTF-8 text is larger than this are rejected as `too_large` "
        "(8 MiB: far above any real page, small enough to keep a shard in memory).",
    )
    max_line_bytes: int = Field(
        32 << 20,
        gt=0,
        description="A JSONL line longer than this is rejected as `too_large` without being held in memory "
        "(32 MiB: room for a max_doc_bytes text with JSON escapes and metadata).",
    )
    max_json_depth: int = Field(
        64, gt=0, description="A JSONL record nested deeper than this (objects/arrays) is rejected as `json_too_deep`."
    )
    rows_per_shard: int = Field(20_000, gt=0, description="Kept rows per output Parquet file (at most; a file is "
                                "cut earlier when its rows hold `max_part_bytes`, or more than `max_memory_bytes` "
                                "allows).")
    max_part_bytes: int = Field(
        8 << 20, gt=0, description="A kept output Parquet file (a part) is also cut once its rows' strings hold this "
        "many bytes (8 MiB). Every later stage holds one part at a time, so this, not the size of the input files, "
        "bounds their memory: a 300 MB .jsonl.gz (never split, being compressed) still becomes parts of 8 MiB. "
        "Smaller means more files; the kept rows, their order and every decision are the same at any value.")
    max_memory_bytes: int = Field(
        2 << 30, gt=0, description="Bound on the peak memory of one collect shard (2 GiB), whatever its files "
        "decompress to (a `.jsonl.gz` of 1 MiB lines compresses 1000:1): kept and rejected rows are written out "
        "as soon as the strings they hold reach (max_memory_bytes - 192 MiB - 4 x max_line_bytes) / 8 bytes "
        "(a part is held as Python strings, Arrow arrays and Parquet pages at once, plus the allocator's slack; a "
        "line being read, up to 4 times). Must be at least 192 MiB + 12 x max_line_bytes.")
    incremental: bool = Field(
        False, description="Skip input files (same path and sha256) that a completed earlier run in this work dir "
        "already collected (ledger `<workdir>/collected.parquet`).")
    shard_bytes: int = Field(
        8 << 20, gt=0, description="Input files are grouped, in order, into shards of at most this many raw bytes (a "
        "larger file is a shard of its own); shards are collected in parallel and each is resumable on its own.")
    min_shards: int = Field(
        8, ge=1, description="Smaller input is cut into shards of at most 1/min_shards of its raw bytes (but not "
        "under 256 KiB), so a 24 MB corpus still runs on every worker: files are grouped by that size, and "
        "uncompressed JSONL is split by it. The cut depends on the input alone, not on the worker count, so a "
        "rerun with other workers resumes the same shards.")
    split_bytes: int = Field(
        64 << 20, ge=0, description="An uncompressed JSONL file larger than this (or than the shard size "
        "`min_shards` gives) is split at line boundaries into shards of about that many bytes, so one huge file "
        "is still collected in parallel (0: never split). Compressed files, Parquet, text, HTML and WARC files "
        "are never split.")

    @model_validator(mode="after")
    def _sizes(self) -> "CollectConfig":
        if self.max_line_bytes < self.max_doc_bytes:
            raise ValueError(f"max_line_bytes ({self.max_line_bytes}) must be >= max_doc_bytes ({self.max_doc_bytes})")
        if self.max_memory_bytes < BASE_MEMORY + 12 * self.max_line_bytes:
            raise ValueError(f"max_memory_bytes ({self.max_memory_bytes}) must be >= 192 MiB + 12 x max_line_bytes "
                             f"({BASE_MEMORY + 12 * self.max_line_bytes}): a line is held up to 4 times while it is "
                             "read and parsed, and a part must hold at least one")
        return self

    @field_validator("inputs")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one input pattern is required")
        return v


class CollectRun(CollectConfig):
    """The config a collect plan runs with: the user's `CollectConfig` plus the work dir's tombstones (only when
    there are some, so that an empty ledger leaves the fingerprint as it was)."""

    forgotten: ForgetFilter | None = Field(None, description="Tombstones to reject (set by `plan_collect`).")


class InputError(ValueError):
    """The inputs cannot be resolved (a pattern matches nothing, an unknown file type)."""


TEXT_SUFFIXES = tuple(ext + z for ext in (".txt", ".rst", ".md", ".markdown") for z in ("", *COMPRESSED))


def file_kind(path: str) -> str:
    p = path.lower()
    if p.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".ndjson", ".jsonl.zst", ".json.zst", ".ndjson.gz")):
        return "jsonl"
    if p.endswith(".parquet"):
        return "parquet"
    if p.endswith(TEXT_SUFFIXES):
        return "txt"
    if p.endswith((".html", ".htm")):
        return "html"
    if p.endswith((".warc", ".warc.gz", ".arc", ".arc.gz")):
        return "warc"
    raise InputError(f"{path}: unsupported input type (expected .jsonl[.gz|.zst], .parquet, .txt/.rst/.md[.gz|.zst], "
                     ".html, .warc[.gz])")


def resolve_inputs(patterns: list[str]) -> list[RawFile]:
    """Expand the globs (sorted) and fingerprint every file by its full sha256."""
    return [RawFile(path=shown(p), path_bytes=path_bytes(p), sha256=fs.sha256_file(p), bytes=fs.size(p))
            for p in match_inputs(patterns)]


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


# --------------------------------------------------------------------------------------------------
# readers: each yields ("ok", record dict) or ("bad", source_id, reason, detail)


def _record(obj: dict, source_id_default: str, path: str) -> dict:
    meta = {k: v for k, v in obj.items() if k not in KNOWN_FIELDS}
    sid = obj.get("id")
    return {
        "source_id": str(sid) if sid is not None else source_id_default,
        "text": obj["text"],
        "source": str(obj["source"]) if obj.get("source") is not None else path,
        "url": str(obj["url"]) if obj.get("url") is not None else None,
        "meta": json.dumps(meta, ensure_ascii=False, default=str) if meta else None,
    }


def _check_text(obj: dict) -> tuple[str, str] | None:
    if "text" not in obj or obj["text"] is None:
        return "missing_text", "no `text` field"
    if not isinstance(obj["text"], str):
        return "text_not_string", f"`text` is {type(obj['text']).__name__}"
    if not obj["text"].strip():
        return "empty_text", "`text` is empty or whitespace"
    return None


def _bounded_lines(f, cap: int) -> Iterator[tuple[bytes | None, int]]:
    """(line, size) per line; line is None when it is longer than `cap` (its bytes are skipped, not held)."""
    while raw := f.readline(cap + 1):
        if len(raw) > cap and not raw.endswith(b"\n"):
            n = len(raw)
            while chunk := f.readline(1 << 20):
                n += len(chunk)
                if chunk.endswith(b"\n"):
                    break
            yield None, n
        else:
            yield raw, len(raw)


def json_depth(obj) -> int:
    """Nesting depth of objects/arrays (iterative: a hostile record cannot exhaust the stack here)."""
    depth, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            depth = max(depth, d)
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            depth = max(depth, d)
            stack.extend((v, d + 1) for v in o)
    return depth


def read_jsonl(path: str, cfg: CollectConfig, part: "FilePart | None" = None) -> Iterator[tuple]:
    """Every line of `path` as ("ok", record) or ("bad", source_id, reason, detail); with `part`, only the lines
    of that byte range (line numbers, and so source ids, as in a read of the whole file)."""
    lineno = part.first_line - 1 if part else 0
    pos = part.start if part else 0  # byte offset of the next line (in the decompressed stream of a .gz/.zst)
    records = 0
    left = part.end - part.start if part else None
    truncated = truncated_reason(path)
    name = shown(path)
    try:
        with open_stream(path) as f:
            if part:
                f.seek(part.start)
            for raw, size in _bounded_lines(f, cfg.max_line_bytes):
                if left is not None:
                    if left <= 0:
                        break
                    left -= size
                lineno += 1
                start, pos = pos, pos + size
                sid = f"{name}:{lineno}"
                if raw is None:
                    records += 1
                    yield ("bad", sid, "too_large", f"line {lineno}: {size} bytes > max_line_bytes={cfg.max_line_bytes}")
                    continue
                if not raw.strip():
                    continue
                records += 1
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield ("bad", sid, "invalid_utf8", f"line {lineno} byte {e.start}: {e.reason}")
                    continue
                try:
                    obj = json.loads(line)
                except RecursionError:
                    yield ("bad", sid, "json_too_deep", f"line {lineno}: nesting exceeds the parser's recursion limit")
                    continue
                except json.JSONDecodeError as e:
                    yield ("bad", sid, "invalid_json", f"line {lineno}: {str(e)[:200]}")
                    continue
                if not isinstance(obj, dict):
                    yield ("bad", sid, "not_an_object", f"line {lineno}: a JSON {type(obj).__name__}")
                    continue
                depth = json_depth(obj)
                if depth > cfg.max_json_depth:
                    yield ("bad", str(obj.get("id", sid)), "json_too_deep",
                           f"line {lineno}: depth {depth} > max_json_depth={cfg.max_json_depth}")
                    continue
                problem = _check_text(obj)
                if problem:
                    yield ("bad", str(obj.get("id", sid)), problem[0], f"line {lineno}: {problem[1]}")
                    continue
                yield ("ok", {**_record(obj, sid, name), WHERE: (lineno, start, start + size)})
    except STREAM_ERRORS as e:
        records += 1
        yield ("bad", f"{name}:{lineno + 1}", truncated, f"stream broke after line {lineno}: {e}")
    if not records and part is None:
        yield ("bad", f"{name}:0", "empty_file", "no records (empty file or only blank lines)")


def read_parquet(path: str, cfg: CollectConfig) -> Iterator[tuple]:
    name = shown(path)
    try:
        pf = pq.ParquetFile(fs.open_bytes(path))
    except Exception as e:  # pyarrow raises several types for a damaged footer
        yield ("bad", name, "unreadable_parquet", str(e)[:200])
        return
    if "text" not in pf.schema_arrow.names:
        yield ("bad", name, "missing_text_column", f"columns: {pf.schema_arrow.names}")
        return
    if pf.metadata.num_rows == 0:
        yield ("bad", f"{name}:0", "empty_file", "Parquet file has no rows")
        return
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=4096):
            for obj in batch.to_pylist():
                row += 1
                sid = f"{name}:{row}"
                problem = _check_text(obj)
                if problem:
                    yield ("bad", str(obj.get("id") or sid), *problem)
                    continue
                yield ("ok", {**_record(obj, sid, name), WHERE: (row, None, None)})
    except Exception as e:
        yield ("bad", f"{name}:{row + 1}", "unreadable_parquet", f"failed after row {row}: {str(e)[:200]}")


def _text_bytes(path: str, size: int, cfg: CollectConfig) -> tuple[bytes | None, tuple | None]:
    """(the file's bytes, decompressed, or None; the ("bad", ...) item when it is too large or breaks)."""
    name = shown(path)
    if not path.lower().endswith(COMPRESSED):
        if size > cfg.max_doc_bytes:  # decided on the file size, never read
            return None, ("bad", name, "too_large", f"{size} bytes > max_doc_bytes={cfg.max_doc_bytes}")
        return fs.read_bytes(path), None
    try:
        with open_stream(path) as f:
            data = f.read(cfg.max_doc_bytes + 1)  # a bomb is cut here
    except STREAM_ERRORS as e:
        return None, ("bad", name, truncated_reason(path), f"stream broke: {e}")
    if len(data) > cfg.max_doc_bytes:
        return None, ("bad", name, "too_large", f"more than max_doc_bytes={cfg.max_doc_bytes} bytes decompressed")
    return data, None


def read_txt(path: str, cfg: CollectConfig) -> Iterator[tuple]:
    """A text file (.txt, .rst, .md, .markdown, plain or .gz/.zst) as one document."""
    size, name = fs.size(path), shown(path)
    if size == 0:
        yield ("bad", f"{name}:0", "empty_file", "file is empty")
        return
    data, bad = _text_bytes(path, size, cfg)
    if bad:
        yield bad
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        yield ("bad", name, "invalid_utf8", f"byte {e.start}: {e.reason}")
        return
    problem = _check_text({"text": text})
    if problem:
        yield ("bad", name, *problem)
        return
    yield ("ok", {**_record({"text": text}, name, name), WHERE: (1, 0, len(data))})  # decompressed bytes


def _extract():
    """HTML/WARC extraction (trafilatura, warcio: most of a second to import), loaded when such a file is read."""
    from lifecycle.tasks.data.collect import extract

    return extract


READERS = {
    "jsonl": read_jsonl,
    "parquet": read_parquet,
    "txt": read_txt,
    "html": lambda path, cfg: _extract().read_html(path, cfg.max_doc_bytes),
    "warc": lambda path, cfg: _extract().read_warc(path, cfg.max_doc_bytes),
}


# --------------------------------------------------------------------------------------------------
# the stage


# --------------------------------------------------------------------------------------------------
# splitting a large uncompressed JSONL file into line-aligned byte ranges

_PART = "\0part\0"  # a shard item naming a byte range of a file (no path holds a NUL byte)


class FilePart(BaseModel):
    """The lines of `path` in bytes [start, end), numbered from `first_line`; start is the start of a line."""

    model_config = ConfigDict(frozen=True)
    path: str
    start: int
    end: int
    first_line: int

    def item(self) -> str:  # json.dumps: a path that is not UTF-8 (surrogates) round-trips as \udcNN escapes
        return _PART + json.dumps(self.model_dump(), separators=(",", ":"))


def parse_item(item: str) -> tuple[str, FilePart | None]:
    """(path, part) of a shard item: a plain path, or a byte range written by `FilePart.item`."""
    if item.startswith(_PART):
        part = FilePart(**json.loads(item[len(_PART):]))
        return part.path, part
    return item, None


def splittable(raw: RawFile, split_bytes: int) -> bool:
    return raw.bytes > split_bytes and raw.path.lower().endswith((".jsonl", ".ndjson"))  # not .gz/.zst


def split_file(path: str, split_bytes: int, chunk: int = 4 << 20) -> list[FilePart]:
    """Line-aligned byte ranges of about `split_bytes` each, with the number of each range's first line: one
    sequential read of the file counting newlines, in memory one chunk at a time."""
    parts, start, first_line = [], 0, 1
    pos = lines = 0  # bytes and newlines before the current chunk
    target = split_bytes
    with fs.open_bytes(path) as f:
        while buf := f.read(chunk):
            at = 0
            while target < pos + len(buf):
                nl = buf.find(b"\n", max(at, target - pos))
                if nl < 0:
                    break
                end = pos + nl + 1
                parts.append(FilePart(path=path, start=start, end=end, first_line=first_line))
                start, first_line, at = end, lines + buf.count(b"\n", 0, nl + 1) + 1, nl + 1
                target = end + split_bytes
            pos, lines = pos + len(buf), lines + buf.count(b"\n")
    if pos > start or not parts:
        parts.append(FilePart(path=path, start=start, end=pos, first_line=first_line))
    return parts


def collect_shard(cfg: CollectConfig, paths: list[str], writer) -> StageStats:
    """Read the shard's input files in order; kept rows in files of at most `rows_per_shard` rows and about
    `max_part_bytes` bytes of held text (or `part_bytes(cfg)`, if smaller), rejected rows beside (in files of
    `part_bytes(cfg)`), so a shard's memory is bounded by `max_memory_bytes` whatever its files decompress to,
    and a later stage's by `max_part_bytes`."""
    stats = StageStats()
    kept: list[dict] = []
    rejected: list[dict] = []
    positions: dict[str, list] = {n: [] for n in POSITIONS_SCHEMA.names}
    budget = part_bytes(cfg)
    kept_budget = min(budget, cfg.max_part_bytes)
    forgotten = f.matcher() if (f := getattr(cfg, "forgotten", None)) else None
    held = held_rejected = 0  # bytes of the strings buffered in `kept` / `rejected`

    def flush(final: bool = False) -> None:
        nonlocal held, held_rejected
        if kept and (final or len(kept) >= cfg.rows_per_shard or held >= kept_budget):
            writer.write_table(pa.Table.from_pylist(kept, schema=DOC_SCHEMA))
            kept.clear()
            held = 0
        if rejected and (final or held_rejected >= budget):
            writer.write_table(rejected_table(rejected, NAME), kind="rejected")
            rejected.clear()
            held_rejected = 0

    def reject(doc_id: str, sid: str, reason: str, detail: str) -> None:
        nonlocal held_rejected
        rejected.append({"doc_id": doc_id, "source_id": sid, "reason": reason, "detail": detail})
        stats.rejected[reason] += 1
        held_rejected += _ROW_OVERHEAD + sys.getsizeof(sid) + sys.getsizeof(detail)
        if held_rejected >= budget:
            flush()

    for entry in paths:
        path, part = parse_item(entry)
        name = shown(path)
        for item in (read_jsonl(path, cfg, part) if part else READERS[file_kind(path)](path, cfg)):
            stats.rows_in += 1
            heartbeat()
            if item[0] == "bad":
                _, sid, reason, detail = item
                reject(make_doc_id(sid, ""), sid, reason, f"{name}: {detail}")
                continue
            rec = item[1]
            where = rec.pop(WHERE, (None, None, None))
            nbytes = len(rec["text"].encode("utf-8", "surrogatepass"))
            stats.bytes_in += nbytes
            reason = detail = None
            if "\x00" in rec["text"]:
                reason, detail = "nul_bytes", f"{name}: text holds NUL bytes"
            elif nbytes > cfg.max_doc_bytes:
                reason, detail = "too_large", f"{name}: {nbytes} bytes > max_doc_bytes={cfg.max_doc_bytes}"
            elif forgotten is not None and (hit := forgotten.match(rec["text"])):
                reason = FORGOTTEN
                detail = f"{name}: {hit[1]} copy of tombstone {hit[0]} ({hit[3]})"
            if reason:
                reject(make_doc_id(rec["source_id"], rec["text"]), rec["source_id"], reason, detail)
                continue
            rec["doc_id"] = make_doc_id(rec["source_id"], rec["text"])
            for k, v in zip(POSITIONS_SCHEMA.names, (rec["doc_id"], rec["source_id"], name, *where)):
                positions[k].append(v)
            kept.append(rec)
            held += _ROW_OVERHEAD + sum(sys.getsizeof(v) for v in rec.values() if v is not None)
            stats.rows_kept += 1
            stats.bytes_out += nbytes
            flush()
    flush(final=True)
    if positions["doc_id"]:
        writer.write_table(pa.table(positions, schema=POSITIONS_SCHEMA), kind="extra", name=POSITIONS)
    return stats


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
