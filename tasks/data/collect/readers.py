"""collect's readers: one per input kind (`file_kind`), each yielding ("ok", record dict) or
("bad", source_id, reason, detail) for every record of a file, and the line-aligned byte ranges (`FilePart`) a
large uncompressed JSONL file is split into. stage.py drives them (`collect_shard`)."""

from __future__ import annotations

import json
from typing import Iterator

import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict

from lifecycle.core import fs
from lifecycle.core.dataset import RawFile
from lifecycle.tasks.data.collect.config import CollectConfig
from lifecycle.tasks.data.collect.inputs import shown
from lifecycle.tasks.data.collect.streams import COMPRESSED, STREAM_ERRORS, open_stream, truncated_reason

KNOWN_FIELDS = ("id", "text", "source", "url")
WHERE = "_where"  # a reader's (record number, byte start, byte end) of a record in its raw file, beside the row


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
