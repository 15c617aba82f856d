"""The paragraph Bloom filter: measured false-positive rate against the configured one, and throughput and memory
against an exact hash set, in the same run.

`python -m bench.bloom_dedup [--keys=1000000] [--probes=1000000]` (under a minute on 2 busy cores).

For each configured rate p in RATES a filter is sized for `keys` keys (`Bloom.sized`, as the stage does), `keys`
distinct 128-bit paragraph keys are inserted (check-and-add, as the stage does), then `probes` keys never inserted
are checked: the fraction found is the measured false-positive rate, beside the configured p and the expected rate
(1 - e^{-hN/m})^h. The peer is an exact Python set of the same 16-byte digests doing the same check-and-add. Keys
are hashed once beforehand (BLAKE2b, `keys_of`), so both sides time only membership. A last line times the
stage's whole paragraph step (`paragraphs.apply`: split, hash, filter, cut) in MB/s on synthetic documents (20,000
documents of 8 paragraphs drawn from 20,000 random 40-word paragraphs: every repeat must be cut, and
paragraphs_cut + keys_inserted = paragraphs when no false positive occurred).
Output: one JSON object on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

RATES = (1e-2, 1e-3, 1e-4)


def main(argv: list[str] | None = None) -> dict:
    from lifecycle.tasks.data.dedup import paragraphs as para

    args = dict(a.lstrip("-").split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    n, probes = int(args.get("keys", 1_000_000)), int(args.get("probes", 1_000_000))
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**63, (n + probes, 2), dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, (n + probes, 2), dtype=np.uint64)
    inserted, fresh = keys[:n], keys[n:]
    para.Bloom.sized(100, 0.01).check_add(keys[:10])  # compile the kernel outside the timings
    out = {"command": "python -m bench.bloom_dedup " + " ".join(f"--{k}={v}" for k, v in args.items()),
           "keys": n, "probes": probes, "loadavg_before": os.getloadavg()[0], "bloom": []}
    digests = [k.tobytes() for k in inserted]  # the exact peer's keys: the same 16 bytes
    fresh_digests = [k.tobytes() for k in fresh]
    t0 = time.perf_counter()
    exact: set[bytes] = set()
    for d in digests:
        if d not in exact:
            exact.add(d)
    insert_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    found = sum(d in exact for d in fresh_digests)
    probe_s = time.perf_counter() - t0
    set_bytes = sys.getsizeof(exact) + sum(sys.getsizeof(d) for d in digests[:1000]) / 1000 * len(digests)
    out["exact_set"] = {"insert_keys_per_s": round(n / insert_s), "probe_keys_per_s": round(probes / probe_s),
                        "false_positives": found, "bytes": round(set_bytes), "bytes_per_key": round(set_bytes / n, 1)}
    for p in RATES:
        b = para.Bloom.sized(n, p)
        t0 = time.perf_counter()
        b.check_add(inserted)
        ins = time.perf_counter() - t0
        t0 = time.perf_counter()
        fp = b.check_add(fresh, add=False)
        prb = time.perf_counter() - t0
        assert b.check_add(inserted[:10000], add=False).all()  # no false negatives
        out["bloom"].append({
            "fp_rate_configured": p, "fp_rate_measured": float(fp.mean()), "fp_rate_expected": b.expected_fpr(),
            "fp_rate_from_fill": b.measured_fpr(), "hashes": b.nhash, "bytes": len(b.bits),
            "bytes_per_key": round(len(b.bits) / n, 2),
            "insert_keys_per_s": round(n / ins), "probe_keys_per_s": round(probes / prb),
            "insert_speed_vs_set": round((n / ins) / out["exact_set"]["insert_keys_per_s"], 2),
            "memory_vs_set": round(len(b.bits) / set_bytes, 4)})
    # the stage's whole paragraph step on synthetic documents (half the paragraphs repeat)
    vocab = [f"w{i}" for i in range(5000)]
    para_pool = [" ".join(rng.choice(vocab, 40)) for _ in range(20_000)]
    picks = rng.integers(0, len(para_pool), (20_000, 8))
    docs = ["\n\n".join(para_pool[i] for i in row) for row in picks]
    mb = sum(len(d.encode()) for d in docs) / 1e6
    cfg = para.ParagraphConfig(enabled=True, capacity=200_000)
    b = para.Bloom.sized(cfg.capacity, cfg.fp_rate)
    t0 = time.perf_counter()
    _, _, facts = para.apply(docs, b, cfg)
    dt = time.perf_counter() - t0
    out["paragraph_step"] = {"documents": len(docs), "mb": round(mb, 1), "mb_per_s": round(mb / dt, 1),
                             "paragraphs_cut": sum(f["cut"] for f in facts),
                             "paragraphs": int(picks.size), "distinct_paragraphs": len(np.unique(picks)),
                             "keys_inserted": b.inserted}
    out["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
