"""collect: raw input files into Parquet document shards.

Inputs (matched by glob patterns, read in sorted order):
- JSONL, plain or `.gz`: one JSON object per line with a required string `text` and optional `id`,
  `source`, `url`; every other field is kept in the `meta` JSON column. Blank lines are not records.
- Parquet with a `text` column (and optional `id`, `source`, `url`; other columns go to `meta`).
- `.txt`: the whole file is one document.

Bad input never stops the stage and never disappears: each bad record becomes a rejected row naming
the file, the line (or row) and a reason code, while the rest of the file keeps flowing:
`invalid_utf8`, `invalid_json`, `not_an_object`, `missing_text`, `text_not_string`, `empty_text`,
`too_large`, `nul_bytes`, `truncated_gzip` (what decompressed before the break is kept), `unreadable_parquet`,
`missing_text_column`.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import sys
import zlib
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lifecycle.dataset import (
    DOC_SCHEMA,
    DatasetRef,
    DatasetWriter,
    RawFile,
    StageStats,
    code_version,
    materialize,
    rejected_table,
    sha256_file,
)

STAGE = "collect"
KNOWN_FIELDS = ("id", "text", "source", "url")


class CollectConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    inputs: list[str] = Field(description="Glob patterns of input files (.jsonl, .jsonl.gz, .parquet, .txt).")
    max_doc_bytes: int = Field(
        8 << 20,
        gt=0,
        description="Documents whose UTF-8 text is larger than this are rejected as `too_large` "
        "(8 MiB: far above any real page, small enough to keep a shard in memory).",
    )
    rows_per_shard: int = Field(20_000, gt=0, description="Kept rows per output Parquet file.")

    @field_validator("inputs")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one input pattern is required")
        return v


class InputError(ValueError):
    """The inputs cannot be resolved (a pattern matches nothing, an unknown file type)."""


def file_kind(path: str) -> str:
    p = path.lower()
    if p.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")):
        return "jsonl"
    if p.endswith(".parquet"):
        return "parquet"
    if p.endswith(".txt"):
        return "txt"
    raise InputError(f"{path}: unsupported input type (expected .jsonl, .jsonl.gz, .parquet or .txt)")


def resolve_inputs(patterns: list[str]) -> list[RawFile]:
    """Expand the globs (sorted, de-duplicated) and fingerprint every file by its full sha256."""
    paths: list[str] = []
    for pattern in patterns:
        matched = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        if not matched:
            raise InputError(f"collect.inputs: pattern {pattern!r} matches no file")
        paths.extend(m for m in matched if m not in paths)
    for p in paths:
        file_kind(p)  # fail on an unknown type before any work starts
    return [RawFile(path=p, sha256=sha256_file(p), bytes=Path(p).stat().st_size) for p in paths]


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


def read_jsonl(path: str) -> Iterator[tuple]:
    opener = gzip.open if path.lower().endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rb") as f:
            for raw in f:
                lineno += 1
                sid = f"{path}:{lineno}"
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield ("bad", sid, "invalid_utf8", f"byte {e.start}: {e.reason}")
                    continue
                try:
                    obj = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as e:
                    yield ("bad", sid, "invalid_json", str(e)[:200])
                    continue
                if not isinstance(obj, dict):
                    yield ("bad", sid, "not_an_object", f"line holds a JSON {type(obj).__name__}")
                    continue
                problem = _check_text(obj)
                if problem:
                    yield ("bad", str(obj.get("id", sid)), *problem)
                    continue
                yield ("ok", _record(obj, sid, path))
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
        yield ("bad", f"{path}:{lineno + 1}", "truncated_gzip", f"stream broke after line {lineno}: {e}")


def read_parquet(path: str) -> Iterator[tuple]:
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a damaged footer
        yield ("bad", path, "unreadable_parquet", str(e)[:200])
        return
    if "text" not in pf.schema_arrow.names:
        yield ("bad", path, "missing_text_column", f"columns: {pf.schema_arrow.names}")
        return
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=4096):
            for obj in batch.to_pylist():
                row += 1
                sid = f"{path}:{row}"
                problem = _check_text(obj)
                if problem:
                    yield ("bad", str(obj.get("id") or sid), *problem)
                    continue
                yield ("ok", _record(obj, sid, path))
    except Exception as e:
        yield ("bad", f"{path}:{row + 1}", "unreadable_parquet", f"failed after row {row}: {str(e)[:200]}")


def read_txt(path: str) -> Iterator[tuple]:
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        yield ("bad", path, "invalid_utf8", f"byte {e.start}: {e.reason}")
        return
    problem = _check_text({"text": text})
    if problem:
        yield ("bad", path, *problem)
        return
    yield ("ok", _record({"text": text}, path, path))


READERS = {"jsonl": read_jsonl, "parquet": read_parquet, "txt": read_txt}


# --------------------------------------------------------------------------------------------------
# the stage


def collect_files(inputs: list[RawFile], cfg: CollectConfig, writer: DatasetWriter) -> StageStats:
    stats = StageStats()
    kept: list[dict] = []
    rejected: list[dict] = []

    def flush(final: bool = False) -> None:
        if kept and (final or len(kept) >= cfg.rows_per_shard):
            writer.write_table(pa.Table.from_pylist(kept, schema=DOC_SCHEMA))
            kept.clear()

    for raw in inputs:
        for item in READERS[file_kind(raw.path)](raw.path):
            stats.rows_in += 1
            if item[0] == "bad":
                _, sid, reason, detail = item
                rejected.append({"doc_id": make_doc_id(sid, ""), "source_id": sid, "reason": reason,
                                 "detail": f"{raw.path}: {detail}"})
                stats.rejected[reason] += 1
                continue
            rec = item[1]
            nbytes = len(rec["text"].encode("utf-8", "surrogatepass"))
            stats.bytes_in += nbytes
            reason = detail = None
            if "\x00" in rec["text"]:
                reason, detail = "nul_bytes", f"{raw.path}: text holds NUL bytes"
            elif nbytes > cfg.max_doc_bytes:
                reason, detail = "too_large", f"{raw.path}: {nbytes} bytes > max_doc_bytes={cfg.max_doc_bytes}"
            if reason:
                rejected.append({"doc_id": make_doc_id(rec["source_id"], rec["text"]), "source_id": rec["source_id"],
                                 "reason": reason, "detail": detail})
                stats.rejected[reason] += 1
                continue
            rec["doc_id"] = make_doc_id(rec["source_id"], rec["text"])
            kept.append(rec)
            stats.rows_kept += 1
            stats.bytes_out += nbytes
            flush()
    flush(final=True)
    if rejected:
        writer.write_table(rejected_table(rejected, STAGE), kind="rejected")
    return stats


def run_collect(cfg: CollectConfig, workdir: str, inputs: list[RawFile] | None = None) -> DatasetRef:
    inputs = resolve_inputs(cfg.inputs) if inputs is None else inputs

    def build(writer: DatasetWriter) -> dict:
        return {"stats": collect_files(inputs, cfg, writer)}

    return materialize(workdir, STAGE, cfg, code_version(sys.modules[__name__]), build, inputs=inputs)
