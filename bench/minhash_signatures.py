"""MinHash signature speed: our dedup stage's signature path and the vectorised `tasks.minhash.signatures`
vs datasketch's per-shingle `update` loop and its `MinHash.bulk`, on the same documents (the bundled corpus),
5-gram word shingles and datasketch's own permutations (same num_perm and seed), measured side by side.
Each timing includes shingling from the raw text. Run: `.venv/bin/python -m bench.minhash_signatures`."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import numpy as np
from datasketch import MinHash

from tasks import minhash
from tasks.dedup import DedupConfig, shingles, signature

CORPUS = sorted((Path(__file__).resolve().parents[1] / "corpus" / "python-docs").glob("*.jsonl.gz"))


def load_texts(limit: int = 1500) -> list[str]:
    texts = []
    for path in CORPUS:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                texts.append(json.loads(line)["text"])
                if len(texts) == limit:
                    return texts
    return texts


def per_shingle_loop(sh: set[bytes], cfg: DedupConfig) -> MinHash:
    m = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
    for s in sh:
        m.update(s)
    return m


def timed(fn, shingle_sets, cfg) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = [fn(sh, cfg) for sh in shingle_sets]
    return time.perf_counter() - t0, out


def main() -> None:
    cfg = DedupConfig()
    texts = load_texts()
    mb = sum(len(t.encode()) for t in texts) / 1e6
    shingle_sets = [shingles(t, cfg.ngram) for t in texts]
    t_loop, ref = timed(per_shingle_loop, shingle_sets, cfg)
    t_ours, ours = timed(signature, shingle_sets, cfg)
    same = all((a.hashvalues == b.hashvalues).all() for a, b in zip(ref, ours))
    minhash.signatures(texts[:20], cfg.ngram, cfg.num_perm, cfg.seed)  # warm-up (regex compile, imports)
    t0 = time.perf_counter()
    bulk = MinHash.bulk([list(shingles(t, cfg.ngram)) for t in texts], num_perm=cfg.num_perm, seed=cfg.seed)
    t_bulk = time.perf_counter() - t0
    t0 = time.perf_counter()
    vec = minhash.signatures(texts, cfg.ngram, cfg.num_perm, cfg.seed)
    t_vec = time.perf_counter() - t0
    # same estimates: mean |J_vec - J_bulk| over consecutive document pairs
    est = np.mean([abs(minhash.lean(vec[i], cfg.seed).jaccard(minhash.lean(vec[i + 1], cfg.seed))
                       - bulk[i].jaccard(bulk[i + 1])) for i in range(len(texts) - 1)])
    print(f"minhash signatures: {len(texts)} docs, {mb:.2f} MB, {cfg.num_perm} permutations, {cfg.ngram}-gram shingles")
    print(f"  datasketch update loop : {len(texts) / t_loop:9.0f} docs/s  {mb / t_loop:6.2f} MB/s")
    print(f"  datasketch update_batch: {len(texts) / t_ours:9.0f} docs/s  {mb / t_ours:6.2f} MB/s")
    print(f"  update_batch vs loop   : {t_loop / t_ours:.2f}x   identical signatures: {same}")
    print(f"  datasketch MinHash.bulk: {len(texts) / t_bulk:9.0f} docs/s  {mb / t_bulk:6.2f} MB/s")
    print(f"  dedup stage (numpy)    : {len(texts) / t_vec:9.0f} docs/s  {mb / t_vec:6.2f} MB/s")
    print(f"  speed-up numpy/bulk    : {t_bulk / t_vec:.2f}x   mean |dJ| vs bulk on neighbour pairs: {est:.4f}")


if __name__ == "__main__":
    main()
