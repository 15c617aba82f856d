"""Compiled (numba) n-gram counts for Gopher repetition, exactly equal to the string-based definitions
(`gopher_repetition.top_ngram_chars_python` / `dup_ngram_chars_python`, datatrove's loops).

An n-gram is a slice of one code-point array: the words joined with " " (top n-grams) or with "" (duplicated
n-grams, where "ab"+"c" and "a"+"bc" are the same string and must count as the same n-gram). Two n-grams are
equal exactly when their slices are equal. Each slice gets a polynomial hash mod 2^64 in O(1) from prefix hashes;
the hash only picks the slot of an open-addressing table, and a hash hit is confirmed by comparing the slices
code point by code point, so a hash collision can cost time but never change a result. Lengths are code points,
as Python's `len`. Imported lazily by gopher_repetition (numba loads only where the rule reaches its n-grams);
`cache=True` keeps the compiled kernels under __pycache__ for the next process.
"""

from __future__ import annotations

import numba
import numpy as np

_BASE = np.uint64(0x100000001B3)  # odd multiplier of the polynomial hash (FNV-64 prime)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing of the 64-bit hash into a table slot


@numba.njit(cache=True)
def _prefix_hashes(cp):
    """(prefix hash of cp[:k] for k = 0..len, BASE^k for k = 0..len), both mod 2^64."""
    m = len(cp)
    pre = np.empty(m + 1, np.uint64)
    pw = np.empty(m + 1, np.uint64)
    pre[0] = np.uint64(0)
    pw[0] = np.uint64(1)
    for k in range(m):
        pre[k + 1] = pre[k] * _BASE + np.uint64(cp[k]) + np.uint64(1)
        pw[k + 1] = pw[k] * _BASE
    return pre, pw


@numba.njit(cache=True, inline="always")
def _same(cp, a, b, c, d):
    """cp[a:b] == cp[c:d]."""
    if b - a != d - c:
        return False
    for k in range(b - a):
        if cp[a + k] != cp[c + k]:
            return False
    return True


@numba.njit(cache=True, inline="always")
def _span(offsets, n, sep, i):
    """(start, end) of the n-gram at position i in the words joined with a separator of `sep` characters."""
    return offsets[i] + i * sep, offsets[i + n] + (i + n - 1) * sep


@numba.njit(cache=True, inline="always")
def _find_or_add(cp, pre, pw, offsets, n, sep, i, table, hashes, shift):
    """Slot of the n-gram equal to the one at position i in the table (same code points), adding position i to an
    empty slot when absent; returns (slot, found)."""
    a, b = _span(offsets, n, sep, i)
    h = pre[b] - pre[a] * pw[b - a]
    mask = len(table) - 1
    s = np.int64((h * _MIX) >> np.uint64(shift))
    while True:
        j = table[s]
        if j < 0:
            table[s] = i
            hashes[s] = h
            return s, False
        if hashes[s] == h:
            c, d = _span(offsets, n, sep, j)
            if _same(cp, c, d, a, b):
                return s, True
        s = (s + 1) & mask


@numba.njit(cache=True)
def _table(m):
    bits = 1
    while (1 << bits) < 2 * m + 2:
        bits += 1
    return np.full(1 << bits, -1, np.int64), np.zeros(1 << bits, np.uint64), 64 - bits


@numba.njit(cache=True)
def _top_chars(cp, pre, pw, offsets, n, sep):
    """(len x count, first position) of the most frequent n-gram, the first seen among equally frequent ones
    (Counter.most_common)."""
    m = len(offsets) - n
    table, hashes, shift = _table(m)
    counts = np.zeros(len(table), np.int64)
    best_slot, best_count, best_first = -1, 0, m
    for i in range(m):
        s, _ = _find_or_add(cp, pre, pw, offsets, n, sep, i, table, hashes, shift)
        counts[s] += 1
        c, first = counts[s], table[s]
        if c > best_count or (c == best_count and first < best_first):
            best_slot, best_count, best_first = s, c, first
    a, b = _span(offsets, n, sep, table[best_slot])
    return (b - a) * best_count, table[best_slot]


@numba.njit(cache=True)
def _dup_chars(cp, pre, pw, offsets, n, sep):
    """Characters of n-grams seen before, skipping n positions after each repeat (datatrove find_all_duplicate)."""
    m = max(0, len(offsets) - n)
    table, hashes, shift = _table(m)
    chars, i = 0, 0
    while i < m:
        _, found = _find_or_add(cp, pre, pw, offsets, n, sep, i, table, hashes, shift)
        if found:
            a, b = _span(offsets, n, sep, i)
            chars += b - a
            i += n
        else:
            i += 1
    return chars


def _codepoints(s: str) -> np.ndarray:
    """One uint32 per code point (lone surrogates included, one each, as Python's len counts them)."""
    return np.frombuffer(s.encode("utf-32-le", "surrogatepass"), np.uint32)


class Ngrams:
    """The n-gram counts of one word list: code points and prefix hashes are built once, for every n."""

    def __init__(self, words: list[str]):
        self.words = words
        self.offsets = np.zeros(len(words) + 1, np.int64)  # start of word k in the words joined with ""
        np.cumsum(np.fromiter(map(len, words), np.int64, len(words)), out=self.offsets[1:])
        self._joined: dict[str, tuple] = {}

    def _arrays(self, sep: str) -> tuple:
        if sep not in self._joined:
            cp = _codepoints(sep.join(self.words))
            self._joined[sep] = (cp, *_prefix_hashes(cp))
        return self._joined[sep]

    def top_chars(self, n: int) -> int:
        """top_ngram_chars_python(words, n); words must have at least n entries (as for Counter.most_common)."""
        return self.top(n)[0]

    def top(self, n: int) -> tuple[int, str]:
        """(top_chars(n), that n-gram: its words joined with " "); words must have at least n entries."""
        if len(self.words) < n:
            raise ValueError(f"top n-gram of {len(self.words)} words with n={n}: needs at least n words")
        chars, first = _top_chars(*self._arrays(" "), self.offsets, n, 1)  # type: ignore[call-arg]  # numba
        return int(chars), " ".join(self.words[first : first + n])

    def dup_chars(self, n: int) -> int:
        """dup_ngram_chars_python(words, n)."""
        return int(_dup_chars(*self._arrays(""), self.offsets, n, 0))  # type: ignore[call-arg]  # numba
