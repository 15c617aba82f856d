"""dedup quality on planted near-duplicates: real paragraphs from the bundled corpus, each copied once with a graded
word-level edit rate (substitutions, deletions, insertions). Every pair's true 5-gram Jaccard is computed, the real
dedup stage runs at its defaults (14 bands x 8 rows), and a pair counts as merged when both documents end up in the
same cluster. Targets (issue 3): recall >= 0.95 for J >= 0.8, false merges <= 1% for J <= 0.3.

Run with `-s` to see the measured numbers:
    .venv/bin/python -m pytest -q -s tests/test_dedup_quality.py
"""

import json

import numpy as np

from lifecycle.tasks.data.collect.stage import CollectConfig, run_collect
from lifecycle.tasks.data.dedup.stage import DedupConfig, run_dedup
from tests.conftest import corpus_records, jaccard

RATES = (0.005, 0.01, 0.015, 0.02, 0.025, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6)


def edit(text: str, rate: float, rng: np.random.Generator) -> str:
    """Apply round(rate x words) word edits at random positions: substitute, delete or insert a word."""
    words = text.split()
    for _ in range(max(1, round(rate * len(words)))):
        i = int(rng.integers(len(words)))
        op = rng.integers(3)
        new = f"zq{int(rng.integers(1 << 30)):x}"
        if op == 0:
            words[i] = new
        elif op == 1 and len(words) > 1:
            del words[i]
        else:
            words.insert(i, new)
    return " ".join(words)


def planted_pairs(seed: int = 0) -> tuple[list[str], list[tuple[int, int, float, float]]]:
    """(texts, pairs (base index, copy index, edit rate, true Jaccard)) over real paragraphs of >= 50 words."""
    rng = np.random.default_rng(seed)
    paragraphs = list(dict.fromkeys(p.strip() for r in corpus_records(10_000) for p in r["text"].split("\n\n")
                                    if len(p.split()) >= 50))
    texts, pairs = list(paragraphs), []
    for k, p in enumerate(paragraphs):
        rate = RATES[k % len(RATES)]
        texts.append(edit(p, rate, rng))
        pairs.append((k, len(texts) - 1, rate, jaccard(p, texts[-1])))
    return texts, pairs


def test_recall_and_false_merges_at_graded_edit_rates(tmp_path):
    texts, pairs = planted_pairs()
    path = tmp_path / "planted.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    wd = str(tmp_path / "w")
    ref = run_dedup(run_collect(CollectConfig(inputs=[str(path)]), wd), DedupConfig(), wd)
    cluster = {r["source_id"]: r["cluster_id"] for r in ref.read(["source_id", "cluster_id"]).to_pylist()}
    cluster |= {r["source_id"]: r["duplicate_of"] for r in ref.read_rejected().to_pylist()}
    assert len(cluster) == len(texts)
    merged = np.array([cluster[f"p{a}"] == cluster[f"p{b}"] for a, b, _, _ in pairs])
    j = np.array([p[3] for p in pairs])
    high, low = j >= 0.8, j <= 0.3
    recall, false_merges = merged[high].mean(), merged[low].mean()

    print(f"\ndedup quality: {len(pairs)} planted pairs from real paragraphs, 14 bands x 8 rows, 5-gram shingles")
    print(f"  {'true 5-gram J':>14} {'pairs':>6} {'merged':>7}")
    for lo, hi in ((0.0, 0.3), (0.3, 0.5), (0.5, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.85), (0.85, 0.9), (0.9, 1.01)):
        m = (j >= lo) & (j < hi)
        if m.any():
            print(f"  {f'[{lo:.2f}, {min(hi, 1):.2f})':>14} {int(m.sum()):>6} {merged[m].mean():>7.3f}")
    print(f"  recall (J >= 0.8): {recall:.3f} over {int(high.sum())} pairs (target >= 0.95)")
    print(f"  false merges (J <= 0.3): {false_merges:.4f} over {int(low.sum())} pairs (target <= 0.01)")

    assert high.sum() >= 200 and low.sum() >= 200  # enough pairs on both sides for the rates to mean something
    assert recall >= 0.95
    assert false_merges <= 0.01
