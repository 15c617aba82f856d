"""MinHash signature speed: the dedup stage's `lifecycle.tasks.data.dedup.minhash.signatures` (numba kernel, serial and on numba's
threads) and its plain numpy reference `signatures_numpy` vs datasketch's per-shingle `update` loop and its
`MinHash.bulk`, on the same documents (the bundled corpus), 5-gram word shingles and datasketch's own permutations
(same num_perm and seed), measured side by side. Each timing includes shingling from the raw text; bulk, numpy and
numba are timed in `ROUNDS` interleaved rounds and the median is reported. Numba's JIT compile time is not counted
in the throughput: the cold compile is measured in a child process with an empty numba cache and reported apart.
Run: `.venv/bin/python -m bench.minhash_signatures`."""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np
from datasketch import MinHash

from lifecycle.tasks.data.dedup import minhash
from lifecycle.tasks.data.dedup.stage import DedupConfig, shingles, signature

ROUNDS = 3
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


def cold_compile_seconds() -> tuple[float, float]:
    """(serial, parallel) seconds of the first call in a fresh process with an empty numba cache: JIT compile."""
    code = ("import time; from lifecycle.tasks.data.dedup import minhash; t = [time.perf_counter()]\n"
            "for p in (False, True):\n    minhash.signatures(['a b c'], 5, 112, 1, parallel=p); t.append(time.perf_counter())\n"
            "print(t[1] - t[0], t[2] - t[1])")
    with tempfile.TemporaryDirectory() as cache:
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1], env={**os.environ, "NUMBA_CACHE_DIR": cache})
    serial, parallel = map(float, out.stdout.split())
    return serial, parallel


def bulk(texts: list[str], cfg: DedupConfig) -> list:
    return MinHash.bulk([list(shingles(t, cfg.ngram)) for t in texts], num_perm=cfg.num_perm, seed=cfg.seed)


def main() -> None:
    cfg = DedupConfig().minhash
    texts = load_texts()
    mb = sum(len(t.encode()) for t in texts) / 1e6
    shingle_sets = [shingles(t, cfg.ngram) for t in texts]
    t_loop, ref = timed(per_shingle_loop, shingle_sets, cfg)
    t_ours, ours = timed(signature, shingle_sets, cfg)
    same = all((a.hashvalues == b.hashvalues).all() for a, b in zip(ref, ours))
    t_compile = cold_compile_seconds()
    t0 = time.perf_counter()  # warm-up: numba cache load (compiled above or by an earlier run), regex compile
    for p in (False, True):
        minhash.signatures(texts[:20], cfg.ngram, cfg.num_perm, cfg.seed, parallel=p)
    t_first = time.perf_counter() - t0
    minhash.signatures_numpy(texts[:20], cfg.ngram, cfg.num_perm, cfg.seed)
    runs = {
        "bulk": lambda: bulk(texts, cfg),
        "numpy": lambda: minhash.signatures_numpy(texts, cfg.ngram, cfg.num_perm, cfg.seed),
        "numba": lambda: minhash.signatures(texts, cfg.ngram, cfg.num_perm, cfg.seed),
        "numba_par": lambda: minhash.signatures(texts, cfg.ngram, cfg.num_perm, cfg.seed, parallel=True),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    out = {}
    for _ in range(ROUNDS):  # interleaved, so that load from other processes hits every contender alike
        for k, fn in runs.items():
            t0 = time.perf_counter()
            out[k] = fn()
            times[k].append(time.perf_counter() - t0)
    t = {k: statistics.median(v) for k, v in times.items()}
    vec, bulk_sigs = out["numba"], out["bulk"]
    identical = bool((vec == out["numpy"]).all() and (out["numba_par"] == out["numpy"]).all())
    # same estimates: mean |J_vec - J_bulk| over consecutive document pairs
    est = np.mean([abs(minhash.lean(vec[i], cfg.seed).jaccard(minhash.lean(vec[i + 1], cfg.seed))
                       - bulk_sigs[i].jaccard(bulk_sigs[i + 1])) for i in range(len(texts) - 1)])
    threads = numba.get_num_threads()

    def row(label: str, seconds: float) -> str:
        return f"  {label:28s}: {len(texts) / seconds:9.0f} docs/s  {mb / seconds:6.2f} MB/s"

    print(f"minhash signatures: {len(texts)} docs, {mb:.2f} MB, {cfg.num_perm} permutations, {cfg.ngram}-gram shingles,"
          f" median of {ROUNDS} interleaved rounds, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(row("datasketch update loop", t_loop))
    print(row("datasketch update_batch", t_ours))
    print(f"  update_batch vs loop        : {t_loop / t_ours:.2f}x   identical signatures: {same}")
    print(row("datasketch MinHash.bulk", t["bulk"]))
    print(row("numpy reference", t["numpy"]))
    print(row("dedup stage (numba, 1 thr.)", t["numba"]))
    print(row(f"numba parallel ({threads} threads)", t["numba_par"]))
    print(f"  speed-up vs bulk            : numba 1 thread {t['bulk'] / t['numba']:.2f}x, numba {threads} threads "
          f"{t['bulk'] / t['numba_par']:.2f}x, numpy {t['bulk'] / t['numpy']:.2f}x")
    print(f"  numba == numpy reference    : {identical}   mean |dJ| vs bulk on neighbour pairs: {est:.4f}")
    print(f"  numba JIT, not counted above: cold compile {t_compile[0]:.2f} s serial + {t_compile[1]:.2f} s parallel"
          f" (empty cache, child process); first call here {t_first:.2f} s (cache load)")


if __name__ == "__main__":
    main()
