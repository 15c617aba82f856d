"""Readers of image-text inputs: WebDataset tar shards and Parquet. Each yields ("ok", record) or ("bad", source_id,
reason, detail); a damaged record never stops its file, a damaged archive ends it with one rejected row.

WebDataset (what img2dataset writes): the members of a tar grouped by key, the member's path up to the first dot
of its file name (`00000/000000012.jpg`, `.txt`, `.json` -> key `00000/000000012`), image suffixes jpg, jpeg, png,
webp, gif, bmp, tif, tiff. Parquet: a binary image column (or a struct with a `bytes` field, as Hugging Face
`datasets` writes `Image()` columns) and a string caption column, read one record batch at a time.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import PurePosixPath

import pyarrow.parquet as pq

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
Item = tuple


def file_kind(path: str) -> str:
    p = path.lower()
    if p.endswith(".tar"):
        return "tar"
    if p.endswith(".parquet"):
        return "parquet"
    raise ValueError(f"{path}: unsupported image input (expected WebDataset .tar or .parquet)")


def _key(name: str) -> tuple[str, str]:
    """(key, suffix) of a WebDataset member name."""
    p = PurePosixPath(name)
    stem, _, suffix = p.name.partition(".")
    return str(p.with_name(stem)), suffix.lower()


def _record(path: str, key: str, parts: dict[str, bytes]) -> Item:
    sid = f"{path}:{key}"
    images = [s for s in parts if s in IMAGE_SUFFIXES]
    if not images:
        return ("bad", sid, "no_image", f"record {key} has no image member ({', '.join(sorted(parts))})")
    if "txt" not in parts:
        return ("bad", sid, "no_caption", f"record {key} has no .txt caption")
    try:
        caption = parts["txt"].decode("utf-8")
        meta = json.loads(parts["json"]) if "json" in parts else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return ("bad", sid, "bad_text", f"record {key}: {type(e).__name__}: {e}"[:300])
    return ("ok", {"source_id": sid, "caption": caption, "image": parts[images[0]], "meta": meta})


def read_tar(path: str, max_member_bytes: int) -> Iterator[Item]:
    """One record per key, in the order keys first appear. A member larger than `max_member_bytes` is not read
    (its record is rejected as oversized_bytes); an archive that breaks off ends the file with a `tar_damaged` row."""
    key, parts, too_big = None, {}, None
    try:
        with tarfile.open(path, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                k, suffix = _key(member.name)
                if k != key and key is not None:
                    yield _flush(path, key, parts, too_big)
                    parts, too_big = {}, None
                key = k
                if member.size > max_member_bytes:
                    too_big = f"member {member.name}: {member.size} bytes > max_bytes {max_member_bytes}"
                    continue
                f = tar.extractfile(member)
                parts[suffix] = f.read() if f is not None else b""
    except (tarfile.TarError, OSError, EOFError) as e:
        yield ("bad", f"{path}:<archive>", "tar_damaged", f"{type(e).__name__}: {e} (after key {key})"[:300])
        return
    if key is not None:
        yield _flush(path, key, parts, too_big)


def _flush(path: str, key: str, parts: dict[str, bytes], too_big: str | None) -> Item:
    if too_big:
        return ("bad", f"{path}:{key}", "oversized_bytes", too_big)
    return _record(path, key, parts)


def read_parquet_pairs(path: str, image_column: str, caption_column: str, batch_rows: int = 256) -> Iterator[Item]:
    """One record per row: the image bytes, the caption, the other columns as meta."""
    f = pq.ParquetFile(path)
    missing = [c for c in (image_column, caption_column) if c not in f.schema_arrow.names]
    if missing:
        raise ValueError(f"{path}: no column(s) {missing} (image_inputs.image_column / caption_column); it has "
                         f"{f.schema_arrow.names}")
    row = 0
    for batch in f.iter_batches(batch_size=batch_rows):
        for rec in batch.to_pylist():
            sid = f"{path}:{row}"
            row += 1
            image, caption = rec.pop(image_column), rec.pop(caption_column)
            if isinstance(image, dict):
                image = image.get("bytes")
            if not image:
                yield ("bad", sid, "no_image", f"row {row - 1}: {image_column} is empty")
            elif caption is None:
                yield ("bad", sid, "no_caption", f"row {row - 1}: {caption_column} is null")
            else:
                meta = {k: v for k, v in rec.items() if isinstance(v, (str, int, float, bool)) or v is None}
                yield ("ok", {"source_id": sid, "caption": str(caption), "image": bytes(image), "meta": meta})
