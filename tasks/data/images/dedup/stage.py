"""Image dedup: exact copies by the hash of the decoded pixels (so lossless re-encodes match whatever their bytes),
then near copies by a 64-bit perceptual hash within Hamming distance `k`, found through the banded index the text
path's SimHash uses (tasks/data/dedup/simhash.py: `blocks` blocks, C(blocks, k) tables, every pair within distance
k is a candidate, each candidate checked), clusters as connected components.

The first pair of each cluster in dataset order (file, then row) is kept; every other is rejected with reason
exact_duplicate or near_duplicate, `duplicate_of` the kept image's id and the detail its Hamming distance.
Kept rows gain `cluster_size` (1 for a unique image). One task: the decision needs every image's hashes, which
image_collect computed (pixel_sha256, phash), so only those columns are read for it; the rows are then copied file
by file. Recall and false merges on the corpus's planted variants: bench/image_dedup.py.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lifecycle.core.code import code_version
from lifecycle.core.dataset import DatasetRef, DatasetWriter, StageStats, materialize, read_parquet, rejected_table
from lifecycle.core.shards import StageCode, heartbeat
from lifecycle.tasks.data.dedup.simhash import check, hamming, table_keys

NAME = "image_dedup"


class ImageDedupConfig(BaseModel):
    """Exact and near-duplicate removal of images."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    exact: bool = True
    """Drop images whose decoded pixels equal an earlier image's (exact_duplicate)."""
    near: bool = True
    """Drop images whose pHash is within `k` bits of an earlier image's, through the cluster (near_duplicate)."""
    k: int = Field(8, ge=0, le=32)
    """Hamming radius on the 64-bit pHash. bench/image_dedup.py measures recall and false merges per k on the
    planted variants (docs/benchmarks.md, "Issue 48")."""
    blocks: int = Field(10, ge=1, le=64)
    """Blocks of the banded index (> k): C(blocks, k) tables; more blocks, narrower keys, more random candidates
    (each one checked, so only time is at stake)."""

    @model_validator(mode="after")
    def _blocks(self) -> "ImageDedupConfig":
        try:
            check(self.k, self.blocks)
        except ValueError as e:
            raise ValueError(str(e).replace("dedup.simhash", "image_dedup")) from e
        return self


class _Components:
    """Union-find whose root is always the smallest index (the first image in dataset order)."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def near_pairs(hashes: np.ndarray, k: int, blocks: int) -> list[tuple[int, int, int]]:
    """(i, j, distance), i < j, of every pair within Hamming distance k, through the banded tables."""
    if len(hashes) < 2:
        return []
    keys = table_keys(hashes.astype(np.uint64), k, blocks)
    found: dict[tuple[int, int], int] = {}
    for t in range(keys.shape[1]):
        buckets: dict[int, list[int]] = defaultdict(list)
        for i, key in enumerate(keys[:, t].tolist()):
            buckets[key].append(i)
        for members in buckets.values():
            if len(members) < 2:
                continue
            m = np.array(members)
            for a in range(len(m) - 1):
                d = hamming(np.full(len(m) - a - 1, hashes[m[a]]), hashes[m[a + 1:]])
                for b, dist in zip(m[a + 1:][d <= k].tolist(), d[d <= k].tolist()):
                    found.setdefault((int(m[a]), b), int(dist))
    return [(i, j, d) for (i, j), d in sorted(found.items())]


def decide(pixel: list[str], phash: np.ndarray, cfg: ImageDedupConfig) -> dict[int, tuple[int, str, int]]:
    """Row (in dataset order) -> (kept row it duplicates, reason, Hamming distance) for every dropped row."""
    comp = _Components(len(pixel))
    exact_of: dict[str, int] = {}
    for i, h in enumerate(pixel):
        if cfg.exact and h in exact_of:
            comp.union(exact_of[h], i)
        exact_of.setdefault(h, i)
    dist: dict[int, int] = {}
    if cfg.near:
        for i, j, d in near_pairs(phash, cfg.k, cfg.blocks):
            comp.union(i, j)
            dist[j] = min(dist.get(j, 64), d)
    out = {}
    for i in range(len(pixel)):
        root = comp.find(i)
        if root != i:
            exact = cfg.exact and pixel[i] == pixel[root]
            out[i] = (root, "exact_duplicate" if exact else "near_duplicate",
                      0 if exact else int(hamming(phash[[root]], phash[[i]])[0]))
    return out


def _build(parent: DatasetRef, cfg: ImageDedupConfig, writer: DatasetWriter) -> dict:
    files = parent.files()
    keys = [read_parquet(p, columns=["image_id", "pixel_sha256", "phash"]) for p in files]
    ids = [i for t in keys for i in t.column("image_id").to_pylist()]
    pixel = [h for t in keys for h in t.column("pixel_sha256").to_pylist()]
    phash = np.array([h for t in keys for h in t.column("phash").to_pylist()], dtype=np.uint64)
    dropped = decide(pixel, phash, cfg)
    sizes: dict[int, int] = defaultdict(lambda: 1)
    for root, _, _ in dropped.values():
        sizes[root] += 1
    stats, offset = StageStats(rows_in=len(ids)), 0
    for path in files:
        heartbeat()
        table = read_parquet(path)
        rows = range(offset, offset + table.num_rows)
        keep = [r - offset for r in rows if r not in dropped]
        rejected = [{"doc_id": ids[r], "source_id": table.column("source_id")[r - offset].as_py(),
                     "reason": dropped[r][1], "duplicate_of": ids[dropped[r][0]],
                     "detail": f"duplicate_of={ids[dropped[r][0]]} hamming={dropped[r][2]}"}
                    for r in rows if r in dropped]
        kept = table.take(pa.array(keep, type=pa.int64()))
        kept = kept.append_column("cluster_size", pa.array([sizes[offset + i] for i in keep], pa.int32()))
        writer.write_table(kept)
        if rejected:
            writer.write_table(rejected_table(rejected, NAME, [pa.field("duplicate_of", pa.string())]),
                               kind="rejected")
        for r in rejected:
            stats.rejected[r["reason"]] += 1
        stats.rows_kept += kept.num_rows
        offset += table.num_rows
    stats.counters["clusters"] = sum(1 for s in sizes.values() if s > 1)
    return {"stats": stats}


def run_image_dedup(parent: DatasetRef, cfg: ImageDedupConfig, workdir: str) -> DatasetRef:
    return materialize(workdir, NAME, cfg, code_version(__package__), lambda w: _build(parent, cfg, w),
                       parents=[parent])


STAGE = StageCode(run=run_image_dedup)
