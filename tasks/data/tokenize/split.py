"""The validation split: by group, with a floor.

A group is what must never straddle train and validation (`split_by`, `group_key`): the documents of one page
(same `url`) and, when `split_by` names it, of one source file (same `source`), else the document alone. Every
document of a group goes to the same side: sections of one manual page share sentences, and a split by document
put them on both sides (issue 41). A `source` naming a JSONL, Parquet or WARC file is not a group: collect gives
that `source` to every record of such a file that has no `source` field of its own, and those records are
independent documents. (`source` is not grouped by default: it is often a corpus label.)
Near-duplicate clusters need no key here: dedup keeps one document per cluster (`cluster_id` of a kept row is
its own doc_id), so a cluster reaches tokenize as one document.

A group's place in the split order is sha256(seed, key) mapped to [0, 1) (`split_key`); val is every group below
`val_fraction`. A document alone has its doc_id as key, so an ungrouped document keeps the place it had when the
split was by document. A group larger than `max_val_fraction` of the documents cannot be held out and stays in
train, with a note. A split of 5 documents gives a loss and a contamination rate that mean nothing, so the split
has a floor in documents and in tokens: below it, the next groups in that same order are moved to val, whole,
until both floors hold, never past `max_val_fraction` of the documents (a group that would pass it is skipped).
The documents floor is known before the tokenizer exists; the tokens floor is counted with the stage's
tokenizer, and when it moves documents a trained BPE is trained again without them (`stage._build`), so val
text never shapes the vocabulary. Deterministic: the same documents and config give the same split.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

GROUP_COLUMNS = ("url", "source")
# collect's multi-record inputs (`tasks/data/collect/stage.py` `file_kind`: jsonl, parquet, warc)
MULTI_RECORD = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson", ".jsonl.zst", ".json.zst", ".ndjson.gz",
                ".parquet", ".warc", ".warc.gz", ".arc", ".arc.gz")
WINDOW_DOCS = 1024  # candidate documents read per pass over the files by the tokens floor


def group_key(doc_id: str, row: dict, split_by: tuple[str, ...]) -> str:
    """The key of a document's split group: `<column>:<value>` of the first `split_by` column set (a `source`
    naming a JSONL/Parquet/WARC file does not count), else the doc_id."""
    for col in split_by:
        value = row.get(col)
        if value and not (col == "source" and value.lower().endswith(MULTI_RECORD)):
            return f"{col}:{value}"
    return doc_id


def split_key(key: str, cfg) -> float:
    """sha256(seed, key) mapped to [0, 1): the place of a group (key from `group_key`) in the split order."""
    h = hashlib.sha256(f"{cfg.seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def split_of(key: str, cfg) -> str:
    """'val' or 'train' by `val_fraction` alone, stable for a group key (a doc_id for a document alone) and seed
    (the floor may move more groups to val: the side table's `split` column is the truth)."""
    return "val" if split_key(key, cfg) < cfg.val_fraction else "train"


@dataclass
class ValSplit:
    groups: list[list[str]]
    """doc_ids of the non-empty documents, one list per group, groups in split order."""
    keys: list[str]
    cap: int
    """At most this many val documents (`max_val_fraction`)."""
    val: set[str] = field(default_factory=set)
    by_fraction: int = 0
    """How many documents val_fraction alone gave."""
    next: int = 0
    """The first group in order that no rule has looked at yet (where the floors go on)."""
    too_large: list[int] = field(default_factory=list)
    """Groups larger than the cap: in train whatever their key."""
    notes: list[str] = field(default_factory=list)
    tokens: int | None = None

    def take(self, i: int) -> bool:
        """Move group i to val when it fits under the cap."""
        if len(self.val) + len(self.groups[i]) > self.cap:
            return False
        self.val.update(self.groups[i])
        return True

    def summary(self) -> dict:
        largest = max(self.groups, key=len, default=[])
        return {"docs": len(self.val), "docs_by_val_fraction": self.by_fraction, "tokens": self.tokens,
                "cap_docs": self.cap, "groups": len(self.groups), "largest_group_docs": len(largest),
                "groups_above_cap": len(self.too_large), "raised": bool(self.notes), "notes": self.notes}


def read_groups(files: list[Path], cfg, iter_docs: Callable) -> tuple[list[list[str]], list[str]]:
    """Groups (doc_ids in file order) and their keys, in split order (one pass over doc_ids, keys and texts)."""
    cols = [c for c in GROUP_COLUMNS if c in cfg.split_by]
    groups: dict[str, list[str]] = {}
    for batch in iter_docs(files, cfg.batch_size, cols):
        rows = batch.select(["doc_id", "text", *cols]).to_pylist()
        for r in rows:
            if r["text"]:  # an empty text is rejected by tokenize; it cannot be a val document
                groups.setdefault(group_key(r["doc_id"], r, cfg.split_by), []).append(r["doc_id"])
    keys = sorted(groups, key=lambda k: (split_key(k, cfg), k))
    return [groups[k] for k in keys], keys


def docs_floor(files: list[Path], cfg, iter_docs: Callable) -> ValSplit:
    """Val by `val_fraction`, raised to `min_val_docs`, whole groups only."""
    groups, keys = read_groups(files, cfg, iter_docs)
    n_docs = sum(map(len, groups))
    vs = ValSplit(groups, keys, int(cfg.max_val_fraction * n_docs))
    while vs.next < len(groups) and split_key(keys[vs.next], cfg) < cfg.val_fraction:
        if len(groups[vs.next]) > vs.cap:
            vs.too_large.append(vs.next)
        else:
            vs.val.update(groups[vs.next])  # val_fraction alone is not capped (as before groups)
        vs.next += 1
    vs.by_fraction = len(vs.val)
    vs.too_large += [i for i in range(vs.next, len(groups)) if len(groups[i]) > vs.cap]
    if vs.too_large:
        big = max(vs.too_large, key=lambda i: len(groups[i]))
        vs.notes.append(f"{len(vs.too_large)} split group(s) hold more than max_val_fraction={cfg.max_val_fraction} "
                        f"of the {n_docs} documents and stay in train (largest: {keys[big]!r}, {len(groups[big])} "
                        f"documents; tokenize.split_by={list(cfg.split_by)})")
    if cfg.val_fraction > 0 and vs.by_fraction < cfg.min_val_docs:
        while len(vs.val) < cfg.min_val_docs and vs.next < len(groups):
            vs.take(vs.next)
            vs.next += 1
        vs.notes.append(f"val_fraction={cfg.val_fraction} gives {vs.by_fraction} validation document(s), below "
                        f"min_val_docs={cfg.min_val_docs}: the validation split is set to {len(vs.val)} document(s)"
                        + (f" (at most max_val_fraction={cfg.max_val_fraction} of {n_docs}, whole groups)"
                           if len(vs.val) < cfg.min_val_docs else ""))
    return vs


def _texts(files: list[Path], cfg, iter_docs: Callable, wanted: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for batch in iter_docs(files, cfg.batch_size):
        for d, t in zip(batch.column("doc_id").to_pylist(), batch.column("text").to_pylist()):
            if d in wanted and t:
                out[d] = t
    return out


def tokens_floor(vs: ValSplit, files: list[Path], cfg, iter_docs: Callable, count: Callable[[list[str]], list[int]]
                 ) -> bool:
    """Raise val to `min_val_tokens` (tokens per document from `count`), whole groups in split order; True when
    documents were moved. Memory: the val texts, then at most `WINDOW_DOCS` candidates' texts at a time."""
    if cfg.val_fraction <= 0:
        return False
    texts = _texts(files, cfg, iter_docs, vs.val)
    have = sum(count([texts[d] for d in sorted(vs.val)])) if vs.val else 0
    vs.tokens = before = have
    if have >= cfg.min_val_tokens:
        return False
    moved = 0
    while have < cfg.min_val_tokens and vs.next < len(vs.groups):
        window, size = [], 0
        for i in range(vs.next, len(vs.groups)):
            if size >= WINDOW_DOCS:
                break
            window.append(i)
            size += len(vs.groups[i])
        docs = [d for i in window for d in vs.groups[i]]
        texts = _texts(files, cfg, iter_docs, set(docs))
        tokens = dict(zip(docs, count([texts[d] for d in docs])))
        for i in window:
            vs.next = i + 1
            if vs.take(i):
                have += sum(tokens[d] for d in vs.groups[i])
                moved += len(vs.groups[i])
                if have >= cfg.min_val_tokens:
                    break
    if not moved:
        vs.notes.append(f"the validation split holds {before} tokens, below min_val_tokens={cfg.min_val_tokens}, "
                        f"and max_val_fraction={cfg.max_val_fraction} allows no more documents")
        return False
    vs.notes.append(f"the validation split holds {before} tokens, below min_val_tokens={cfg.min_val_tokens}: set "
                    f"to {len(vs.val)} document(s), {have} tokens"
                    + ("" if have >= cfg.min_val_tokens else f" (capped at max_val_fraction={cfg.max_val_fraction})"))
    vs.tokens = have
    return True
