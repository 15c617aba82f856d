"""Gopher repetition rules (Rae et al. 2021, table A1), following datatrove 0.10.1
`src/datatrove/pipeline/filters/gopher_repetition_filter.py` line by line so that our decisions can be
benchmarked against it (bench/filter_agreement.py): duplicate paragraph/line fractions and character fractions,
top 2/3/4-gram character fractions, duplicated 5..10-gram character fractions. The n-gram counts run compiled
(ngrams.py: hashed slices of the joined words, confirmed by comparing code points, so exactly the values of the
string-based `*_python` definitions kept here as the reference).

Beyond datatrove: a drop's detail names its value, its limit and, for n-gram rules, the n-gram
(`top_3_gram_char_frac=0.3091 > 0.3, ngram="= = ="`; for duplicated n-grams the most frequent one); and
`skip_markup_lines` (rule.MarkupAware; off by default, so decisions are datatrove's) judges the text without its
lines of markup only.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import ClassVar

from pydantic import Field

from lifecycle.tasks.data.filter.rule import MarkupAware, Verdict, beyond, quoted, register
from lifecycle.tasks.data.filter.words import find_duplicates, split_words

_PARAGRAPH = re.compile(r"\n{2,}")
_LINES = re.compile("\n+")


def _ngrams(words: list[str], n: int, sep: str) -> list[str]:
    """The n-grams of `words` at every position, each joined with `sep` (built in C: map over zip)."""
    return list(map(sep.join, zip(*(words[k:] for k in range(n)))))


def top_ngram_chars_python(words: list[str], n: int) -> int:
    """Characters covered by the most frequent n-gram (space-joined length x count): datatrove `find_top_duplicate`.
    Ties go to the n-gram seen first (Counter.most_common keeps insertion order among equal counts).
    The string-based definition: the reference of `top_ngram_chars` in tests and bench.gopher_speed."""
    gram, c = Counter(_ngrams(words, n, " ")).most_common(1)[0]
    return len(gram) * c


def dup_ngram_chars_python(words: list[str], n: int) -> int:
    """Characters in repeated n-grams, skipping past each repeat: datatrove `find_all_duplicate` (its n-grams
    joined without a separator). The string-based definition: the reference of `dup_ngram_chars`."""
    grams = _ngrams(words, n, "")
    seen: set[str] = set()
    add, chars, i, end = seen.add, 0, 0, len(grams)
    while i < end:
        gram = grams[i]
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            add(gram)
            i += 1
    return chars


def _ngram_counts(words: list[str]):
    """The compiled counts of one word list (ngrams.py; numba is imported on the first call only)."""
    from lifecycle.tasks.data.filter.ngrams import Ngrams

    return Ngrams(words)


def top_ngram_chars(words: list[str], n: int) -> int:
    """`top_ngram_chars_python`'s value, computed by the compiled kernel of ngrams.py."""
    return _ngram_counts(words).top_chars(n)


def dup_ngram_chars(words: list[str], n: int) -> int:
    """`dup_ngram_chars_python`'s value, computed by the compiled kernel of ngrams.py."""
    return _ngram_counts(words).dup_chars(n)


def _warm_kernels() -> None:
    """numba with the compiled n-gram kernels, loaded once in a shard worker before its shards fork."""
    top_ngram_chars(["warm", "up"], 2)
    dup_ngram_chars(["warm", "up"], 2)


@register("gopher_repetition", reasons=("gopher_dup_", "gopher_top_", "gopher_rep_"),
          doc="Gopher repetition rules (gopher_repetition.py).", order=20, warm=_warm_kernels)
class GopherRepetitionConfig(MarkupAware):
    """Gopher repetition rules (datatrove GopherRepetitionFilter defaults). Every threshold can be set to null,
    every n-gram list to [], to disable it."""

    uses_words: ClassVar[bool] = False  # it splits the text itself, and only once it reaches its n-gram checks

    dup_para_frac: float | None = Field(0.3, ge=0, description="Max fraction of duplicated paragraphs. Gopher: 0.30.")
    dup_para_char_frac: float | None = Field(0.2, ge=0, description=(
        "Max fraction of characters in duplicated paragraphs. Gopher: 0.20."))
    dup_line_frac: float | None = Field(0.3, ge=0, description="Max fraction of duplicated lines. Gopher: 0.30.")
    dup_line_char_frac: float | None = Field(0.2, ge=0, description=(
        "Max fraction of characters in duplicated lines. Gopher: 0.20."))
    top_ngram_char_frac: tuple[tuple[int, float], ...] = Field(((2, 0.2), (3, 0.18), (4, 0.16)), description=(
        "(n, max fraction of characters covered by the most frequent n-gram). Gopher: 2: 0.20, 3: 0.18, 4: 0.16."))
    dup_ngram_char_frac: tuple[tuple[int, float], ...] = Field(
        ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10)), description=(
            "(n, max fraction of characters in duplicated n-grams). Gopher: 5: 0.15 ... 10: 0.10."))

    def reason(self, text: str, words: list[str] | None = None) -> Verdict:
        text, words = self.own_view(text, words)
        if not text:
            return "gopher_rep_empty", "empty text"
        checks = ((_PARAGRAPH.split(text.strip()), "para", self.dup_para_frac, self.dup_para_char_frac),
                  (_LINES.split(text), "line", self.dup_line_frac, self.dup_line_char_frac))
        for parts, unit, most, most_chars in checks:
            dup, chars = find_duplicates(parts)
            if most is not None and dup / len(parts) > most:
                return f"gopher_dup_{unit}_frac", beyond(f"dup_{unit}_frac", dup / len(parts), ">", most)
            if most_chars is not None and chars / len(text) > most_chars:
                return f"gopher_dup_{unit}_char_frac", beyond(f"dup_{unit}_char_frac", chars / len(text), ">",
                                                              most_chars)
        if not (self.top_ngram_char_frac or self.dup_ngram_char_frac):
            return None  # no n-gram check: no words needed
        words = split_words(text) if words is None else words  # the paragraph and line checks need no words
        return self._ngram_reason(text, words)

    def _ngram_reason(self, text: str, words: list[str]) -> Verdict:
        grams = _ngram_counts(words)  # code points and prefix hashes once, for every n
        for n, frac in self.top_ngram_char_frac:
            if len(words) >= n:
                chars, gram = grams.top(n)
                if chars / len(text) > frac:
                    detail = beyond(f"top_{n}_gram_char_frac", chars / len(text), ">", frac)
                    return f"gopher_top_{n}_gram", f"{detail}, ngram={quoted(gram)}"
        for n, frac in self.dup_ngram_char_frac:
            r = grams.dup_chars(n) / len(text)
            if r > frac:  # the n-gram named is the most frequent one (the duplicates are many)
                return f"gopher_dup_{n}_grams", f"{beyond(f'dup_{n}_gram_char_frac', r, '>', frac)}, " \
                                               f"ngram={quoted(grams.top(n)[1])}"
        return None
