"""The train/val word n-gram overlap, per val document and per (val, train) document pair.

N-grams are `decontaminate.ngrams`' (lower-cased `\\w+` words), so the figures agree with the decontamination step
and the evaluate report. The val split's n-grams (the small side) are indexed; the train texts are streamed past
them once, so memory is bounded by the val split, not the corpus: for each val n-gram, the number of train
documents holding it and, until it is boilerplate, which ones (at most `boilerplate_docs`; with None, all).

Two readings of the same index:
- GPT-3's "dirty" (appendix C): a val document sharing any n-gram with train (`contamination_doc_rate`);
- a near copy: a val document of which at least `min_share` of the n-grams are found in train, not counting
  boilerplate, an n-gram found in more than `boilerplate_docs` train documents (GPT-3 appendix C ignored 13-grams
  matching more than 10 training documents: "common cultural phrases, legal boilerplate"). PaLM (section 8)
  called an example contaminated when 70% of its 8-grams were in the training data. This is what the gate counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

from lifecycle.tasks.data.decontaminate.ngrams import ngram_hashes, words

TOP = 20  # pairs and passages in the report
MAX_LISTED = 200  # val documents listed in the report, closest to a copy first
PASSAGE_CHARS = 300


@dataclass
class Index:
    n: int
    boilerplate_docs: int | None
    grams: dict[int, list[int]] = field(default_factory=dict)
    """val n-gram -> the val documents (positions in `docs`) holding it."""
    docs: list[dict] = field(default_factory=list)
    """val documents: doc_id, source_id, text, ngrams (distinct)."""
    df: Counter = field(default_factory=Counter)
    """val n-gram -> train documents holding it."""
    postings: dict[int, list[int]] = field(default_factory=dict)
    """val n-gram -> its first train documents (positions in `train`), dropped once it is boilerplate."""
    train: list[tuple[str, str]] = field(default_factory=list)
    """(doc_id, source_id) of the train documents sharing an n-gram with val."""

    def boilerplate(self, h: int) -> bool:
        return self.boilerplate_docs is not None and self.df[h] > self.boilerplate_docs

    def add_val(self, doc_id: str, source_id: str, text: str) -> None:
        own = {h for h, _ in ngram_hashes(text, self.n)}
        for h in own:
            self.grams.setdefault(h, []).append(len(self.docs))
        self.docs.append({"doc_id": doc_id, "source_id": source_id, "text": text, "ngrams": len(own)})

    def add_train(self, doc_id: str, source_id: str, text: str) -> None:
        hits = {h for h, _ in ngram_hashes(text, self.n) if h in self.grams}
        if not hits:
            return
        t = len(self.train)
        self.train.append((doc_id, source_id))
        for h in hits:
            self.df[h] += 1
            if self.boilerplate(h):
                self.postings.pop(h, None)
            else:
                self.postings.setdefault(h, []).append(t)


def build_index(batches: Callable[[], Iterable[tuple[list, list, list]]], val: set[str], n: int,
                boilerplate_docs: int | None) -> Index:
    """Index the val documents of `batches()` (doc_ids, source_ids, texts), then stream the train ones past it."""
    idx = Index(n, boilerplate_docs)
    for ids, sources, texts in batches():
        for d, s, t in zip(ids, sources, texts):
            if t and d in val:
                idx.add_val(d, s, t)
    for ids, sources, texts in batches():
        for d, s, t in zip(ids, sources, texts):
            if t and d not in val:
                idx.add_train(d, s, t)
    return idx


def per_doc(idx: Index) -> list[dict]:
    """For each val document: n-grams found in train (`shared`, boilerplate not counted), boilerplate n-grams,
    any n-gram in train at all, and `share` = shared / (n-grams - boilerplate)."""
    out = [{"shared": 0, "boilerplate": 0, "any": False} for _ in idx.docs]
    for h, holders in idx.grams.items():
        if not idx.df[h]:
            continue
        bp = idx.boilerplate(h)
        for j in holders:
            out[j]["any"] = True
            out[j]["boilerplate" if bp else "shared"] += 1
    for d, o in zip(idx.docs, out):
        counted = d["ngrams"] - o["boilerplate"]
        o["share"] = o["shared"] / counted if counted else 0.0
    return out


def pairs(idx: Index) -> Counter:
    """(val position, train position) -> shared n-grams, boilerplate not counted."""
    c: Counter = Counter()
    for h, train in idx.postings.items():
        for j in idx.grams[h]:
            for t in train:
                c[j, t] += 1
    return c


def passages(idx: Index) -> list[dict]:
    """Runs of consecutive shared n-grams in the val texts, as the words they cover: those that count first
    (not all boilerplate), then by how many val documents hold them. `train_docs`: train documents holding the
    passage's rarest n-gram."""
    found: dict[str, dict] = {}
    for j, d in enumerate(idx.docs):
        w = words(d["text"])
        hs = [h for h, _ in ngram_hashes(d["text"], idx.n)]
        i = 0
        while i < len(hs):
            if not idx.df[hs[i]]:
                i += 1
                continue
            k = i
            while k + 1 < len(hs) and idx.df[hs[k + 1]]:
                k += 1
            run = hs[i:k + 1]
            p = found.setdefault(" ".join(w[i:k + idx.n]), {
                "words": k + idx.n - i, "val": set(), "train_docs": min(idx.df[h] for h in run),
                "boilerplate": all(idx.boilerplate(h) for h in run)})
            p["val"].add(j)
            i = k + 1
    out = [{"text": t[:PASSAGE_CHARS] + ("…" if len(t) > PASSAGE_CHARS else ""), "words": p["words"],
            "val_docs": len(p["val"]), "train_docs": p["train_docs"], "boilerplate": p["boilerplate"]}
           for t, p in found.items()]
    out.sort(key=lambda p: (p["boilerplate"], -p["val_docs"], -p["train_docs"], -p["words"], p["text"]))
    return out[:TOP]


def overlap(batches: Callable[[], Iterable[tuple[list, list, list]]], val: set[str], n: int,
            boilerplate_docs: int | None, min_share: float) -> tuple[dict, dict]:
    """(`contamination_*` metrics, report) of the split: see the module docstring."""
    idx = build_index(batches, val, n, boilerplate_docs)
    docs = per_doc(idx)
    pair = pairs(idx)
    best: dict[int, tuple[int, int]] = {}
    for (j, t), k in pair.items():
        if j not in best or (k, -t) > (best[j][0], -best[j][1]):
            best[j] = (k, t)
    near = [j for j, o in enumerate(docs) if o["shared"] and o["share"] >= min_share]
    hits = sum(o["shared"] + o["boilerplate"] for o in docs)
    total = sum(d["ngrams"] for d in idx.docs)
    m = len(docs)
    metrics = {"contamination_doc_rate": sum(o["any"] for o in docs) / m if m else 0.0,
               "contamination_ngram_rate": hits / total if total else 0.0,
               "contamination_eval_docs": m, "contamination_dirty_docs": sum(o["any"] for o in docs),
               "contamination_near_copy_docs": len(near),
               "contamination_near_copy_rate": len(near) / m if m else 0.0,
               "contamination_boilerplate_ngrams": sum(1 for h in idx.df if idx.boilerplate(h))}

    def val_doc(j: int) -> dict:
        d, o = idx.docs[j], docs[j]
        return {"val_doc_id": d["doc_id"], "val_source_id": d["source_id"], "val_ngrams": d["ngrams"],
                "shared_ngrams": o["shared"], "boilerplate_ngrams": o["boilerplate"], "share": round(o["share"], 4)}

    def train_doc(t: int, k: int) -> dict:
        return {"train_doc_id": idx.train[t][0], "train_source_id": idx.train[t][1], "pair_shared_ngrams": k}

    closest = sorted((j for j, o in enumerate(docs) if o["shared"]), key=lambda j: (-docs[j]["share"],
                                                                                   idx.docs[j]["doc_id"]))
    top = sorted(pair.items(), key=lambda x: (-x[1], idx.docs[x[0][0]]["doc_id"], idx.train[x[0][1]][0]))[:TOP]
    near_set = set(near)
    report = {"closest_val_docs": [val_doc(j) | {"near_copy": j in near_set} | train_doc(best[j][1], best[j][0])
                                   for j in closest[:MAX_LISTED]],
              "top_pairs": [val_doc(j) | train_doc(t, k) for (j, t), k in top],
              "top_passages": passages(idx)}
    return metrics, report
