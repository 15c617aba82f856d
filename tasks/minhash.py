"""Vectorised MinHash signatures for dedup, compatible with datasketch's structures.

datasketch (2.x, default scheme `affine32`) hashes every shingle with SHA-1 in a Python loop, then applies
`fmix32` and the affine permutations `a * h + b mod 2^32` in numpy. The SHA-1 loop is what makes it slow. Here
the shingle hash is computed in numpy too: each distinct word is hashed once (CRC-32 of its UTF-8 under two
seeds, a 64-bit value, cached per batch), an n-gram's hash is the polynomial `sum_k w[i+k] * P^(n-1-k) mod 2^64`
folded to 32 bits, for all n-grams of all documents of a batch at once. The permutations `(a, b)` are
datasketch's own for the same `num_perm` and `seed` (`MinHash(num_perm, seed).permutations`), the finalizer is
datasketch's `_fmix`, and the result is wrapped in `LeanMinHash` (scheme `affine32`), so `MinHashLSH`,
`jaccard()` and serialisation work unchanged.

Shingles are those of `tasks.dedup.shingles`: words (letters, digits, `_`) of the lower-cased text, word n-grams (a document
with fewer than n words is one shingle of all its words; an empty one has none and gets the empty signature).
Repeated shingles do not change a minimum, so no set is built. Memory: permuted values are computed in chunks of
about `chunk_shingles` shingles (chunk_shingles x num_perm x 4 bytes), whatever the batch size.
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasketch import LeanMinHash, MinHash
from datasketch.minhash import _fmix

_WORD = re.compile(r"\w+", re.UNICODE)
_P = np.uint64(0x100000001B3)  # FNV-64 prime: the n-gram polynomial base
_MAX32 = np.uint32(0xFFFFFFFF)
SCHEME = "affine32"


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """datasketch's (a, b) for this num_perm/seed, as uint32 arrays."""
    a, b = MinHash(num_perm=num_perm, seed=seed, scheme=SCHEME).permutations
    return a.astype(np.uint32), b.astype(np.uint32)


def _word_ids(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(64-bit hash per distinct word, word index per token for all docs, token offsets per doc).

    Tokenising runs in Arrow (RE2): lower-case, split on runs of characters that are not letters, digits or
    `_` (Python's `\\w`), dictionary-encode; only the distinct words are hashed in Python."""
    arr = pc.split_pattern_regex(pc.utf8_lower(pa.array(texts, pa.large_string())), r"[^\p{L}\p{N}_]+")
    flat = pc.list_flatten(arr)
    parents = pc.list_parent_indices(arr).to_numpy()
    keep = pc.not_equal(pc.binary_length(flat), 0).to_numpy(zero_copy_only=False)
    enc = pc.dictionary_encode(flat.filter(pa.array(keep)))
    ids = enc.indices.to_numpy().astype(np.int64)
    counts = np.bincount(parents[keep], minlength=len(texts))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    words = [w.encode() for w in enc.dictionary.to_pylist()]
    lo = np.fromiter((zlib.crc32(w) for w in words), np.uint64, len(words))
    hi = np.fromiter((zlib.crc32(w, 0x9E3779B9) for w in words), np.uint64, len(words))
    return (hi << np.uint64(32)) | lo, ids, offsets


def shingle_hashes(texts: list[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(32-bit hash per shingle, shingle offsets per doc) for a batch of documents."""
    wh, ids, off = _word_ids(texts)
    tok = wh[ids] if len(ids) else np.zeros(0, np.uint64)
    counts = np.diff(off)
    n_sh = np.where(counts >= n, counts - n + 1, (counts > 0).astype(np.int64))  # short doc: one shingle
    sh_off = np.concatenate([[0], np.cumsum(n_sh)])
    # polynomial hash of the n tokens starting at every position (positions crossing a doc end are dropped)
    with np.errstate(over="ignore"):
        total = len(tok)
        h = np.zeros(max(total - n + 1, 0), np.uint64)
        for k in range(n):
            h = h * _P + tok[k : k + len(h)]
    out = np.empty(int(sh_off[-1]), np.uint64)
    full = counts >= n
    if full.any():  # shingle j of doc i starts at token off[i] + j
        doc_of = np.repeat(np.flatnonzero(full), n_sh[full])
        pos = np.arange(len(doc_of)) - np.repeat(np.cumsum(n_sh[full]) - n_sh[full], n_sh[full])
        out[sh_off[doc_of] + pos] = h[off[doc_of] + pos]
    for i in np.flatnonzero((counts > 0) & ~full):  # fewer than n words: one shingle of all of them
        with np.errstate(over="ignore"):
            v = np.uint64(0)
            for t in tok[off[i] : off[i + 1]]:
                v = v * _P + t
        out[sh_off[i]] = v
    folded = ((out >> np.uint64(32)) ^ (out & np.uint64(0xFFFFFFFF))).astype(np.uint32)
    return folded, sh_off


def signatures(texts: list[str], n: int, num_perm: int, seed: int, chunk_shingles: int = 1 << 13) -> np.ndarray:
    """uint32 array (len(texts), num_perm): the MinHash signature of every document.

    Chunks are small (8192 shingles x 112 permutations = 3.7 MB) and reuse one buffer: with 65536-shingle chunks
    every chunk was a fresh 29 MB allocation, and first-touch page faults made the whole call 2-5x slower."""
    a, b = permutations(num_perm, seed)
    hv, off = shingle_hashes(texts, n)
    with np.errstate(over="ignore"):
        hv = _fmix(hv, 32)
    sig = np.full((len(texts), num_perm), _MAX32, np.uint32)
    counts = np.diff(off)
    buf = np.empty((0, num_perm), np.uint32)
    doc = 0
    while doc < len(texts):  # chunks of whole documents, about chunk_shingles shingles each
        end = int(np.searchsorted(off, off[doc] + chunk_shingles, side="right"))
        end = max(end - 1, doc + 1)
        lo, hi = off[doc], off[end]
        if hi > lo:
            if hi - lo > len(buf):  # grows only for a document with more shingles than a chunk
                buf = np.empty((max(hi - lo, chunk_shingles), num_perm), np.uint32)
            phv = buf[: hi - lo]
            with np.errstate(over="ignore"):
                np.multiply(hv[lo:hi, None], a, out=phv)
                np.add(phv, b, out=phv)
            nonempty = np.flatnonzero(counts[doc:end] > 0)
            mins = np.minimum.reduceat(phv, (off[doc:end][nonempty] - lo), axis=0)
            sig[doc + nonempty] = mins
        doc = end
    return sig


def lean(sig_row: np.ndarray, seed: int) -> LeanMinHash:
    """A datasketch LeanMinHash holding one signature row."""
    return LeanMinHash(seed=seed, hashvalues=sig_row.astype(np.uint32), scheme=SCHEME)


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """uint64 array (len(sig), bands): one key per LSH band, a polynomial hash of the band's `rows` values.

    Two documents are LSH candidates when any band key is equal, the rule of datasketch's `MinHashLSH` with
    `params=(bands, rows)` (which keys a band by its raw bytes; a 64-bit key collides with probability ~2^-64)."""
    if sig.shape[1] < bands * rows:
        raise ValueError(f"signature has {sig.shape[1]} values, bands x rows needs {bands * rows}")
    s = sig[:, : bands * rows].reshape(len(sig), bands, rows).astype(np.uint64)
    key = np.zeros((len(sig), bands), np.uint64)
    with np.errstate(over="ignore"):
        for r in range(rows):
            key = key * _P + s[:, :, r] + np.uint64(1)
    return key
