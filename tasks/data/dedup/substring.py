"""Exact-substring dedup with suffix arrays (Lee et al. 2022, "Deduplicating training data makes language models
better"), `dedup.substring`, after document dedup and paragraph dedup.

What is removed. The kept documents, in parent order (file order, then row order: the order that keeps the first
copy of a duplicate document), are laid end to end as UTF-8 bytes, each followed by the byte 0xFF (never part of
UTF-8, so no span can cross from one document into the next). A window is `min_length` bytes inside one
document. Every window whose bytes occurred at an earlier position (earlier in the same document or in an earlier
document) is cut, and the cut bytes of a document are the union of its cut windows. So every span of at least
`min_length` bytes that occurs more than once loses all its occurrences but the first, which is kept whole: a
later copy of a span `S` is cut exactly (the windows that stick out of `S` on either side are new text and stay),
extended only as far as the copies still agree. Text that repeats itself with a period p (`abcabc...`, at least
`min_length` + p bytes) keeps its first p bytes: each later window equals the one p bytes before it. Cut ranges are shrunk to
UTF-8 character boundaries (a partial character at either end stays).

What happens to a document (as paragraph dedup, paragraphs.py):
- nothing cut: unchanged; `dedup_cuts` lists only the paragraph step's ranges (`[]` if none);
- some cut: kept with the ranges removed; `dedup_cuts` gains each removed range `{start, end, reason:
  "substring"}`, in byte offsets of the text as it entered dedup (mapped through any paragraph cuts, so a
  range that spans a cut paragraph is recorded as the pieces around it), sorted by start;
- fewer than `min_doc_chars` characters left (stripped), for example a whole document repeated inside longer
  ones: rejected with reason `duplicate`, `duplicate_kind` `substring` and a detail counting the spans and bytes
  cut. `duplicate_of` is empty: a span can repeat pieces of many documents.

How, out of core (`SuffixDedup`). The bytes are written to `text.bin` in the stage's scratch directory and cut
into shards of at most `shard_bytes` (at document boundaries; a single longer document is a shard of its own). Each
shard's suffix array is built by libdivsufsort (pydivsufsort's library) directly into `sa.bin`, a memory-mapped
file of int32 positions (4 bytes per input byte), shard after shard. Then one k-way merge (a heap over the shards'
current suffixes, numba) streams all suffixes in order of their first `min_length` bytes: O(n log k) comparisons
for k shards, never a pass per pair of shards. Suffixes that agree on `min_length` bytes come out next to each
other, so each group of equal windows is seen at once: all but its smallest position are marked in a bitmap of
window starts (1 bit per input byte). Marked windows are turned into byte ranges per document. Memory: the
shard being sorted (its text and array, file-backed), the bitmap, and the pages of `text.bin` and `sa.bin` the
merge touches (file-backed, reclaimable: the merge reads `sa.bin` sequentially and `text.bin` at random).
The result does not depend on `shard_bytes` (tests/data/test_dedup_substring.py checks it), so it is not part
of the dataset's fingerprint.

Scope: one run. Unlike the MinHash index and the paragraph filter, earlier runs' text is not kept, so a span
repeated only across runs is not cut.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core.dataset import StageStats
from lifecycle.tasks.data.dedup.paragraphs import drop_ranges

REJECT_REASON = "duplicate"
CUT_REASON = "substring"
SEPARATOR = 0xFF  # ends every document in text.bin: not a UTF-8 byte, so no window of text holds it
MAX_SHARD = 2**31 - 1  # int32 suffix arrays


class SubstringConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="Cut every span of at least `min_length` bytes that occurred earlier "
                          "in this run (suffix arrays, Lee et al. 2022) from kept documents; documents left too "
                          "short are rejected.")
    min_length: int = Field(100, ge=8, description="Shortest repeated span cut, in bytes of UTF-8 (Lee et al.: "
                            "50 tokens, about 100-200 bytes of English).")
    min_doc_chars: int = Field(1, ge=1, description="A document with fewer characters left (stripped) after its "
                               "cuts is rejected as `duplicate` (kind `substring`).")
    shard_bytes: int = Field(64 << 20, ge=1, le=MAX_SHARD, description="Bytes of text per suffix-array shard "
                             "(memory while sorting: about 5 x this, file-backed). Changes no result, so it is not "
                             "part of the fingerprint.")


# --------------------------------------------------------------------------------------------------
# kernels


@numba.njit(cache=True, inline="always")
def _compare(text, p, pe, q, qe, length):
    """(order, lcp) of the windows text[p:min(p+length, pe)] and text[q:min(q+length, qe)]: order -1, 0 or 1
    (a window cut short by its shard's end sorts before a longer one with the same bytes, as in the shard's
    suffix array), lcp the bytes they share (at most `length`)."""
    m = min(length, pe - p, qe - q)
    for i in range(m):
        a = text[p + i]
        b = text[q + i]
        if a != b:
            return (-1 if a < b else 1), i
    lp = min(length, pe - p)
    lq = min(length, qe - q)
    return (0 if lp == lq else (-1 if lp < lq else 1)), m


@numba.njit(cache=True)
def _less(text, pos, ends, a, b, length):
    """Shard a's current suffix sorts before shard b's (ties: the lower shard first, so the order is fixed)."""
    c, _ = _compare(text, pos[a], ends[a], pos[b], ends[b], length)
    return c < 0 or (c == 0 and a < b)


@numba.njit(cache=True)
def _sift(heap, size, i, text, pos, ends, length):
    while True:
        smallest = i
        for child in (2 * i + 1, 2 * i + 2):
            if child < size and _less(text, pos, ends, heap[child], heap[smallest], length):
                smallest = child
        if smallest == i:
            return
        heap[i], heap[smallest] = heap[smallest], heap[i]
        i = smallest


@numba.njit(cache=True, inline="always")
def window_in_one_doc(text, p, length):
    """No document separator (0xFF) among the `length` bytes at `p`."""
    for i in range(length):
        if text[p + i] == 0xFF:
            return False
    return True


@numba.njit(cache=True)
def _mark(marks, p):
    marks[p >> 3] |= np.uint8(1) << np.uint8(p & 7)


@numba.njit(cache=True)
def merge_marks(text, sa, bounds, length, marks):
    """Stream every suffix of every shard in order of its first `length` bytes (a k-way heap merge of the
    shards' suffix arrays; `sa[bounds[s]:bounds[s+1]]` is shard s's array of positions local to the shard) and
    mark, in the bitmap `marks`, the start of every window of `length` bytes (no separator inside) that equals
    one at a smaller position. Returns (windows marked, distinct windows that repeat)."""
    k = len(bounds) - 1
    idx = np.empty(k, np.int64)  # next entry of each shard's array
    pos = np.empty(k, np.int64)  # its global position
    ends = np.empty(k, np.int64)
    heap = np.empty(k, np.int64)
    size = 0
    for s in range(k):
        ends[s] = bounds[s + 1]
        if bounds[s + 1] > bounds[s]:
            idx[s] = bounds[s]
            pos[s] = bounds[s] + sa[bounds[s]]
            heap[size] = s
            size += 1
    for i in range(size // 2 - 1, -1, -1):
        _sift(heap, size, i, text, pos, ends, length)
    prev, prev_end = -1, 0
    valid = repeated = checked = False
    first = 0
    marked = groups = 0
    while size:
        s = heap[0]
        p, pe = pos[s], ends[s]
        same = False
        if prev >= 0:
            _, lcp = _compare(text, prev, prev_end, p, pe, length)
            same = lcp >= length
        if same:
            if not checked:  # the group's first repeat: its window (the same bytes in every member) inside a document?
                checked = True
                valid = window_in_one_doc(text, p, length)
            if valid:  # one more copy of the group's window: mark all but the smallest position
                if p < first:
                    _mark(marks, first)
                    first = p
                else:
                    _mark(marks, p)
                marked += 1
                if not repeated:
                    groups += 1
                    repeated = True
        else:  # a new group; its validity is checked once it repeats (most windows never do)
            first = p
            checked = valid = repeated = False
        prev, prev_end = p, pe
        idx[s] += 1
        if idx[s] < bounds[s + 1]:
            pos[s] = bounds[s] + sa[idx[s]]
        else:
            size -= 1
            heap[0] = heap[size]
        if size:
            _sift(heap, size, 0, text, pos, ends, length)
    return marked, groups


@numba.njit(cache=True)
def _ranges(marks, offsets, lengths, length, count_only, doc, start, end):
    """Byte ranges [start, end) local to each document (`offsets`, `lengths` in text.bin) covered by a marked
    window; with `count_only`, just their number."""
    n = 0
    for d in range(len(offsets)):
        o = offsets[d]
        lo = -1
        hi = -1
        j = 0
        while j < lengths[d]:
            g = o + j
            if (g & 7) == 0 and marks[g >> 3] == 0 and j + 8 <= lengths[d]:
                j += 8
                continue
            if (marks[g >> 3] >> (g & 7)) & 1:
                if lo >= 0 and j > hi:
                    if not count_only:
                        doc[n], start[n], end[n] = d, lo, hi
                    n += 1
                    lo = -1
                if lo < 0:
                    lo = j
                hi = max(hi, j + length)
            j += 1
        if lo >= 0:
            if not count_only:
                doc[n], start[n], end[n] = d, lo, hi
            n += 1
    return n


# --------------------------------------------------------------------------------------------------
# the corpus on disk


def _divsufsort_into(text: np.ndarray, out: np.ndarray) -> None:
    """libdivsufsort's suffix array of `text` (uint8) written straight into `out` (int32, memory-mapped), with no
    copy in memory (pydivsufsort.divsufsort would return a fresh array)."""
    from pydivsufsort.dll import libdivsufsort

    if len(text) != len(out) or out.dtype != np.int32 or text.dtype != np.uint8:
        raise ValueError(f"suffix array: {len(text)} bytes of text need as many int32 slots, got {len(out)} {out.dtype}")
    ret = libdivsufsort.divsufsort(ctypes.c_void_p(text.ctypes.data), ctypes.c_void_p(out.ctypes.data),
                                   ctypes.c_int32(len(text)))
    if ret:
        raise RuntimeError(f"libdivsufsort failed ({ret}) on a shard of {len(text)} bytes")


class SuffixDedup:
    """Add the kept documents' texts in order (`add`), `build` once, then ask each batch's cut ranges (`cuts`, the
    same batches in the same order). Files live in `directory` (the stage's scratch directory)."""

    def __init__(self, directory: Path, cfg: SubstringConfig):
        self.dir, self.cfg = Path(directory), cfg
        self.dir.mkdir(parents=True, exist_ok=True)
        self.text_path = self.dir / "text.bin"
        self._out = open(self.text_path, "wb")
        self.size = 0
        self.shards = [0]  # start offset of each shard in text.bin
        self.documents = 0
        self.marks = np.zeros(0, np.uint8)
        self.marked = self.groups = 0
        self._cursor = 0  # offset of the next document `cuts` is asked about

    def add(self, texts: pa.ChunkedArray | pa.Array) -> None:
        for t in texts.to_pylist():
            b = t.encode()
            n = len(b) + 1
            if self.size > self.shards[-1] and self.size - self.shards[-1] + n > self.cfg.shard_bytes:
                self.shards.append(self.size)
            if n > MAX_SHARD:
                raise ValueError(f"dedup.substring: a document of {n - 1} bytes; at most {MAX_SHARD - 1} are indexed")
            self._out.write(b)
            self._out.write(b"\xff")
            self.size += n
            self.documents += 1

    def build(self) -> None:
        """Sort each shard's suffixes into sa.bin, then merge them all once and mark the repeated windows."""
        self._out.close()
        bounds = np.array(self.shards + [self.size], np.int64)
        self.marks = np.zeros((self.size + 7) // 8, np.uint8)
        if not self.size:
            return
        text = np.memmap(self.text_path, np.uint8, "r")
        sa = np.memmap(self.dir / "sa.bin", np.int32, "w+", shape=self.size)
        for s, e in zip(bounds[:-1], bounds[1:]):
            _divsufsort_into(np.asarray(text[s:e]), np.asarray(sa[s:e]))
        self.marked, self.groups = merge_marks(np.asarray(text), np.asarray(sa), bounds, self.cfg.min_length,
                                               self.marks)
        del text, sa

    def cuts(self, lengths: np.ndarray) -> list[list[tuple[int, int]]]:
        """The next len(lengths) documents (byte lengths, in the order added): each one's cut byte ranges."""
        lengths = np.asarray(lengths, np.int64)
        offsets = self._cursor + np.concatenate([[0], np.cumsum(lengths + 1)[:-1]]).astype(np.int64)
        self._cursor += int(lengths.sum()) + len(lengths)
        if self._cursor > self.size:
            raise RuntimeError(f"dedup.substring: asked about {self._cursor} bytes of {self.size} added")
        empty = np.zeros(0, np.int64)
        n = _ranges(self.marks, offsets, lengths, self.cfg.min_length, True, empty, empty, empty)
        doc, start, end = (np.empty(n, np.int64) for _ in range(3))
        _ranges(self.marks, offsets, lengths, self.cfg.min_length, False, doc, start, end)
        out: list[list[tuple[int, int]]] = [[] for _ in lengths]
        for d, s, e in zip(doc.tolist(), start.tolist(), end.tolist()):
            out[d].append((s, e))
        return out

    def report(self) -> dict:
        return {"min_length": self.cfg.min_length, "documents": self.documents, "bytes_indexed": self.size,
                "shards": len(self.shards) if self.size else 0, "windows_repeated": int(self.marked),
                "distinct_repeated_windows": int(self.groups)}


# --------------------------------------------------------------------------------------------------
# applying the cuts


def char_aligned(b: bytes, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges shrunk to UTF-8 character boundaries (an end inside a character moves back to its start)."""
    out = []
    for s, e in ranges:
        while s < e and (b[s] & 0xC0) == 0x80:
            s += 1
        while e > s and e < len(b) and (b[e] & 0xC0) == 0x80:
            e -= 1
        if s < e:
            out.append((s, e))
    return out


def to_original(ranges: list[tuple[int, int]], earlier: list[dict], size: int) -> list[tuple[int, int]]:
    """Ranges in a text that already lost the byte ranges `earlier` (dicts start/end, sorted, disjoint, in the
    original's offsets; original size `size`) -> the same bytes as ranges of the original, split around `earlier`."""
    if not earlier:
        return list(ranges)
    segments, pos, new = [], 0, 0  # kept segments of the original: (original start, original end, new start)
    for c in earlier:
        if c["start"] > pos:
            segments.append((pos, c["start"], new))
            new += c["start"] - pos
        pos = c["end"]
    if pos < size:
        segments.append((pos, size, new))
    out = []
    for s, e in ranges:
        for os_, oe, ns in segments:
            ne = ns + (oe - os_)
            lo, hi = max(s, ns), min(e, ne)
            if lo < hi:
                out.append((os_ + lo - ns, os_ + hi - ns))
    return out


def dedup_table(kept: pa.Table, index: SuffixDedup, cfg: SubstringConfig, cut_column: str, cut_type: pa.DataType,
                stats: StageStats) -> tuple[pa.Table, list[bool], list[dict]]:
    """Cut the repeated spans `index` found from the kept rows of one file (the batch it was given for this file):
    (rows still kept, with the new text and `cut_column` extended; per input row, still kept?; the rejected rows
    of documents left too short). `cut_column` must exist (the paragraph step's, or empty lists)."""
    texts = kept.column("text").to_pylist()
    encoded = [t.encode() for t in texts]
    found = index.cuts(pc.binary_length(kept.column("text")).to_numpy(zero_copy_only=False))
    earlier_cuts = kept.column(cut_column).to_pylist()
    sizes = [len(b) + sum(c["end"] - c["start"] for c in cuts) for b, cuts in zip(encoded, earlier_cuts)]
    new_texts, new_cuts, still, short = [], [], [], []
    for r, b, text, ranges, earlier, size in zip(kept.select(["doc_id", "source_id"]).to_pylist(), encoded, texts,
                                                 found, earlier_cuts, sizes):
        ranges = char_aligned(b, ranges)
        if not ranges:
            new_texts.append(text)
            new_cuts.append(earlier)
            still.append(True)
            continue
        new = drop_ranges(b, ranges).decode()
        cut_bytes = sum(e - s for s, e in ranges)
        stats.counters["substrings_cut"] += len(ranges)
        stats.counters["substring_bytes_cut"] += cut_bytes
        left = len(new.strip())
        if left < cfg.min_doc_chars:
            detail = (f"{len(ranges)} spans ({cut_bytes} of {len(b)} bytes) of >= {cfg.min_length} bytes seen "
                      f"earlier in this run (suffix array); {left} characters left, min_doc_chars {cfg.min_doc_chars}")
            short.append({"doc_id": r["doc_id"], "source_id": r["source_id"], "reason": REJECT_REASON,
                          "detail": detail, "duplicate_of": None, "duplicate_kind": "substring"})
            stats.counters["duplicate_substring"] += 1
            still.append(False)
        else:
            stats.counters["documents_trimmed_substring"] += 1
            still.append(True)
        new_texts.append(new)
        mine = [{"start": s, "end": e, "reason": CUT_REASON} for s, e in to_original(ranges, earlier, size)]
        new_cuts.append(sorted(earlier + mine, key=lambda c: c["start"]))
    i = kept.schema.get_field_index("text")
    kept = kept.set_column(i, kept.schema.field(i), pa.array(new_texts, kept.schema.field(i).type))
    j = kept.schema.get_field_index(cut_column)
    kept = kept.set_column(j, pa.field(cut_column, cut_type), pa.array(new_cuts, cut_type))
    return kept.filter(pa.array(still, pa.bool_())), still, short
