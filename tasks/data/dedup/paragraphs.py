"""Paragraph-level exact dedup with a Bloom filter (`dedup.paragraphs`), after document-level dedup.

Paragraphs are the runs of text between blank lines (`split: blank_line`) or between newlines (`split: line`,
Dolma's BFF). A paragraph's key is the 128-bit BLAKE2b of its text with whitespace collapsed; paragraphs shorter
than `min_chars` (after stripping) are never removed nor remembered. Documents are visited in the parent's order
(the same order that keeps the first copy of a duplicate document): a paragraph whose key the filter already holds
is cut from the text, otherwise its key is added. So the first occurrence, in this run or an earlier one, is kept,
and a paragraph repeated inside one document keeps its first copy.

What happens to a document:
- no paragraph cut: unchanged, and its `dedup_cuts` is an empty list;
- some cut: kept with the cut paragraphs removed (each removal takes the paragraph and the separator before it, or
  after it for the first paragraph); `dedup_cuts` lists every removed byte range `[start, end)` of the text as it
  entered dedup, with the reason `paragraph`;
- less than `min_doc_chars` characters left (stripped), for example every paragraph a duplicate: rejected with
  reason `duplicate`, `duplicate_kind` `paragraph` and a detail saying how many paragraphs and bytes were
  duplicates. The filter holds no doc_ids, so `duplicate_of` is empty: a Bloom filter has no clusters.
Every row is kept or rejected, as everywhere.

The filter: m bits, h hash functions from the capacity n and false-positive rate p of the config (m = -n ln p /
(ln 2)^2, h = round(m/n ln 2)); bit positions by double hashing (Kirsch and Mitzenmacher 2006) of the 128-bit key.
A false positive cuts a paragraph that was not seen before. The stage reports the configured rate, the expected
rate for the number of keys inserted so far ((1 - e^{-hN/m})^h) and the rate measured on the bit array itself
(fraction of bits set, to the power h): the probability that a new key is taken for an old one now.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from pathlib import Path
from typing import Literal

import numba
import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core.dataset import DatasetRef, StageStats, sha256_json
from lifecycle.core.fs import atomic_write_bytes, atomic_write_json, sha256_file
from lifecycle.tasks.data.dedup.history import base_parts, locked

REJECT_REASON = "duplicate"
BLOOM_FILE = "dedup-bloom.bin"  # the filter after a run, inside its dedup dataset
BLOOM_MANIFEST = "_bloom.json"
CUT_COLUMN = "dedup_cuts"
CUT_TYPE = pa.list_(pa.struct([("start", pa.int64()), ("end", pa.int64()), ("reason", pa.string())]))
_SEPARATORS = {"blank_line": re.compile(rb"\n[ \t\r\f\v]*\n\s*"), "line": re.compile(rb"\n\s*")}
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)


class ParagraphConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="Cut paragraphs seen before (this run or, with `incremental`, earlier "
                          "runs) from kept documents, by a Bloom filter; documents left too short are rejected.")
    split: Literal["blank_line", "line"] = Field(
        "blank_line", description="Paragraph boundaries: blank lines, or every newline (Dolma's BFF).")
    min_chars: int = Field(40, ge=1, description="Paragraphs shorter than this (stripped) are never cut nor remembered.")
    min_doc_chars: int = Field(1, ge=1, description="A document with fewer characters left (stripped) after its "
                               "cuts is rejected as `duplicate` (kind `paragraph`).")
    capacity: int = Field(10_000_000, ge=1, description="Paragraph keys the filter is sized for, across all runs "
                          "it persists over (memory: about capacity x -log2(fp_rate) x 1.44 bits).")
    fp_rate: float = Field(1e-4, gt=0, lt=1, description="False-positive rate of the filter at `capacity` keys "
                           "(a false positive cuts a paragraph never seen before).")


# --------------------------------------------------------------------------------------------------
# the filter


@numba.njit(cache=True)
def _check_add(bits, h1, h2, nhash, m, skip, seen, add):
    """For every key in order: seen[i] = all its bits were set; then, with `add`, set them (unless skip[i]).
    Sequential, so a key repeated later in the same batch is seen."""
    added = 0
    for i in range(len(h1)):
        if skip[i]:
            continue
        present = True
        for j in range(nhash):
            pos = (h1[i] + np.uint64(j) * h2[i]) % m
            if not (bits[pos >> np.uint64(3)] >> (pos & np.uint64(7))) & np.uint8(1):
                present = False
                if add:
                    bits[pos >> np.uint64(3)] |= np.uint8(1) << np.uint8(pos & np.uint64(7))
        seen[i] = present
        if not present and add:
            added += 1
    return added


class Bloom:
    """A Bloom filter over 128-bit keys: `bits` (uint8, m bits), `nhash` functions, `inserted` keys so far."""

    def __init__(self, m: int, nhash: int, bits: np.ndarray | None = None, inserted: int = 0):
        self.m, self.nhash, self.inserted = m, nhash, inserted
        self.bits = np.zeros((m + 7) // 8, np.uint8) if bits is None else bits
        if len(self.bits) != (m + 7) // 8:
            raise ValueError(f"Bloom filter of {m} bits needs {(m + 7) // 8} bytes, got {len(self.bits)}")

    @classmethod
    def sized(cls, capacity: int, fp_rate: float) -> "Bloom":
        m = max(8, math.ceil(-capacity * math.log(fp_rate) / math.log(2) ** 2))
        return cls(m, max(1, round(m / capacity * math.log(2))))

    def check_add(self, keys: np.ndarray, skip: np.ndarray | None = None, add: bool = True) -> np.ndarray:
        """keys: uint64 (n, 2). Returns bool (n,): was the key (probably) there before; adds the new ones unless
        `add` is false; keys with `skip` set are neither checked nor added."""
        seen = np.zeros(len(keys), np.bool_)
        skip = np.zeros(len(keys), np.bool_) if skip is None else skip
        h2 = np.ascontiguousarray(keys[:, 1]) | np.uint64(1)  # odd: the probe sequence never sticks
        self.inserted += _check_add(self.bits, np.ascontiguousarray(keys[:, 0]), h2, self.nhash, np.uint64(self.m),
                                    skip, seen, add)
        return seen

    def expected_fpr(self) -> float:
        return (1 - math.exp(-self.nhash * self.inserted / self.m)) ** self.nhash

    def fill(self) -> float:
        return float(_POPCOUNT[self.bits].sum(dtype=np.int64)) / self.m  # bits past m are never set

    def measured_fpr(self) -> float:
        return self.fill() ** self.nhash

    def to_bytes(self) -> bytes:
        head = np.array([self.m, self.nhash, self.inserted], np.uint64).tobytes()
        return b"LCBLOOM1" + head + self.bits.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Bloom":
        if data[:8] != b"LCBLOOM1" or len(data) < 32:
            raise ValueError(f"{where}: not a lifecycle Bloom filter file")
        m, nhash, inserted = (int(x) for x in np.frombuffer(data[8:32], np.uint64))
        return cls(m, nhash, np.frombuffer(data[32:], np.uint8).copy(), inserted)

    def report(self, cfg: ParagraphConfig) -> dict:
        return {"bits": self.m, "hashes": self.nhash, "keys_inserted": self.inserted, "capacity": cfg.capacity,
                "fp_rate_configured": cfg.fp_rate, "fp_rate_expected": self.expected_fpr(),
                "fill": self.fill(), "fp_rate_measured": self.measured_fpr()}


def keys_of(paragraphs: list[bytes]) -> np.ndarray:
    """uint64 (n, 2): the 128-bit BLAKE2b of each paragraph with whitespace collapsed."""
    blake = hashlib.blake2b
    # bytes.split() splits on runs of ASCII whitespace and strips: the same text as `\s+` -> " " after strip()
    digests = b"".join(blake(b" ".join(p.split()), digest_size=16).digest() for p in paragraphs)
    return np.frombuffer(digests, np.uint64).reshape(-1, 2).copy()


# --------------------------------------------------------------------------------------------------
# paragraphs of a document and the cuts


def split(text: bytes, how: str) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of the paragraphs of `text` (separators excluded)."""
    out, pos = [], 0
    for m in _SEPARATORS[how].finditer(text):
        if m.start() > pos:
            out.append((pos, m.start()))
        pos = m.end()
    if pos < len(text):
        out.append((pos, len(text)))
    return out


def drop_ranges(b: bytes, ranges: list[tuple[int, int]]) -> bytes:
    """`b` without the sorted, disjoint byte ranges [s, e)."""
    pieces, pos = [], 0
    for s, e in ranges:
        pieces.append(b[pos:s])
        pos = e
    pieces.append(b[pos:])
    return b"".join(pieces)


def cut_ranges(spans: list[tuple[int, int]], cut: list[bool], size: int) -> list[tuple[int, int]]:
    """The byte ranges removed for the cut paragraphs: each with the separator before it (after it for a first
    paragraph), merged where adjacent."""
    ranges: list[tuple[int, int]] = []
    for i, ((s, e), c) in enumerate(zip(spans, cut)):
        if not c:
            continue
        prev_end = spans[i - 1][1] if i else None
        next_start = spans[i + 1][0] if i + 1 < len(spans) else size
        s, e = (prev_end, e) if prev_end is not None else (0, next_start if i + 1 < len(spans) else e)
        if ranges and ranges[-1][1] >= s:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], e))
        else:
            ranges.append((s, e))
    return ranges


class Rereads:
    """Documents an earlier run kept, met again by a run whose collect re-read every input (`collect.incremental:
    false`): the published filter holds their paragraphs because of them, so they are checked against this run's
    own paragraphs only (`own`, a filter of the same size), as the MinHash index leaves out a run's own doc_ids.
    `known`: the sorted doc_ids (64-bit) whose paragraphs the published filter holds."""

    def __init__(self, known: np.ndarray, cfg: "ParagraphConfig"):
        self.known, self.own = known, Bloom.sized(cfg.capacity, cfg.fp_rate)

    def mask(self, doc_ids: list[str]) -> np.ndarray:
        keys = np.array([int(d, 16) for d in doc_ids], np.uint64)
        at = np.searchsorted(self.known, keys).clip(max=max(0, len(self.known) - 1))
        return (self.known[at] == keys) if len(self.known) else np.zeros(len(keys), np.bool_)


def doc_keys(doc_ids: list[str]) -> np.ndarray:
    """doc_ids (16 hex digits) as sorted unique uint64."""
    return np.unique(np.array([int(d, 16) for d in doc_ids], np.uint64))


def apply(texts: list[str], bloom: Bloom, cfg: ParagraphConfig, reread: np.ndarray | None = None,
          own: Bloom | None = None) -> tuple[list[str], list[list[dict]], list[dict]]:
    """Documents in order -> (new texts, cut ranges per document, per-document facts {paragraphs, cut, cut_bytes,
    left, short}); `left`: characters left (stripped), `short`: a document left under `min_doc_chars`. Updates
    `bloom`. With `own` (see `Rereads`), documents with `reread` set are checked against `own` alone, which
    every paragraph of this run is added to as well."""
    encoded = [t.encode() for t in texts]
    spans = [split(b, cfg.split) for b in encoded]
    paras = [b[s:e] for b, sp in zip(encoded, spans) for s, e in sp]
    small = np.array([len(p.strip().decode(errors="replace")) < cfg.min_chars for p in paras], np.bool_)
    keys = keys_of(paras) if paras else None
    seen = bloom.check_add(keys, small) if paras else np.zeros(0, np.bool_)
    if own is not None and paras:
        seen_here = own.check_add(keys, small)
        seen = np.where(np.repeat(reread, [len(sp) for sp in spans]), seen_here, seen)
    out_texts, cuts, facts, k = [], [], [], 0
    for b, sp in zip(encoded, spans):
        cut = [bool(x) for x in seen[k : k + len(sp)]]
        k += len(sp)
        ranges = cut_ranges(sp, cut, len(b))
        new = drop_ranges(b, ranges).decode()
        out_texts.append(new)
        cuts.append([{"start": s, "end": e, "reason": "paragraph"} for s, e in ranges])
        facts.append({"paragraphs": len(sp), "cut": sum(cut), "cut_bytes": sum(e - s for s, e in ranges),
                      "left": len(new.strip()), "short": bool(any(cut)) and len(new.strip()) < cfg.min_doc_chars})
    return out_texts, cuts, facts


def dedup_table(kept: pa.Table, bloom: Bloom, cfg: ParagraphConfig, stats: StageStats,
                rereads: Rereads | None = None) -> tuple[pa.Table, list[bool], list[dict]]:
    """Cut the paragraphs `bloom` has seen from the kept rows (in order): (rows still kept, with the new text and
    `dedup_cuts`; per input row, still kept?; the rejected rows of documents left too short)."""
    reread = rereads.mask(kept.column("doc_id").to_pylist()) if rereads is not None else None
    texts, cuts, facts = apply(kept.column("text").to_pylist(), bloom, cfg, reread,
                               rereads.own if rereads is not None else None)
    if reread is not None:
        stats.counters["documents_met_again"] += int(reread.sum())
    still = [not f["short"] for f in facts]
    short = []
    for r, f in zip(kept.select(["doc_id", "source_id"]).to_pylist(), facts):
        stats.counters["paragraphs_cut"] += f["cut"]
        stats.counters["paragraph_bytes_cut"] += f["cut_bytes"]
        if f["short"]:
            detail = (f"{f['cut']} of {f['paragraphs']} paragraphs ({f['cut_bytes']} bytes) seen before (bloom "
                      f"filter); {f['left']} characters left, min_doc_chars {cfg.min_doc_chars}")
            short.append({"doc_id": r["doc_id"], "source_id": r["source_id"], "reason": REJECT_REASON,
                          "detail": detail, "duplicate_of": None, "duplicate_kind": "paragraph"})
            stats.counters["duplicate_paragraph"] += 1
        elif f["cut"]:
            stats.counters["documents_trimmed"] += 1
    i = kept.schema.get_field_index("text")
    kept = kept.set_column(i, kept.schema.field(i), pa.array(texts, kept.schema.field(i).type))
    kept = kept.append_column(CUT_COLUMN, pa.array(cuts, CUT_TYPE))
    return kept.filter(pa.array(still, pa.bool_())), still, short


# --------------------------------------------------------------------------------------------------
# the filter across runs: one published state per dedup dataset, as the MinHash index's parts


def bloom_dir(workdir: str | Path, cfg: ParagraphConfig) -> Path:
    """One persisted paragraph filter per filter-compatible configuration (paragraph rules, size, code)."""
    key = sha256_json({"split": cfg.split, "min_chars": cfg.min_chars, "capacity": cfg.capacity,
                       "fp_rate": cfg.fp_rate, "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()})
    return Path(workdir) / "dedup-bloom" / key[:16]


def base_bloom(workdir: str | Path, cfg: ParagraphConfig,
               parent: DatasetRef) -> tuple[Bloom, str, np.ndarray | None]:
    """(the filter a run over `parent` starts from, its state for the fingerprint, the doc_ids whose paragraphs
    it holds): the state published last before the first run over the same parent (as `base_parts`), a fresh
    empty filter if none."""
    directory = bloom_dir(workdir, cfg)
    with locked(directory):
        m = directory / BLOOM_MANIFEST
        parts = base_parts(json.loads(m.read_text())["parts"], parent) if m.exists() else []
        if not parts:
            return Bloom.sized(cfg.capacity, cfg.fp_rate), "empty", None
        last = parts[-1]
        files = [(last["path"], last["sha256"])] + ([(last["docs"], last["docs_sha256"])] if "docs" in last else [])
        for name, digest in files:
            path = directory / name
            if not path.exists() or sha256_file(path) != digest:
                raise RuntimeError(f"dedup paragraph filter {path}: missing or not the sha256 in {m}; remove "
                                   f"{directory} (forgetting paragraph history) or restore the file")
        known = np.load(directory / last["docs"], allow_pickle=False) if "docs" in last else None
        state = last["sha256"] if "docs" not in last else sha256_json([last["sha256"], last["docs_sha256"]])
        return Bloom.from_bytes((directory / last["path"]).read_bytes(), str(directory / last["path"])), state, known


def publish_bloom(ref: DatasetRef, parent: DatasetRef, cfg: ParagraphConfig, workdir: str | Path) -> None:
    """Publish a committed dataset's filter (the state after its run) once: state file and the doc_ids whose
    paragraphs it holds (the last state's and this dataset's kept documents) first, manifest last."""
    directory = bloom_dir(workdir, cfg)
    with locked(directory):
        m = directory / BLOOM_MANIFEST
        parts = json.loads(m.read_text())["parts"] if m.exists() else []
        if any(p["dataset"] == ref.fingerprint for p in parts):
            return
        name = f"state-{len(parts):05d}.bloom"
        atomic_write_bytes(directory / name, (ref.dir / BLOOM_FILE).read_bytes())
        before = np.load(directory / parts[-1]["docs"], allow_pickle=False) if parts and "docs" in parts[-1] \
            else np.zeros(0, np.uint64)
        kept = ref.read(columns=["doc_id"])  # no columns at all when every row was rejected
        docs = np.union1d(before, doc_keys(kept.column("doc_id").to_pylist() if kept.num_columns else []))
        buf = io.BytesIO()
        np.save(buf, docs.astype(np.uint64), allow_pickle=False)
        docs_name = f"state-{len(parts):05d}.docs.npy"
        atomic_write_bytes(directory / docs_name, buf.getvalue())
        parts.append({"path": name, "sha256": sha256_file(directory / name), "dataset": ref.fingerprint,
                      "dataset_path": str(ref.dir), "parent_sha256": parent.sha256,
                      "docs": docs_name, "docs_sha256": sha256_file(directory / docs_name)})
        atomic_write_json(m, {"config": cfg.model_dump(mode="json"), "parts": parts})
