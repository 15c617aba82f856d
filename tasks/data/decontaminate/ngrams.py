"""Word n-grams as GPT-3 (appendix C) and lm-eval's decontamination count them: the text lower-cased, split into
`\\w+` words, so punctuation and whitespace only separate words. One definition, used by the decontamination
step, tokenize's train/val overlap check and the evaluate report, so their numbers agree.

An n-gram is kept as Python's `hash()` of its word tuple: 8 bytes instead of 13 strings. The salt of `hash()`
differs between processes, so an index is only ever looked up in the process that built it.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

WORD = re.compile(r"\w+")


def words(text: str | None) -> list[str]:
    return WORD.findall((text or "").lower())


def ngram_hashes(text: str | None, n: int) -> Iterator[tuple[int, int]]:
    """(hash, index of its first word) of every word n-gram of `text`, in order."""
    w = words(text)
    for i in range(len(w) - n + 1):
        yield hash(tuple(w[i:i + n])), i


def ngram_set(texts: Iterable[str | None], n: int) -> set[int]:
    out: set[int] = set()
    for t in texts:
        out.update(h for h, _ in ngram_hashes(t, n))
    return out


def overlap(eval_texts: list[str | None], train_texts: Iterable[str | None], n: int) -> dict[str, float | int]:
    """Share of `eval_texts` with any n-gram of `train_texts` ("dirty", GPT-3's definition) and share of their
    n-grams found there."""
    train = ngram_set(train_texts, n)
    dirty = hits = total = 0
    for t in eval_texts:
        grams = {h for h, _ in ngram_hashes(t, n)}
        common = len(grams & train)
        dirty += common > 0
        hits, total = hits + common, total + len(grams)
    return {"contamination_doc_rate": dirty / len(eval_texts) if eval_texts else 0.0,
            "contamination_ngram_rate": hits / total if total else 0.0,
            "contamination_eval_docs": len(eval_texts), "contamination_dirty_docs": dirty}


class ContaminationError(RuntimeError):
    """A data check failed: the held-out split overlaps the training split above the configured share."""
