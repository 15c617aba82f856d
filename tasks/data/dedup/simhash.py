"""64-bit SimHash fingerprints and the permuted-table blocking of Manku, Jain and Das Sarma, "Detecting
Near-Duplicates for Web Crawling" (WWW 2007), for `dedup.method: simhash`.

Features are the word n-grams of `lifecycle.tasks.data.dedup.minhash.shingle_hashes` (the same word split as
MinHash), each spread to 64 bits by splitmix64 and weighted by its count in the document. Bit i of the SimHash is
set when the features with bit i set outnumber those without (Charikar 2002). Two documents are near-duplicates
when their SimHashes differ in at most `k` bits.

Blocking, never all pairs: the 64 bits are cut into `blocks` contiguous blocks (`blocks` > k). Two fingerprints
within Hamming distance k differ in at most k blocks, so they agree exactly on at least `blocks - k` of them. One
table per choice of `blocks - k` blocks (C(blocks, k) tables) keys every fingerprint by those blocks' bits; two
fingerprints are candidates when they share a key in some table, and a candidate pair becomes an edge only when its
Hamming distance is <= k. This finds every pair within distance k (the pigeonhole argument of Manku et al. section
3.1; their tables sort by a permutation that brings the chosen blocks first, a hash of the same bits is equivalent
for exact matching). Keys have about 64 * (blocks - k) / blocks bits: wider keys, fewer random candidates, more
tables. Manku et al. used k=3 with 64-bit fingerprints (blocks 6: 20 tables, 32-bit keys here).
"""

from __future__ import annotations

from itertools import combinations
from math import comb

import numba
import numpy as np
import pyarrow as pa

MAX_TABLES = 256  # C(blocks, k) above this is refused: each table is one key per document in the index
_P = np.uint64(0x100000001B3)


def check(k: int, blocks: int) -> None:
    if not 0 <= k < blocks <= 64:
        raise ValueError(f"dedup.simhash: need 0 <= k < blocks <= 64, got k={k}, blocks={blocks}")
    if comb(blocks, k) > MAX_TABLES:
        raise ValueError(f"dedup.simhash: blocks={blocks}, k={k} gives C({blocks},{k})={comb(blocks, k)} tables "
                         f"(at most {MAX_TABLES}); use fewer blocks")


def num_tables(k: int, blocks: int) -> int:
    return comb(blocks, k)


@numba.njit(cache=True)
def _simhash_kernel(hashes, offsets, out):
    for d in range(len(offsets) - 1):
        votes = np.zeros(64, np.int64)
        for s in range(offsets[d], offsets[d + 1]):
            z = np.uint64(hashes[s]) + np.uint64(0x9E3779B97F4A7C15)  # splitmix64: 32-bit feature -> 64 bits
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
            for i in range(64):
                if (z >> np.uint64(i)) & np.uint64(1):
                    votes[i] += 1
                else:
                    votes[i] -= 1
        h = np.uint64(0)
        if offsets[d + 1] > offsets[d]:  # a document without words keeps the fingerprint 0
            for i in range(64):
                if votes[i] > 0:
                    h |= np.uint64(1) << np.uint64(i)
        out[d] = h


def simhashes(texts: list[str] | pa.Array, ngram: int) -> np.ndarray:
    """uint64 array: the 64-bit SimHash of every document (word n-gram features, count-weighted)."""
    from lifecycle.tasks.data.dedup.minhash import shingle_hashes

    if isinstance(texts, (pa.Array, pa.ChunkedArray)):
        texts = texts.to_pylist()
    texts = [t or "" for t in texts]
    hv, off = shingle_hashes(texts, ngram)
    out = np.zeros(len(texts), np.uint64)
    _simhash_kernel(hv.astype(np.uint64), off.astype(np.int64), out)
    return out


def _block_masks(blocks: int) -> list[int]:
    """Bit masks of `blocks` contiguous blocks covering 64 bits, sizes as even as possible."""
    edges = [round(64 * i / blocks) for i in range(blocks + 1)]
    return [((1 << (edges[i + 1] - edges[i])) - 1) << edges[i] for i in range(blocks)]


def table_masks(k: int, blocks: int) -> np.ndarray:
    """uint64 array (C(blocks, k),): the mask of the `blocks - k` blocks each table keys on."""
    check(k, blocks)
    masks = _block_masks(blocks)
    return np.array([sum(masks[i] for i in chosen) for chosen in combinations(range(blocks), blocks - k)],
                    np.uint64)


def table_keys(h: np.ndarray, k: int, blocks: int) -> np.ndarray:
    """uint64 array (len(h), tables): per table, a hash of the table number and the fingerprint's bits under the
    table's mask. Equal keys in one table = equal bits on that table's blocks (up to 2^-64 collisions)."""
    masks = table_masks(k, blocks)
    with np.errstate(over="ignore"):
        return (h[:, None] & masks[None, :]) * _P + np.arange(1, len(masks) + 1, dtype=np.uint64)[None, :]


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bitwise Hamming distance of two uint64 arrays."""
    x = np.bitwise_xor(a.astype(np.uint64), b.astype(np.uint64))
    return np.unpackbits(x.view(np.uint8).reshape(-1, 8), axis=1).sum(axis=1)
