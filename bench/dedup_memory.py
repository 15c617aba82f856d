"""Peak memory of dedup's global half as the corpus grows: bounded by DuckDB's memory limit, not the corpus.

`python -m bench.dedup_memory [docs ...] [--limit=96MB]` (default 40000 160000 640000 1280000; about 3 min on 2 cores).
For each corpus size the benchmark writes a synthetic corpus (60-word documents over a 3,000-word vocabulary;
every 5th document a one-word edit of an earlier one, every 7th an upper-cased exact copy), collects it in
shards of 20,000 rows and builds the `dedup-signatures` dataset in this process. Then each global half runs in a
fresh child process (`run_dedup` with the committed signatures, `memory_limit` as given, default 96MB: small, so the plateau shows at these sizes) and the
child reports its own peak RSS (`VmHWM`; `ru_maxrss` would include the parent's peak from before exec) and the size of
the scratch directory (DuckDB's database file and temp files) just before it is removed. Two peers run in the same kind of child:
one that only imports the stage and reads one parent file (the floor every run pays), and one that holds what
the global half held before it moved into DuckDB (every doc_id and hash as Python strings, the band keys as a
numpy matrix). The figures are the growth of the peak from the smallest corpus to the largest, and the extra MB
per million documents, for ours and for the in-memory peer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, os, shutil, sys, time
from pathlib import Path
import pyarrow.parquet as pq
import lifecycle.tasks.data.dedup.stage as d
from lifecycle.core.dataset import DatasetRef
parent, sigs, wd, limit, mode = sys.argv[1:6]
parent, sigs = DatasetRef.from_dir(Path(parent)), DatasetRef.from_dir(Path(sigs))
spilled = []
real = shutil.rmtree
def spy(path, *a, **k):  # the scratch directory's size just before dedup removes it
    spilled.append(sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()))
    return real(path, *a, **k)
d.shutil.rmtree = spy
t0 = time.perf_counter()
if mode == "floor":
    pq.read_table(parent.files()[0])
    rows = 0
elif mode == "in-memory":  # what the global half held before it moved into DuckDB: ids, hashes, band keys
    import numpy as np
    held = [[], [], []]
    for f in sigs.files():
        t = pq.read_table(f, columns=["doc_id", "exact_hash", "band_keys"])
        held[0] += t.column("doc_id").to_pylist()
        held[1] += t.column("exact_hash").to_pylist()
        held[2].append(t.column("band_keys").combine_chunks().flatten().to_numpy().reshape(t.num_rows, -1))
    held[2] = np.concatenate(held[2])
    rows = len(held[0])
else:
    rows = d.run_dedup(parent, d.DedupConfig(incremental=False), wd, signatures=sigs, memory_limit=limit).num_rows
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))  # this process's peak since exec
print(json.dumps({"peak_mb": int(hwm.split()[1]) / 1024, "kept": rows,
                  "spill_mb": (spilled[-1] / 2**20) if spilled else 0.0, "seconds": time.perf_counter() - t0}))
"""


def corpus(path: Path, n: int) -> None:
    import numpy as np

    rng = np.random.default_rng(1)
    words = np.array([f"w{i}" for i in range(3000)])
    texts: list[str] = []
    with open(path, "w") as f:
        for i in range(n):
            if i % 5 == 4:
                t = texts[int(rng.integers(0, i))].split()
                t[int(rng.integers(0, len(t)))] = "changed"
                text = " ".join(t)
            elif i % 7 == 6:
                text = texts[int(rng.integers(0, i))].upper()
            else:
                text = " ".join(rng.choice(words, 60))
            texts.append(text)
            f.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")


def child(parent, sigs, wd: str, limit: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(parent.dir), str(sigs.dir), wd, limit, mode],
                         check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(sizes: list[int], limit: str = "96MB") -> list[dict]:
    from lifecycle.core.shards import run_plan
    from lifecycle.tasks.data.collect.stage import CollectConfig, run_collect
    from lifecycle.tasks.data.dedup.stage import DedupConfig, plan_signatures

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            wd = str(Path(tmp) / f"w{n}")
            src = Path(tmp) / f"in{n}.jsonl"
            corpus(src, n)
            t0 = time.perf_counter()
            parent = run_collect(CollectConfig(inputs=[str(src)], rows_per_shard=20_000), wd)
            sigs = run_plan(plan_signatures(parent, DedupConfig(incremental=False), wd))
            prep = time.perf_counter() - t0
            floor = child(parent, sigs, wd, limit, "floor")
            held = child(parent, sigs, wd, limit, "in-memory")
            run = child(parent, sigs, wd, limit, "dedup")
            rows.append({"docs": n, "files": len(parent.files()), "prep_s": prep, "floor_mb": floor["peak_mb"],
                         "in_memory_mb": held["peak_mb"], **run})
            r = rows[-1]
            print(f"{n:>9,} docs in {r['files']:>3} files: global half peak RSS {r['peak_mb']:7.1f} MB "
                  f"(floor {r['floor_mb']:.1f} MB; holding ids, hashes and band keys in memory {r['in_memory_mb']:.1f} MB), "
                  f"scratch on disk {r['spill_mb']:.1f} MB, {r['kept']:,} kept, {r['seconds']:.1f} s", flush=True)
    a, b = rows[0], rows[-1]
    per_m = lambda key: (b[key] - a[key]) / ((b["docs"] - a["docs"]) / 1e6)  # noqa: E731
    print(f"corpus x{b['docs'] / a['docs']:.0f}: global half peak RSS x{b['peak_mb'] / a['peak_mb']:.2f} "
          f"(+{per_m('peak_mb'):.0f} MB per million docs); in-memory peer x{b['in_memory_mb'] / a['in_memory_mb']:.2f} "
          f"(+{per_m('in_memory_mb'):.0f} MB per million docs); DuckDB memory_limit {limit}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return rows


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--limit=")]
    limits = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--limit=")]
    main([int(a) for a in args] or [40_000, 160_000, 640_000, 1_280_000], *limits)
