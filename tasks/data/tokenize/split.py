"""The validation split and its floor.

A document's place in the split order is sha256(seed, doc_id) mapped to [0, 1) (`split_key`); val is every
document below `val_fraction`. A split of 5 documents gives a loss and a contamination rate that mean nothing, so
the split has a floor in documents and in tokens: below it, the next documents in that same order are moved to
val until both floors hold, never past `max_val_fraction` of the documents. The documents floor is known before
the tokenizer exists; the tokens floor is counted with the stage's tokenizer, and when it moves documents a
trained BPE is trained again without them (`stage._build`), so val text never shapes the vocabulary.
Deterministic: the same documents and config give the same split.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


@dataclass
class ValSplit:
    order: list[str]
    """doc_ids of the non-empty documents in split order."""
    val: set[str]
    by_fraction: int
    """How many val_fraction alone gave."""
    cap: int
    notes: list[str] = field(default_factory=list)
    tokens: int | None = None

    def summary(self) -> dict:
        return {"docs": len(self.val), "docs_by_val_fraction": self.by_fraction, "tokens": self.tokens,
                "cap_docs": self.cap, "raised": bool(self.notes), "notes": self.notes}


def docs_floor(files: list[Path], cfg, iter_docs: Callable, split_key: Callable) -> ValSplit:
    """Val by `val_fraction`, raised to `min_val_docs` (one pass over doc_ids and texts)."""
    keys = []
    for batch in iter_docs(files, cfg.batch_size):
        for d, t in zip(batch.column("doc_id").to_pylist(), batch.column("text").to_pylist()):
            if t:  # an empty text is rejected by tokenize; it cannot be a val document
                keys.append((split_key(d, cfg), d))
    keys.sort()
    order = [d for _, d in keys]
    n_frac = sum(1 for k, _ in keys if k < cfg.val_fraction)
    cap = int(cfg.max_val_fraction * len(order))
    vs = ValSplit(order, set(order[:n_frac]), n_frac, cap)
    if cfg.val_fraction > 0 and n_frac < cfg.min_val_docs:
        take = max(n_frac, min(cfg.min_val_docs, cap))
        vs.val = set(order[:take])
        vs.notes.append(f"val_fraction={cfg.val_fraction} gives {n_frac} validation document(s), below "
                        f"min_val_docs={cfg.min_val_docs}: the validation split is set to {take} document(s)"
                        + (f" (at most max_val_fraction={cfg.max_val_fraction} of {len(order)})"
                           if take < cfg.min_val_docs else ""))
    return vs


def tokens_floor(vs: ValSplit, files: list[Path], cfg, iter_docs: Callable, count: Callable[[list[str]], list[int]]
                 ) -> bool:
    """Raise val to `min_val_tokens` (tokens per document from `count`); True when documents were moved."""
    if cfg.val_fraction <= 0:
        return False
    k = len(vs.val)
    wanted = set(vs.order[:max(k, vs.cap)])  # the val documents, then the candidates in order
    texts: dict[str, str] = {}
    for batch in iter_docs(files, cfg.batch_size):
        for d, t in zip(batch.column("doc_id").to_pylist(), batch.column("text").to_pylist()):
            if d in wanted and t:
                texts[d] = t
    have = sum(count([texts[d] for d in vs.order[:k]])) if k else 0
    vs.tokens = have
    if have >= cfg.min_val_tokens:
        return False
    before = have
    while have < cfg.min_val_tokens and k < vs.cap:
        step = vs.order[k:min(vs.cap, k + 64)]
        for n in count([texts[d] for d in step]):
            have += n
            k += 1
            if have >= cfg.min_val_tokens:
                break
    if k == len(vs.val):
        vs.notes.append(f"the validation split holds {before} tokens, below min_val_tokens={cfg.min_val_tokens}, "
                        f"and max_val_fraction={cfg.max_val_fraction} allows no more documents")
        return False
    vs.notes.append(f"the validation split holds {before} tokens, below min_val_tokens={cfg.min_val_tokens}: set "
                    f"to {k} document(s), {have} tokens"
                    + ("" if have >= cfg.min_val_tokens else f" (capped at max_val_fraction={cfg.max_val_fraction})"))
    vs.val = set(vs.order[:k])
    vs.tokens = have
    return True
