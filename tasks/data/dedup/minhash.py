"""MinHash signatures for dedup, compatible with datasketch's structures.

datasketch (2.x, default scheme `affine32`) hashes every shingle with SHA-1 in a Python loop, then applies
`fmix32` and the affine permutations `a * h + b mod 2^32` in numpy. The SHA-1 loop is what makes it slow. Here
each word is hashed with CRC-32 of its UTF-8 under two seeds (a 64-bit value), an n-gram's hash is the polynomial
`sum_k w[i+k] * P^(n-1-k) mod 2^64` folded to 32 bits. The permutations `(a, b)` are datasketch's own for the same
`num_perm` and `seed` (`MinHash(num_perm, seed).permutations`), the finalizer is datasketch's `_fmix`, and the
result is wrapped in `LeanMinHash` (scheme `affine32`), so `MinHashLSH`, `jaccard()` and serialisation work
unchanged.

`signatures` is one numba kernel over the documents' UTF-8 bytes (word split, word and n-gram hashes, fmix,
permutations and minimum fused, per document, optionally on numba's threads); `signatures_numpy` computes the same
values bit for bit with numpy over a whole batch (Arrow split and dictionary encoding, a CRC per distinct word) and
is the reference of the tests and of `bench.minhash_signatures`.

Shingles are those of `lifecycle.tasks.data.dedup.stage.shingles`: words (letters, digits, `_`) of the lower-cased text, word n-grams (a document
with fewer than n words is one shingle of all its words; an empty one has none and gets the empty signature).
Repeated shingles do not change a minimum, so no set is built. Memory (numpy reference): permuted values are
computed in chunks of about `chunk_shingles` shingles (chunk_shingles x num_perm x 4 bytes), whatever the batch size.
"""

from __future__ import annotations

import re
import zlib

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasketch import LeanMinHash, MinHash
from datasketch.minhash import _fmix

_WORD = re.compile(r"\w+", re.UNICODE)
_P = np.uint64(0x100000001B3)  # FNV-64 prime: the n-gram polynomial base
_MAX32 = np.uint32(0xFFFFFFFF)
SCHEME = "affine32"
_SPLIT = r"[^\p{L}\p{N}_]+"  # RE2: runs of characters that are not letters, digits or `_` (Python's `\w`)


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """datasketch's (a, b) for this num_perm/seed, as uint32 arrays."""
    a, b = MinHash(num_perm=num_perm, seed=seed, scheme=SCHEME).permutations
    return a.astype(np.uint32), b.astype(np.uint32)


def _word_ids(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(64-bit hash per distinct word, word index per token for all docs, token offsets per doc).

    Tokenising runs in Arrow (RE2): lower-case, split on runs of characters that are not letters, digits or
    `_` (Python's `\\w`), dictionary-encode; only the distinct words are hashed in Python."""
    arr = pc.split_pattern_regex(pc.utf8_lower(pa.array(texts, pa.large_string())), _SPLIT)
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


def signatures_numpy(texts: list[str], n: int, num_perm: int, seed: int, chunk_shingles: int = 1 << 13) -> np.ndarray:
    """The plain numpy implementation of `signatures` (same values, bit for bit): the reference of the tests and
    the benchmark. uint32 array (len(texts), num_perm).

    Chunks are small (8192 shingles x 112 permutations = 3.7 MB) and reuse one buffer: with 65536-shingle chunks
    every chunk was a fresh 29 MB allocation, and first-touch page faults made the whole call slower
    (`python -m bench.minhash_signatures`)."""
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

# --------------------------------------------------------------------------------------------------
# numba: the same values as `signatures_numpy`, one pass over the UTF-8 bytes of each document

def _crc_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint64)
    for _ in range(8):
        t = np.where(t & 1, (t >> np.uint64(1)) ^ np.uint64(0xEDB88320), t >> np.uint64(1))
    return t


_CRC = _crc_table()  # zlib's CRC-32 (reflected 0xEDB88320), byte at a time
# a byte continues a word when it is an ASCII letter, digit or `_`, or any byte of a non-ASCII character (only
# documents whose non-ASCII words Arrow has already split and lower-cased reach the kernel with such bytes)
_WORDBYTE = np.array([chr(c).isalnum() or c == 95 or c >= 128 for c in range(256)], np.bool_)
_LOWER = np.array([c + 32 if 65 <= c <= 90 else c for c in range(256)], np.uint64)
_U8, _U13, _U16, _U32 = np.uint64(8), np.uint64(13), np.uint64(16), np.uint64(32)
_M32, _FF = np.uint64(0xFFFFFFFF), np.uint64(0xFF)
_SEED_HI = np.uint64(0x9E3779B9 ^ 0xFFFFFFFF)  # zlib.crc32(w, 0x9E3779B9) starts from the complemented seed
_FM1, _FM2 = np.uint64(0x85EBCA6B), np.uint64(0xC2B2AE35)  # datasketch's `_fmix(., 32)`


@numba.njit(cache=True, inline="always")
def _doc_signature(data, start, end, n, a, b, row, tok, hs):
    """Signature of the document data[start:end] into `row` (left as is when it has no word); tok, hs: scratch."""
    ntok = 0
    lo = hi = _M32
    inword = False
    for i in range(start, end):  # words and their 64-bit hash (CRC-32 under two seeds), one pass
        c = data[i]
        if _WORDBYTE[c]:
            if not inword:
                lo, hi, inword = _M32, _SEED_HI, True
            c = _LOWER[c]
            lo = _CRC[(lo ^ c) & _FF] ^ (lo >> _U8)
            hi = _CRC[(hi ^ c) & _FF] ^ (hi >> _U8)
        elif inword:
            tok[ntok] = ((hi ^ _M32) << _U32) | (lo ^ _M32)
            ntok += 1
            inword = False
    if inword:
        tok[ntok] = ((hi ^ _M32) << _U32) | (lo ^ _M32)
        ntok += 1
    if ntok == 0:
        return
    width = min(n, ntok)  # fewer than n words: one shingle of all of them
    nsh = ntok - width + 1
    for s in range(nsh):  # polynomial n-gram hash, folded to 32 bits, datasketch's fmix32
        h = np.uint64(0)
        for k in range(width):
            h = h * _P + tok[s + k]
        f = (h >> _U32) ^ (h & _M32)
        f ^= f >> _U16
        f = (f * _FM1) & _M32
        f ^= f >> _U13
        f = (f * _FM2) & _M32
        f ^= f >> _U16
        hs[s] = np.uint32(f)
    for s in range(nsh):  # permutations a*h+b mod 2^32 and the minimum, no temporaries
        h32 = hs[s]
        for j in range(len(a)):
            v = np.uint32(a[j] * h32 + b[j])
            if v < row[j]:
                row[j] = v


@numba.njit(cache=True)
def _signatures_serial(data, offsets, n, a, b, sig):
    most = 0
    for d in range(len(offsets) - 1):
        most = max(most, offsets[d + 1] - offsets[d])
    tok = np.empty(most // 2 + 1, np.uint64)
    hs = np.empty(most // 2 + 1, np.uint32)
    for d in range(len(offsets) - 1):
        _doc_signature(data, offsets[d], offsets[d + 1], n, a, b, sig[d], tok, hs)


@numba.njit(cache=True, parallel=True)
def _signatures_parallel(data, offsets, n, a, b, sig):
    for d in numba.prange(len(offsets) - 1):
        size = (offsets[d + 1] - offsets[d]) // 2 + 1
        _doc_signature(data, offsets[d], offsets[d + 1], n, a, b, sig[d],
                       np.empty(size, np.uint64), np.empty(size, np.uint32))


def _kernel_input(texts: list[str] | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(UTF-8 bytes of all documents, int64 byte offsets per document) for the kernel.

    ASCII documents go as they are (the kernel lower-cases and splits them). A document with any non-ASCII
    character is lower-cased and split by Arrow as in `_word_ids` (Unicode letters and digits) and its words
    joined with spaces, so the kernel only has to hash them."""
    arr = texts if isinstance(texts, pa.Array) else pa.array(texts, pa.large_string())
    arr = arr.cast(pa.large_string()).fill_null("")
    other = pc.invert(pc.string_is_ascii(arr))
    if pc.any(other).as_py():
        words = pc.split_pattern_regex(pc.utf8_lower(arr.filter(other)), _SPLIT)
        arr = pc.replace_with_mask(arr, other, pc.binary_join(words, pa.scalar(" ", pa.large_string())))
    _, off_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(off_buf, np.int64)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    return data, offsets


def signatures(texts: list[str] | pa.Array, n: int, num_perm: int, seed: int, parallel: bool = False) -> np.ndarray:
    """uint32 array (len(texts), num_perm): the MinHash signature of every document (`signatures_numpy`'s
    values, bit for bit, computed by one numba kernel: word split, CRC-32 word hashes, n-gram hashes, fmix,
    permutations and minimum in one pass per document, no batch-sized temporaries). `parallel=True` spreads the
    documents over numba's threads (`numba.get_num_threads()`)."""
    a, b = permutations(num_perm, seed)
    data, offsets = _kernel_input(texts)
    sig = np.full((len(offsets) - 1, num_perm), _MAX32, np.uint32)
    (_signatures_parallel if parallel else _signatures_serial)(data, offsets, n, a, b, sig)
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
