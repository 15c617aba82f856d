"""Data checks that run at tokenize, before any training: the train/val n-gram overlap.

GPT-3's definition: a val document is dirty when it shares a word n-gram (lower-cased `\\w+` words,
`decontaminate.ngrams`) with any train document. The val split's n-grams (the small side) are indexed; the train
texts are streamed past them, so memory is bounded by the val split, not the corpus.
"""

from __future__ import annotations

from typing import Callable, Iterable

from lifecycle.tasks.data.decontaminate.ngrams import ContaminationError, ngram_hashes

__all__ = ["ContaminationError", "check_overlap", "train_val_overlap"]


def train_val_overlap(batches: Callable[[], Iterable[tuple[list, list]]], val: set[str], n: int) -> dict:
    """`contamination_*` metrics over `batches()` of (doc_ids, texts), read twice (val first, then train)."""
    grams: dict[int, set[int]] = {}  # val n-gram -> the val documents holding it
    per_doc: list[int] = []
    for ids, texts in batches():
        for d, t in zip(ids, texts):
            if t and d in val:
                own = {h for h, _ in ngram_hashes(t, n)}
                for h in own:
                    grams.setdefault(h, set()).add(len(per_doc))
                per_doc.append(len(own))
    seen: set[int] = set()
    for ids, texts in batches():
        for d, t in zip(ids, texts):
            if t and d not in val:
                seen.update(h for h, _ in ngram_hashes(t, n) if h in grams)
    dirty = {i for h in seen for i in grams[h]}
    hits = sum(len(grams[h]) for h in seen)  # each val document's n-grams found in train
    total = sum(per_doc)
    return {"contamination_doc_rate": len(dirty) / len(per_doc) if per_doc else 0.0,
            "contamination_ngram_rate": hits / total if total else 0.0,
            "contamination_eval_docs": len(per_doc), "contamination_dirty_docs": len(dirty)}


def check_overlap(metrics: dict, ngram: int, max_contamination: float) -> None:
    """Raise `ContaminationError` when the dirty share of val documents is above `max_contamination`."""
    rate = metrics["contamination_doc_rate"]
    if rate > max_contamination:
        raise ContaminationError(
            f"{metrics['contamination_dirty_docs']} of {metrics['contamination_eval_docs']} val documents "
            f"({rate:.1%}) share a {ngram}-gram with the training documents, above "
            f"tokenize.max_contamination={max_contamination}; the run stops before training (shared boilerplate? "
            "near-copies across the split? raise tokenize.max_contamination to accept it)")
