"""Image collect: read image-text pairs (WebDataset tar shards, Parquet), decode-verify every image with Pillow
and record its format, width, height, sha256, pixel hash and perceptual hash (`lifecycle.tasks.data.images.pixels`).

Quarantined, each with a reason and never stopping its shard: corrupt (Pillow cannot identify or verify it),
truncated (the full load breaks off), decompression_bomb (the header claims more than `max_pixels`), oversized
(a side above `max_side`), oversized_bytes, no_image, no_caption, bad_text (a caption that is not UTF-8 or a
key.json that is not JSON), tar_damaged (an archive that breaks off: one row for the rest of the file) and
forgotten (an exact or near copy of an image in the work dir's tombstone ledger, `images/tombstones.py`).
Sharded over its input files, consecutive small files together (`shard_bytes`), like text collect.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core import fs
from lifecycle.core.code import code_version
from lifecycle.core.dataset import DatasetRef, RawFile, StageStats, rejected_table
from lifecycle.core.shards import StageCode, StagePlan, group_files, heartbeat, plan_stage, run_plan
from lifecycle.tasks.data.images.collect.readers import file_kind, read_parquet_pairs, read_tar
from lifecycle.tasks.data.images.pixels import IMAGE_SCHEMA, Limits, Refused, decode, image_id, meta_json, phash, pixel_sha256
from lifecycle.tasks.data.images.tombstones import REASON as FORGOTTEN, ImageForgetFilter

NAME = "image_collect"


class ImageCollectConfig(BaseModel):
    """Where the image-text pairs are and what decode refuses."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Run the image-text path (image_collect -> image_filter -> image_dedup -> image_scrub -> image_preprocess)
    instead of the text path; deploy/configs/clip-demo.yaml turns it on."""
    inputs: list[str] = []
    """Glob patterns (local or fsspec URLs) of WebDataset .tar shards (key.jpg|png|webp + key.txt + optional
    key.json, as img2dataset writes them) and .parquet files (`image_column`, `caption_column`)."""
    image_column: str = "image"
    """Parquet inputs: the column of encoded image bytes (binary, or a struct with `bytes` as Hugging Face writes)."""
    caption_column: str = "caption"
    """Parquet inputs: the caption column."""
    max_bytes: int = Field(16 << 20, gt=0)
    """An encoded image larger than this is rejected as oversized_bytes without being decoded (16 MiB)."""
    max_pixels: int = Field(40_000_000, gt=0)
    """An image whose header claims more pixels is rejected as decompression_bomb before any pixel is allocated
    (40 MP; Pillow's own warning is at 89.5 MP, its error at twice that)."""
    max_side: int = Field(8192, gt=0)
    """An image with a side longer than this is rejected as oversized."""
    rows_per_part: int = Field(512, gt=0)
    """Kept pairs per output Parquet file (the image bytes are in the rows)."""
    shard_bytes: int = Field(64 << 20, gt=0)
    """Consecutive input files are one shard up to this many raw bytes; a larger file is a shard of its own."""


class ImageCollectRun(ImageCollectConfig):
    """The config a run collects with: the user's, plus the work dir's tombstones (never set in YAML)."""

    forgotten: ImageForgetFilter | None = None
    """The image tombstone ledger's rows (`plan_image_collect` reads them); part of the fingerprint."""


def resolve_image_inputs(patterns: list[str]) -> list[RawFile]:
    """Expand the globs (sorted, each file once) and fingerprint every file by its sha256; a pattern that matches
    nothing or a file of another type is a ValueError naming it."""
    seen: dict[str, RawFile] = {}
    for i, pattern in enumerate(patterns):
        matched = fs.glob_files(pattern)
        if not matched:
            raise ValueError(f"image_collect.inputs[{i}]: pattern {pattern!r} matches no file")
        for p in matched:
            file_kind(p)
            if p not in seen:
                seen[p] = RawFile(path=p, sha256=fs.sha256_file(p), bytes=fs.size(p))
    return list(seen.values())


def _records(path: str, cfg: ImageCollectConfig):
    if file_kind(path) == "tar":
        return read_tar(fs.local_path(path), cfg.max_bytes)
    return read_parquet_pairs(path, cfg.image_column, cfg.caption_column)


def verified_row(rec: dict, source: str, limits: Limits) -> dict:
    """The kept row of one well-formed record, or Refused (the image did not decode-verify)."""
    data = rec["image"]
    im = decode(data, limits)
    digest = hashlib.sha256(data).hexdigest()
    return {"image_id": image_id(rec["source_id"], digest), "source_id": rec["source_id"], "caption": rec["caption"],
            "image": data, "format": im.format, "width": im.width, "height": im.height, "sha256": digest,
            "pixel_sha256": pixel_sha256(im), "phash": phash(im), "source": source, "meta": meta_json(rec["meta"])}


def collect_shard(cfg: ImageCollectConfig, paths: list[str], writer) -> StageStats:
    """Every record of the shard's files: kept rows in parts of `rows_per_part`, rejected rows beside."""
    stats, kept, rejected = StageStats(), [], []
    limits = Limits(cfg.max_bytes, cfg.max_pixels, cfg.max_side)
    forgotten = getattr(cfg, "forgotten", None)
    for path in paths:
        for item in _records(path, cfg):
            stats.rows_in += 1
            heartbeat()
            if item[0] == "bad":
                _, sid, reason, detail = item
                rejected.append({"doc_id": image_id(sid, ""), "source_id": sid, "reason": reason, "detail": detail})
                stats.rejected[reason] += 1
                continue
            rec = item[1]
            stats.bytes_in += len(rec["image"])
            try:
                row = verified_row(rec, path, limits)
            except Refused as e:
                rejected.append({"doc_id": image_id(rec["source_id"], hashlib.sha256(rec["image"]).hexdigest()),
                                 "source_id": rec["source_id"], "reason": e.reason, "detail": str(e)})
                stats.rejected[e.reason] += 1
                continue
            if forgotten is not None and (detail := forgotten.match(row)):
                rejected.append({"doc_id": row["image_id"], "source_id": row["source_id"], "reason": FORGOTTEN,
                                 "detail": detail})
                stats.rejected[FORGOTTEN] += 1
                continue
            kept.append(row)
            stats.rows_kept += 1
            stats.bytes_out += len(row["image"])
            stats.counters[f"format_{row['format'].lower()}"] += 1
            if len(kept) >= cfg.rows_per_part:
                writer.write_table(pa.Table.from_pylist(kept, schema=IMAGE_SCHEMA))
                kept = []
    if kept:
        writer.write_table(pa.Table.from_pylist(kept, schema=IMAGE_SCHEMA))
    if rejected:
        writer.write_table(rejected_table(rejected, NAME), kind="rejected")
    return stats


def plan_image_collect(cfg: ImageCollectConfig, workdir: str, inputs: list[RawFile] | None = None
                       ) -> StagePlan | DatasetRef:
    inputs = resolve_image_inputs(cfg.inputs) if inputs is None else inputs
    if (forgotten := ImageForgetFilter.from_workdir(workdir)) is not None:
        cfg = ImageCollectRun(**cfg.model_dump(), forgotten=forgotten)
    shards = group_files([(r.path, r.bytes) for r in inputs], cfg.shard_bytes)
    return plan_stage(workdir, NAME, cfg, code_version(__package__), collect_shard, shards, inputs=inputs)


def run_image_collect(cfg: ImageCollectConfig, workdir: str, inputs: list[RawFile] | None = None) -> DatasetRef:
    return run_plan(plan_image_collect(cfg, workdir, inputs))


STAGE = StageCode(run=run_image_collect, plan=plan_image_collect, shard=collect_shard)
