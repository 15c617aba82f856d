"""The tombstone ledger: documents a deletion request removed for good (`lifecycle forget`).

`<workdir>/tombstones.parquet` holds one row per forgotten document: its source id and doc_id, the sha256 of its
normalised text (lower-case, whitespace collapsed: `content_hash`), its near-duplicate fingerprint under the dedup
method configured when it was recorded (`dedup.method`), that method's parameters, the time and the reason given:
- `minhash`: its MinHash signature (dedup's shingles, permutations and LSH bands:
  `lifecycle.tasks.data.dedup.minhash`) and the MinHash parameters (`dedup.minhash`);
- `simhash`: its 64-bit SimHash (`lifecycle.tasks.data.dedup.simhash`, `dedup.simhash`'s k, blocks and n-gram).
It holds no document text: a hash and a signature cannot be turned back into the text.

Every later collect rejects a document that matches a tombstone, with reason `forgotten` (`ForgetFilter`):
- an exact copy: the same normalised-text hash;
- a near copy, by dedup's own rule for a near duplicate under the ledger's method:
  - minhash: a document that shares one LSH band key with a tombstone's signature (`bands` x `rows`, FineWeb's
    14 x 8) and, when `dedup.minhash.verify_jaccard` is set, whose signature agrees with the tombstone's on at least that
    share of its values (dedup's estimate against its index);
  - simhash: a document whose SimHash shares a key with the tombstone's in one of the permuted tables
    (Manku et al.'s blocking) and lies within Hamming distance `k` of it.
The method and its parameters must stay as they were when the ledger was started (`add_tombstones` refuses
others: fingerprints made another way cannot be compared). A ledger written before the method was recorded reads
as minhash. The ledger's sha256 is part of the collect fingerprint (`ForgetFilter.ledger_sha256`), so a cached
collect dataset is rebuilt when the ledger changes. An empty or absent ledger changes nothing.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core.errors import UsageError
from lifecycle.core.fs import atomic_write_bytes, sha256_file
from lifecycle.tasks.data.dedup.params import MinHashConfig, SimHashConfig

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
    ("method", pa.string()),  # minhash | simhash (absent in a ledger written before: minhash)
    ("simhash", pa.uint64()),
    ("simhash_k", pa.int32()), ("simhash_blocks", pa.int32()), ("simhash_ngram", pa.int32()),
])


class MinHashParams(MinHashConfig):
    """dedup's MinHash parameters as a ledger records them: `dedup.minhash` (ngram, bands, rows, seed,
    verify_jaccard) and the method's name."""

    method: Literal["minhash"] = "minhash"

    def columns(self) -> dict:
        return self.model_dump()


class SimHashParams(SimHashConfig):
    """dedup's SimHash parameters as a ledger records them: `dedup.simhash` (k, blocks, ngram) and the method's
    name."""

    method: Literal["simhash"] = "simhash"

    def columns(self) -> dict:
        return {"method": self.method, "simhash_k": self.k, "simhash_blocks": self.blocks,
                "simhash_ngram": self.ngram}


Params = MinHashParams | SimHashParams


def params_of(dedup) -> Params:
    """The near-copy parameters of a `DedupConfig`: its configured method's, as dedup uses them."""
    if dedup.method == "simhash":
        return SimHashParams(**dedup.simhash.model_dump())
    return MinHashParams(**dedup.minhash.model_dump())


def ledger_params(row: dict) -> Params:
    """The parameters a ledger row was recorded with (no `method`: a ledger from before SimHash, minhash)."""
    if row.get("method") == "simhash":
        return SimHashParams(k=row["simhash_k"], blocks=row["simhash_blocks"], ngram=row["simhash_ngram"])
    return MinHashParams(**{k: row[k] for k in MinHashConfig.model_fields})


def content_hash(text: str) -> str:
    """sha256 of the normalised text: lower-case, runs of whitespace as one space, no leading/trailing space."""
    return hashlib.sha256(" ".join(text.lower().split()).encode("utf-8", "surrogatepass")).hexdigest()


def signatures(texts: list[str], p: MinHashParams) -> np.ndarray:
    # imported here: numba and datasketch cost a collect process memory, paid only when there are tombstones
    from lifecycle.tasks.data.dedup import minhash

    return minhash.signatures(texts, p.ngram, p.num_perm, p.seed)


def band_keys(sig: np.ndarray, p: MinHashParams) -> np.ndarray:
    from lifecycle.tasks.data.dedup import minhash

    return minhash.band_keys(sig, p.bands, p.rows)


def simhashes(texts: list[str], p: SimHashParams) -> np.ndarray:
    from lifecycle.tasks.data.dedup import simhash

    return simhash.simhashes(texts, p.ngram)


def read_ledger(workdir: str | Path) -> pa.Table:
    """The ledger in the current schema (a ledger from before SimHash gets its columns, null)."""
    path = Path(workdir) / LEDGER
    if not path.exists():
        return SCHEMA.empty_table()
    t = pq.read_table(path)
    for f in SCHEMA:
        if f.name not in t.column_names:
            t = t.append_column(f, pa.nulls(t.num_rows, f.type))
    return t.select(SCHEMA.names).cast(SCHEMA)


def ledger_sha256(workdir: str | Path) -> str | None:
    path = Path(workdir) / LEDGER
    return sha256_file(path) if path.exists() else None


def tombstone_rows(docs: list[dict], reason: str, p: Params, now: str | None = None) -> list[dict]:
    """Ledger rows for documents {doc_id, source_id, text}: hashes and fingerprints only, never the text."""
    now = now or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    texts = [d["text"] for d in docs]
    if isinstance(p, SimHashParams):
        near = [{"signature": [], "simhash": int(h)} for h in simhashes(texts, p)]
    else:
        near = [{"signature": s.tolist()} for s in signatures(texts, p)]
    rows = []
    for d, fp in zip(docs, near):
        h = content_hash(d["text"])
        rows.append({"tombstone_id": hashlib.sha256(f"{h}\x00{d['source_id']}".encode()).hexdigest()[:16],
                     "source_id": d["source_id"], "doc_id": d["doc_id"], "content_hash": h, **fp,
                     **p.columns(), "reason": reason, "created_at": now})
    return rows


def add_tombstones(workdir: str | Path, rows: list[dict]) -> list[dict]:
    """Append the rows whose tombstone_id is new (atomic rewrite of the ledger); returns the new ones. The
    method and its parameters must match the ledger's (a fingerprint made otherwise cannot be compared)."""
    old = read_ledger(workdir)
    if old.num_rows and rows:
        have = ledger_params(old.slice(0, 1).to_pylist()[0])
        for r in rows:
            new = ledger_params(r)
            if new != have:
                raise ValueError(f"{Path(workdir) / LEDGER}: tombstones use dedup parameters {have.model_dump()}, "
                                 f"the request uses {new.model_dump()} (dedup.method and its parameters, "
                                 "minhash.ngram/bands/rows/seed/verify_jaccard or simhash.k/blocks/ngram, must stay as "
                                 "they were when the ledger was started)")
    seen = set(old.column("tombstone_id").to_pylist())
    fresh = []
    for r in rows:  # each tombstone once, the ledger's first
        if r["tombstone_id"] not in seen:
            seen.add(r["tombstone_id"])
            fresh.append(r)
    if fresh:
        table = pa.concat_tables([old, pa.Table.from_pylist([{n: r.get(n) for n in SCHEMA.names} for r in fresh],
                                                            schema=SCHEMA)])
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf)
        atomic_write_bytes(Path(workdir) / LEDGER, buf.getvalue().to_pybytes())
    return fresh


class ForgetFilter(BaseModel):
    """What collect needs to reject tombstoned documents: part of the collect fingerprint (the ledger's sha256,
    and the hashes and fingerprints themselves), so the shards see exactly the ledger the plan was made with."""

    model_config = ConfigDict(frozen=True)
    ledger_sha256: str
    params: Params = Field(discriminator="method")
    tombstone_ids: tuple[str, ...]
    content_hashes: tuple[str, ...]
    signatures: tuple[tuple[int, ...], ...] = Field((), repr=False)
    """MinHash signatures (method minhash)."""
    simhashes: tuple[int, ...] = Field((), repr=False)
    """64-bit SimHashes (method simhash)."""

    @classmethod
    def from_workdir(cls, workdir: str | Path) -> "ForgetFilter | None":
        t = read_ledger(workdir)
        if not t.num_rows:
            return None
        p = ledger_params(t.slice(0, 1).to_pylist()[0])
        near = ({"simhashes": tuple(t.column("simhash").to_pylist())} if isinstance(p, SimHashParams) else
                {"signatures": tuple(tuple(s) for s in t.column("signature").to_pylist())})
        return cls(ledger_sha256=ledger_sha256(workdir), params=p,
                   tombstone_ids=tuple(t.column("tombstone_id").to_pylist()),
                   content_hashes=tuple(t.column("content_hash").to_pylist()), **near)

    def matcher(self) -> "Matcher":
        return SimHashMatcher(self) if isinstance(self.params, SimHashParams) else Matcher(self)


class Matcher:
    """`match(text)` -> (tombstone_id, "exact" | "near", similarity, how) of the first tombstone the text copies,
    or None. MinHash: similarity is the signatures' agreement (their Jaccard estimate)."""

    def __init__(self, f: ForgetFilter):
        self.f, self.p = f, f.params
        self.exact = {h: i for i, h in enumerate(f.content_hashes)}
        self.sig = np.array(f.signatures, np.uint32).reshape(len(f.signatures), self.p.num_perm)
        self.keys = band_keys(self.sig, self.p)

    def match_exact(self, text: str) -> tuple[str, str, float, str] | None:
        i = self.exact.get(content_hash(text))
        return None if i is None else (self.f.tombstone_ids[i], "exact", 1.0, self.describe(1.0, 0))

    def describe(self, similarity: float, distance: int) -> str:
        return f"signature agreement {similarity:.2f}"

    def match(self, text: str) -> tuple[str, str, float, str] | None:
        if hit := self.match_exact(text):
            return hit
        sig = signatures([text], self.p)
        keys = band_keys(sig, self.p)
        candidates = np.flatnonzero((self.keys == keys).any(axis=1))
        if not len(candidates):
            return None
        est = (self.sig[candidates] == sig).mean(axis=1)  # the signatures' Jaccard estimate
        best = int(np.argmax(est))
        if self.p.verify_jaccard is not None and est[best] < self.p.verify_jaccard:
            return None
        return self.f.tombstone_ids[candidates[best]], "near", float(est[best]), self.describe(float(est[best]), 0)


class SimHashMatcher(Matcher):
    """dedup's SimHash rule: a shared key in one of the C(blocks, k) permuted tables, then Hamming distance <= k.
    similarity is 1 - distance / 64."""

    def __init__(self, f: ForgetFilter):
        from lifecycle.tasks.data.dedup import simhash

        self.f, self.p, self.simhash = f, f.params, simhash
        self.exact = {h: i for i, h in enumerate(f.content_hashes)}
        self.h = np.array(f.simhashes, np.uint64)
        self.keys = simhash.table_keys(self.h, self.p.k, self.p.blocks)

    def describe(self, similarity: float, distance: int) -> str:
        return f"simhash hamming distance {distance} <= k={self.p.k}"

    def match(self, text: str) -> tuple[str, str, float, str] | None:
        if hit := self.match_exact(text):
            return hit
        h = simhashes([text], self.p)
        candidates = np.flatnonzero((self.keys == self.simhash.table_keys(h, self.p.k, self.p.blocks)).any(axis=1))
        if not len(candidates):
            return None
        dist = self.simhash.hamming(self.h[candidates], np.repeat(h, len(candidates)))
        best = int(np.argmin(dist))
        if dist[best] > self.p.k:
            return None
        d = int(dist[best])
        return self.f.tombstone_ids[candidates[best]], "near", 1 - d / 64, self.describe(1 - d / 64, d)


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
        files = [str(f) for d in committed_datasets(workdir) if d.parent.name == "collect"
                 for f in DatasetRef.from_dir(d).files()]
        raise UsageError(f"no collect dataset in {workdir} holds a document with doc_id or source_id "
                         f"{', '.join(missing)}: nothing was recorded" + _suggestions(files, missing[0]))
    return sorted(found.values(), key=lambda r: r["doc_id"])


def _suggestions(files: list[str], ident: str) -> str:
    """"; did you mean ...?" with the collected ids nearest to `ident`, or ''."""
    import duckdb

    from lifecycle.core.suggest import did_you_mean, near_ids

    if not files:
        return " (no run has collected into this work dir yet)"
    con = duckdb.connect()
    try:
        con.read_parquet(files, union_by_name=True).create_view("collected")
        return did_you_mean(near_ids(con, "collected", ident))
    finally:
        con.close()
