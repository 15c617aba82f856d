"""The image tombstone ledger: images a deletion request removed for good (`lifecycle forget IMAGE_ID` on a run of
the image path), the image counterpart of the text ledger (`tasks/data/collect/tombstones.py`).

`<workdir>/image_tombstones.parquet` holds one row per forgotten image: its image_id (column `doc_id`, as rejected
rows name it) and source_id, the sha256 of its encoded bytes, the sha256 of its decoded pixels, its 64-bit pHash,
the Hamming radius `k` of image_dedup when it was recorded, the reason and the time. It holds no pixels and no
caption: hashes cannot be turned back into the image.

Every later image_collect rejects, with reason `forgotten`, an image that is
- an exact copy: the same encoded bytes or the same decoded pixels (a lossless re-encode), or
- a near copy: a pHash within `k` bits of a tombstone's, image_dedup's own rule for a near duplicate.
The ledger's sha256 and its rows are part of image_collect's fingerprint (`ImageForgetFilter`), so the next run
rebuilds image_collect and every stage after it, and the new model is trained without the image.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict

from lifecycle.core.errors import UsageError
from lifecycle.core.fs import atomic_write_bytes, sha256_file

LEDGER = "image_tombstones.parquet"
REASON = "forgotten"
SCHEMA = pa.schema([("tombstone_id", pa.string()), ("doc_id", pa.string()), ("source_id", pa.string()),
                    ("sha256", pa.string()), ("pixel_sha256", pa.string()), ("phash", pa.uint64()),
                    ("k", pa.int32()), ("reason", pa.string()), ("created_at", pa.string())])
COLLECT = "image_collect"


def read_ledger(workdir: str | Path) -> pa.Table:
    path = Path(workdir) / LEDGER
    return pq.read_table(path).cast(SCHEMA) if path.exists() else SCHEMA.empty_table()


def find_images(workdir: str | Path, ids: list[str]) -> list[dict]:
    """The collected rows (image_id, source_id, sha256, pixel_sha256, phash) of every image a committed
    image_collect dataset kept with one of these image_ids or source_ids; raises naming the ids none holds."""
    from lifecycle.core.dataset import DatasetRef, committed_datasets

    want, found = pa.array(list(ids), pa.string()), {}
    for d in committed_datasets(workdir):
        if d.parent.name != COLLECT:
            continue
        for f in DatasetRef.from_dir(d).files():
            t = pq.read_table(f, columns=["image_id", "source_id", "sha256", "pixel_sha256", "phash"])
            for r in t.filter(pc.or_(pc.is_in(t["image_id"], want), pc.is_in(t["source_id"], want))).to_pylist():
                found.setdefault(r["image_id"], r)
    missing = sorted(set(ids) - {r["image_id"] for r in found.values()} - {r["source_id"] for r in found.values()})
    if missing:
        raise UsageError(f"no image_collect dataset in {workdir} kept an image with image_id or source_id "
                         f"{', '.join(missing)}: nothing was recorded (`lifecycle lineage doc ID` says where an id went)")
    return sorted(found.values(), key=lambda r: r["image_id"])


def tombstone_rows(images: list[dict], reason: str, k: int, now: str | None = None) -> list[dict]:
    now = now or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return [{"tombstone_id": hashlib.sha256(f"{r['pixel_sha256']}\x00{r['source_id']}".encode()).hexdigest()[:16],
             "doc_id": r["image_id"], "source_id": r["source_id"], "sha256": r["sha256"],
             "pixel_sha256": r["pixel_sha256"], "phash": r["phash"], "k": k, "reason": reason, "created_at": now}
            for r in images]


def add_tombstones(workdir: str | Path, rows: list[dict]) -> None:
    """Append the rows not in the ledger yet (by tombstone_id); the ledger is rewritten atomically."""
    old = read_ledger(workdir)
    have = set(old.column("tombstone_id").to_pylist())
    new = [r for r in rows if r["tombstone_id"] not in have]
    if not new:
        return
    buf = pa.BufferOutputStream()
    pq.write_table(pa.concat_tables([old, pa.Table.from_pylist(new, schema=SCHEMA)]), buf)
    atomic_write_bytes(Path(workdir) / LEDGER, buf.getvalue().to_pybytes())


class ImageForgetFilter(BaseModel):
    """What image_collect needs to reject tombstoned images; part of its fingerprint."""

    model_config = ConfigDict(frozen=True)
    ledger_sha256: str
    tombstone_ids: tuple[str, ...]
    sha256s: tuple[str, ...]
    pixel_sha256s: tuple[str, ...]
    phashes: tuple[int, ...]
    ks: tuple[int, ...]

    @classmethod
    def from_workdir(cls, workdir: str | Path) -> "ImageForgetFilter | None":
        t = read_ledger(workdir)
        if not t.num_rows:
            return None
        col = lambda name: tuple(t.column(name).to_pylist())
        return cls(ledger_sha256=sha256_file(Path(workdir) / LEDGER), tombstone_ids=col("tombstone_id"),
                   sha256s=col("sha256"), pixel_sha256s=col("pixel_sha256"), phashes=col("phash"), ks=col("k"))

    def match(self, row: dict) -> str | None:
        """A rejection detail when the collected row (sha256, pixel_sha256, phash) copies a tombstone, else None."""
        for i, tid in enumerate(self.tombstone_ids):
            if row["sha256"] == self.sha256s[i] or row["pixel_sha256"] == self.pixel_sha256s[i]:
                return f"exact copy of tombstone {tid}"
            if (d := (int(row["phash"]) ^ self.phashes[i]).bit_count()) <= self.ks[i]:
                return f"near copy of tombstone {tid} (pHash {d} bits apart, radius {self.ks[i]})"
        return None
