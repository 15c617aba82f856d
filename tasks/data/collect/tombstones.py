"""The tombstone ledger: documents a deletion request removed for good (`lifecycle forget`).

`<workdir>/tombstones.parquet` holds one row per forgotten document: its source id and doc_id, the sha256 of its
normalised text (lower-case, whitespace collapsed: `content_hash`), its MinHash signature (dedup's shingles,
permutations and LSH bands: `lifecycle.tasks.data.dedup.minhash`), the MinHash parameters, the time and the reason
given. It holds no document text: a hash and a signature cannot be turned back into the text.

Every later collect rejects a document that matches a tombstone, with reason `forgotten` (`ForgetFilter`):
- an exact copy: the same normalised-text hash;
- a near copy: a document that shares one LSH band key with a tombstone's signature (dedup's rule for a near
  duplicate: `bands` x `rows`, FineWeb's 14 x 8) and, when dedup's `verify_jaccard` is set, whose signature
  agrees with the tombstone's on at least that share of its values (dedup's estimate against its index).
The ledger's sha256 is part of the collect fingerprint (`ForgetFilter.ledger_sha256`), so a cached collect dataset
is rebuilt when the ledger changes. An empty or absent ledger changes nothing.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core.fs import atomic_write_bytes, sha256_file

LEDGER = "tombstones.parquet"
REASON = "forgotten"  # the collect rejection reason of a tombstoned document
SCHEMA = pa.schema([
    ("tombstone_id", pa.string()),  # sha256(content_hash, source_id)[:16]: stable for one request
    ("source_id", pa.string()),
    ("doc_id", pa.string()),
    ("content_hash", pa.string()),
    ("signature", pa.list_(pa.uint32())),
    ("ngram", pa.int32()), ("bands", pa.int32()), ("rows", pa.int32()), ("seed", pa.int64()),
    ("verify_jaccard", pa.float64()),
    ("reason", pa.string()),
    ("created_at", pa.string()),
])


class MinHashParams(BaseModel):
    """dedup's MinHash parameters (`DedupConfig`: ngram, bands, rows, seed, verify_jaccard)."""

    model_config = ConfigDict(frozen=True)
    ngram: int = 5
    bands: int = 14
    rows: int = 8
    seed: int = 1
    verify_jaccard: float | None = None

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows


def content_hash(text: str) -> str:
    """sha256 of the normalised text: lower-case, runs of whitespace as one space, no leading/trailing space."""
    return hashlib.sha256(" ".join(text.lower().split()).encode("utf-8", "surrogatepass")).hexdigest()


def signatures(texts: list[str], p: MinHashParams) -> np.ndarray:
    # imported here: numba and datasketch cost a collect process ~100 MiB, paid only when there are tombstones
    from lifecycle.tasks.data.dedup import minhash

    return minhash.signatures(texts, p.ngram, p.num_perm, p.seed)


def band_keys(sig: np.ndarray, p: MinHashParams) -> np.ndarray:
    from lifecycle.tasks.data.dedup import minhash

    return minhash.band_keys(sig, p.bands, p.rows)


def read_ledger(workdir: str | Path) -> pa.Table:
    path = Path(workdir) / LEDGER
    return pq.read_table(path) if path.exists() else SCHEMA.empty_table()


def ledger_sha256(workdir: str | Path) -> str | None:
    path = Path(workdir) / LEDGER
    return sha256_file(path) if path.exists() else None


def tombstone_rows(docs: list[dict], reason: str, p: MinHashParams, now: str | None = None) -> list[dict]:
    """Ledger rows for documents {doc_id, source_id, text}: hashes and signatures only, never the text."""
    now = now or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sig = signatures([d["text"] for d in docs], p)
    rows = []
    for d, s in zip(docs, sig):
        h = content_hash(d["text"])
        rows.append({"tombstone_id": hashlib.sha256(f"{h}\x00{d['source_id']}".encode()).hexdigest()[:16],
                     "source_id": d["source_id"], "doc_id": d["doc_id"], "content_hash": h,
                     "signature": s.tolist(), **p.model_dump(), "reason": reason, "created_at": now})
    return rows


def add_tombstones(workdir: str | Path, rows: list[dict]) -> list[dict]:
    """Append the rows whose tombstone_id is new (atomic rewrite of the ledger); returns the new ones. The
    MinHash parameters must match the ledger's (a signature made with others cannot be compared)."""
    old = read_ledger(workdir)
    if old.num_rows and rows:
        have = MinHashParams(**{k: old.column(k)[0].as_py() for k in MinHashParams.model_fields})
        for r in rows:
            new = MinHashParams(**{k: r[k] for k in MinHashParams.model_fields})
            if new != have:
                raise ValueError(f"{Path(workdir) / LEDGER}: tombstones use dedup MinHash parameters {have.model_dump()}, "
                                 f"the request uses {new.model_dump()} (dedup.ngram/bands/rows/seed/verify_jaccard "
                                 "must stay as they were when the ledger was started)")
    seen = set(old.column("tombstone_id").to_pylist())
    fresh = [r for r in rows if r["tombstone_id"] not in seen and not seen.add(r["tombstone_id"])]
    if fresh:
        table = pa.concat_tables([old, pa.Table.from_pylist(fresh, schema=SCHEMA)])
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf)
        atomic_write_bytes(Path(workdir) / LEDGER, buf.getvalue().to_pybytes())
    return fresh


class ForgetFilter(BaseModel):
    """What collect needs to reject tombstoned documents: part of the collect fingerprint (the ledger's sha256,
    and the hashes and signatures themselves), so the shards see exactly the ledger the plan was made with."""

    model_config = ConfigDict(frozen=True)
    ledger_sha256: str
    minhash: MinHashParams
    tombstone_ids: tuple[str, ...]
    content_hashes: tuple[str, ...]
    signatures: tuple[tuple[int, ...], ...] = Field(repr=False)

    @classmethod
    def from_workdir(cls, workdir: str | Path) -> "ForgetFilter | None":
        t = read_ledger(workdir)
        if not t.num_rows:
            return None
        p = MinHashParams(**{k: t.column(k)[0].as_py() for k in MinHashParams.model_fields})
        return cls(ledger_sha256=ledger_sha256(workdir), minhash=p,
                   tombstone_ids=tuple(t.column("tombstone_id").to_pylist()),
                   content_hashes=tuple(t.column("content_hash").to_pylist()),
                   signatures=tuple(tuple(s) for s in t.column("signature").to_pylist()))

    def matcher(self) -> "Matcher":
        return Matcher(self)


class Matcher:
    """`match(text)` -> (tombstone_id, "exact" | "near", similarity) of the first tombstone the text copies, or None."""

    def __init__(self, f: ForgetFilter):
        self.f, self.p = f, f.minhash
        self.exact = {h: i for i, h in enumerate(f.content_hashes)}
        self.sig = np.array(f.signatures, np.uint32).reshape(len(f.signatures), self.p.num_perm)
        self.keys = band_keys(self.sig, self.p)

    def match(self, text: str) -> tuple[str, str, float] | None:
        i = self.exact.get(content_hash(text))
        if i is not None:
            return self.f.tombstone_ids[i], "exact", 1.0
        sig = signatures([text], self.p)
        keys = band_keys(sig, self.p)
        candidates = np.flatnonzero((self.keys == keys).any(axis=1))
        if not len(candidates):
            return None
        est = (self.sig[candidates] == sig).mean(axis=1)  # the signatures' Jaccard estimate
        best = int(np.argmax(est))
        if self.p.verify_jaccard is not None and est[best] < self.p.verify_jaccard:
            return None
        return self.f.tombstone_ids[candidates[best]], "near", float(est[best])


def find_documents(workdir: str | Path, ids: list[str]) -> list[dict]:
    """{doc_id, source_id, text} of every document that a committed collect dataset of the work dir kept with one
    of these doc_ids or source_ids (each doc_id once), for `lifecycle forget` to hash; raises naming the ids
    that no collect dataset holds."""
    import pyarrow.compute as pc

    from lifecycle.core.dataset import DatasetRef, committed_datasets

    want = pa.array(list(ids), pa.string())
    found: dict[str, dict] = {}
    for d in committed_datasets(workdir):
        if d.parent.name != "collect":
            continue
        for f in DatasetRef.from_dir(d).files():
            t = pq.read_table(f, columns=["doc_id", "source_id", "text"])
            hit = t.filter(pc.or_(pc.is_in(t["doc_id"], want), pc.is_in(t["source_id"], want)))
            for r in hit.to_pylist():
                found.setdefault(r["doc_id"], r)
    missing = sorted(set(ids) - {r["doc_id"] for r in found.values()} - {r["source_id"] for r in found.values()})
    if missing:
        raise LookupError(f"no collect dataset in {workdir} holds a document with doc_id or source_id "
                          f"{', '.join(missing)}")
    return sorted(found.values(), key=lambda r: r["doc_id"])
