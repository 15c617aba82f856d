"""SimHash against MinHash on near-duplicates planted at known Jaccard levels, both through the real dedup stage in
the same run.

`python -m bench.simhash_vs_minhash [--bases=1500] [--seed=0]` (about a minute on 2 busy cores).

Base corpus: distinct paragraphs of >= 50 words from the bundled real corpus. For every base and every target
Jaccard J in TARGETS, one copy with word substitutions at the rate that gives J for 5-gram shingles on average
(u = 2J / (1 + J) of the shingles unchanged, rate = 1 - u^(1/5)); each pair's true 5-gram Jaccard is then measured
and the pair is binned by it. Each method runs `run_dedup` (signatures and decisions, `incremental=False`) on the
same collected corpus; a pair counts as merged when both documents end in the same cluster. Reported per method:
recall at J >= 0.8, false merges at J <= 0.3 (planted pairs that should stay apart), merges across different bases
(documents of two unrelated bases in one cluster), merge rate per Jaccard bin, and docs/s of the whole stage.
Output: one JSON object on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TARGETS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
BINS = ((0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.01))
METHODS = {
    "minhash (14x8, default)": {},
    "simhash k=3, 6 blocks (20 tables)": {"method": "simhash", "simhash": {"k": 3, "blocks": 6}},
    "simhash k=6, 8 blocks (28 tables)": {"method": "simhash", "simhash": {"k": 6, "blocks": 8}},
    "simhash k=10, 12 blocks (66 tables)": {"method": "simhash", "simhash": {"k": 10, "blocks": 12}},
}


def substitute(text: str, rate: float, rng: np.random.Generator) -> str:
    words = text.split()
    k = int(round(rate * len(words)))
    for i in rng.choice(len(words), k, replace=False) if k else []:
        words[i] = f"zq{int(rng.integers(1 << 30)):x}"
    return " ".join(words)


def planted(bases: int, seed: int) -> tuple[list[str], list[int], list[tuple[int, int, float, float]]]:
    """(texts, base group of each text, pairs (base index, copy index, target J, true J))."""
    from tests.conftest import corpus_records, jaccard

    rng = np.random.default_rng(seed)
    paras = list(dict.fromkeys(p.strip() for r in corpus_records(20_000, every_file=True)
                               for p in r["text"].split("\n\n") if len(p.split()) >= 50))[:bases]
    texts, group, pairs = list(paras), list(range(len(paras))), []
    for b, p in enumerate(paras):
        for t in TARGETS:
            u = 2 * t / (1 + t)
            texts.append(substitute(p, 1 - u ** (1 / 5), rng))
            group.append(b)
            pairs.append((b, len(texts) - 1, t, jaccard(p, texts[-1])))
    return texts, group, pairs


def run_method(parent, overrides: dict, wd: str) -> tuple[dict[str, str], float]:
    from lifecycle.tasks.data.dedup.stage import DedupConfig, run_dedup

    t0 = time.perf_counter()
    ref = run_dedup(parent, DedupConfig(incremental=False, **overrides), wd)
    dt = time.perf_counter() - t0
    cluster = {r["source_id"]: r["cluster_id"] for r in ref.read(["source_id", "cluster_id"]).to_pylist()}
    cluster |= {r["source_id"]: r["duplicate_of"] for r in ref.read_rejected().to_pylist()}
    return cluster, dt


def main(argv: list[str] | None = None) -> dict:
    args = dict(a.lstrip("-").split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    bases, seed = int(args.get("bases", 1500)), int(args.get("seed", 0))
    from lifecycle.tasks.data.collect.stage import CollectConfig, run_collect

    texts, group, pairs = planted(bases, seed)
    j = np.array([p[3] for p in pairs])
    out = {"command": "python -m bench.simhash_vs_minhash " + " ".join(f"--{k}={v}" for k, v in args.items()),
           "documents": len(texts), "bases": bases, "planted_pairs": len(pairs),
           "pairs_j_ge_0.8": int((j >= 0.8).sum()), "pairs_j_le_0.3": int((j <= 0.3).sum()),
           "loadavg_before": os.getloadavg()[0], "methods": {}}
    with tempfile.TemporaryDirectory(prefix="bench-simhash-") as tmp:
        wd = str(Path(tmp) / "w")
        warm = Path(tmp) / "warm.jsonl"  # compile numba kernels outside the timings
        warm.write_text("".join(json.dumps({"id": f"w{i}", "text": t}) + "\n" for i, t in enumerate(texts[:50])))
        warm_parent = run_collect(CollectConfig(inputs=[str(warm)]), wd)
        for overrides in METHODS.values():
            run_method(warm_parent, overrides, wd)
        path = Path(tmp) / "planted.jsonl"
        path.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
        parent = run_collect(CollectConfig(inputs=[str(path)]), wd)
        for name, overrides in METHODS.items():
            cluster, dt = run_method(parent, overrides, wd)
            merged = np.array([cluster[f"p{a}"] == cluster[f"p{b}"] for a, b, _, _ in pairs])
            groups_of: dict[str, set[int]] = {}
            for i, g in enumerate(group):
                groups_of.setdefault(cluster[f"p{i}"], set()).add(g)
            out["methods"][name] = {
                "recall_j_ge_0.8": round(float(merged[j >= 0.8].mean()), 4),
                "false_merges_j_le_0.3": round(float(merged[j <= 0.3].mean()), 4),
                "clusters_joining_unrelated_bases": sum(len(s) > 1 for s in groups_of.values()),
                "merge_rate_by_jaccard": {f"[{lo},{min(hi, 1.0)})": round(float(merged[(j >= lo) & (j < hi)].mean()), 3)
                                          for lo, hi in BINS if ((j >= lo) & (j < hi)).any()},
                "seconds": round(dt, 2), "docs_per_s": round(len(texts) / dt)}
    out["loadavg_after"] = os.getloadavg()[0]
    mh = out["methods"]["minhash (14x8, default)"]["docs_per_s"]
    for m in out["methods"].values():
        m["speed_vs_minhash"] = round(m["docs_per_s"] / mh, 2)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
