"""Decontamination recall and false positives: eval items planted in training documents, whole and in part.

    python -m bench.decontam [--docs 400] [--json]

Eval sets: HumanEval's 164 problems (built-in, prompt + canonical solution) and a text set of 150 paragraphs
(>= 40 words) taken from the last file of the bundled Python-docs corpus. Training documents: pages of the other
files (a page holding one of the text-set paragraphs is left out, so "clean" means clean). Each planted document is
a clean page with one eval item inserted at a random word boundary, in one of these forms:

- whole: the item as it is;
- partial-N: a random span of N consecutive words of the item (N = 13, 20, 50; words as the step counts them,
  `\\w+` runs), upper-cased and re-punctuated (commas between words), which normalisation must see through;
- partial-12: 12 words only, below the 13-gram window: detection here is by design impossible (expected 0).

Recall is the share of planted documents rejected as `contaminated` naming the planted item's set; the false-
positive rate is the share of unplanted pages rejected (their shared n-grams are listed: a page of the docs
may quote the same sentence as another page, which is a real overlap, not a false one). Throughput: documents per second of the step's
pure function (`decontaminate_table`) on the planted + clean documents, one core, with the load average beside it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lifecycle.tasks.data.decontaminate.ngrams import words  # noqa: E402
from lifecycle.tasks.data.decontaminate.stage import DecontaminateConfig, build_index, decontaminate_table  # noqa: E402
from tests.conftest import CORPUS, docs_table  # noqa: E402

FORMS = ("whole", "partial-13", "partial-20", "partial-50", "partial-12")


def pages(files) -> list[str]:
    out = []
    for f in files:
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            out += [json.loads(line)["text"] for line in fh]
    return out


def text_set(rng: random.Random, n: int = 150) -> list[str]:
    paras = [p.strip() for t in pages(CORPUS[-1:]) for p in t.split("\n\n") if len(words(p)) >= 40]
    rng.shuffle(paras)
    return paras[:n]


def plant(page: str, item: str, form: str, rng: random.Random) -> str:
    if form != "whole":  # N words as the step counts them (lower-cased \w+ runs), re-punctuated
        w = words(item)
        n = int(form.split("-")[1])
        start = rng.randrange(0, max(1, len(w) - n + 1))
        item = ", ".join(w[start:start + n]).upper()
    pw = page.split(" ")
    at = rng.randrange(0, len(pw) + 1)
    return " ".join(pw[:at] + [item] + pw[at:])


def run(n_docs: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    items = text_set(rng)
    with tempfile.TemporaryDirectory() as tmp:
        tset = Path(tmp) / "docs_paragraphs.jsonl"
        tset.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(items)))
        cfg = DecontaminateConfig(enabled=True, sets=("humaneval", str(tset)))
        t0 = time.perf_counter()
        index = build_index(cfg)
        index_s = time.perf_counter() - t0
        from lifecycle.tasks.data.decontaminate.sets import read_items, resolve_set
        he = [t for _, t in read_items(resolve_set("humaneval"), (), ())]
    all_clean = [p for p in pages(CORPUS[:-1]) if len(words(p)) >= 50]
    rng.shuffle(all_clean)
    base = all_clean[:n_docs]
    planted, labels = [], []
    for i, page in enumerate(base):
        form = FORMS[i % len(FORMS)]
        which, pool = ("humaneval", he) if i % 2 else ("docs_paragraphs", items)
        planted.append(plant(page, rng.choice(pool), form, rng))
        labels.append((form, which))
    controls = all_clean[n_docs:2 * n_docs]
    texts = planted + controls
    table = docs_table(texts)
    t0 = time.perf_counter()
    kept, rejected, stats = decontaminate_table(table, index)
    secs = time.perf_counter() - t0
    mb = sum(len(t.encode()) for t in texts) / 1e6
    hit = {r["doc_id"]: json.loads(r["detail"])["set"] for r in rejected.to_pylist()}
    by_form = {}
    for form in FORMS:
        idx = [i for i, (f, _) in enumerate(labels) if f == form]
        found = sum(1 for i in idx if hit.get(f"d{i}") == labels[i][1])
        by_form[form] = {"planted": len(idx), "detected": found, "recall": found / len(idx) if idx else None}
    fp = sum(1 for j in range(len(planted), len(texts)) if f"d{j}" in hit)
    return {"eval_items": {"humaneval": index.items.get("humaneval"), "docs_paragraphs": len(items)},
            "items_too_short": index.too_short, "ngram": cfg.ngram,
            "recall_by_form": by_form,
            "recall_planted_13plus": sum(v["detected"] for k, v in by_form.items() if k != "partial-12")
            / sum(v["planted"] for k, v in by_form.items() if k != "partial-12"),
            "clean_docs": len(controls), "false_positives": fp, "false_positive_rate": fp / len(controls),
            "false_positive_ngrams": [json.loads(r["detail"]) for r in rejected.to_pylist()
                                      if int(r["doc_id"][1:]) >= len(planted)][:5],
            "docs_per_s": len(texts) / secs, "mb_per_s": mb / secs, "mean_doc_bytes": round(mb * 1e6 / len(texts)), "index_build_s": round(index_s, 3),
            "load_average": os.getloadavg()[0]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=400, help="planted documents (and as many clean controls)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = run(a.docs)
    if a.json:
        print(json.dumps(r, indent=2))
        return
    print(f"eval items: {r['eval_items']} (too short for a {r['ngram']}-gram: {r['items_too_short']})")
    print(f"{'form':<12}{'planted':>9}{'detected':>10}{'recall':>9}")
    for form, v in r["recall_by_form"].items():
        print(f"{form:<12}{v['planted']:>9}{v['detected']:>10}{v['recall']:>9.3f}")
    print(f"recall (13+ words planted): {r['recall_planted_13plus']:.3f}")
    print(f"false positives: {r['false_positives']} of {r['clean_docs']} clean pages "
          f"({r['false_positive_rate']:.3%})")
    print(f"throughput: {r['docs_per_s']:.0f} docs/s, {r['mb_per_s']:.2f} MB/s on one core ({r['mean_doc_bytes']} B/doc; "
          f"load average {r['load_average']:.2f})")


if __name__ == "__main__":
    main()
