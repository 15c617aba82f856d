"""Exact-substring dedup with suffix arrays (tasks/data/dedup/substring.py): MB/s and peak memory per input byte at
several corpus sizes, against one in-memory suffix array over the whole text (the textbook approach).

    python -m bench.suffix_dedup [--sizes 4,16,64,160] [--shard-mb 64] [--min-length 100] [--shards-at 64]
                                 [--plots docs/img] [--cache /tmp/real-corpus]

Corpus: bench/real_corpus.py's real text (man pages, package docs, pydoc, Python source; it holds real repeated
spans: licences, boilerplate, generated pages), built once under `--cache` (mb<largest>-seed0) and read from its
start until each size is reached, so a smaller corpus is a prefix of a larger one.

Each measurement runs in a fresh Python process (so its peak memory is its own), which streams the documents in
(100 at a time, no list of all texts is kept) and then:
Times: wall seconds (`*_s`) and CPU seconds of the process (`cpu_*_s`, user + system; on a shared machine the
wall clock waits for a core, the CPU time does not), for reading the documents in, building the index (ours:
sort every shard and merge; peer: sort, LCP, mark) and the cut ranges; `mb_per_s` over the whole, `mb_per_cpu_s`
likewise in CPU time, `mb_per_cpu_s_index` without the reading.
- `ours`: `SuffixDedup` as the dedup stage runs it: text to a scratch file, one libdivsufsort array per shard of
  `--shard-mb` written straight into a memory-mapped file, one k-way merge of all shards marking repeated windows,
  then every document's cut ranges;
- `in_memory` (the peer): the whole text as one bytes object, `pydivsufsort.divsufsort` (one int32 array in
  memory), `pydivsufsort.kasai` (its LCP array, int32), then the same marking rule as one numba pass over adjacent
  suffixes, and the same cut ranges. Both must mark the same windows (checked: `same_marks`).
`--shards-at MB` also runs ours at that size with 1, 4, 16 and 64 shards: the merge's time against k.

Memory: `peak_rss_mb` is the process's high-water RSS (VmHWM: anonymous and file-backed pages, so the
memory-mapped text and suffix array count when resident) minus its RSS before the first document
(`baseline_rss_mb`: interpreter, numpy, pyarrow, numba); `bytes_per_input_byte` is that over the input bytes.
`peak_anon_mb` is the largest anonymous RSS sampled every 20 ms (memory the kernel cannot drop or write back to
the scratch files), minus the baseline's. One JSON line per measurement, then one summary line; with `--plots`,
`suffix_dedup_time.png` (seconds against MB, both methods) in that folder.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numba
import numpy as np

from lifecycle.tasks.data.dedup.substring import window_in_one_doc


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _documents(corpus: Path, limit: int):
    """Texts of the corpus in file order until `limit` bytes of UTF-8 are reached (the last one cut short)."""
    total = 0
    for path in sorted(corpus.glob("part-*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                n = len(text.encode())
                if total + n > limit:
                    text = text.encode()[: limit - total].decode(errors="ignore")
                    n = len(text.encode())
                if n:
                    yield text
                total += n
                if total >= limit:
                    return
    if total < limit:
        raise SystemExit(f"{corpus}: only {total} bytes of text, {limit} asked")


def _batches(corpus: Path, limit: int, size: int = 100):
    batch: list[str] = []
    for t in _documents(corpus, limit):
        batch.append(t)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def measure(method: str, corpus: Path, mb: float, shard_mb: float, min_length: int) -> dict:
    """One measurement, in this process (call it in a fresh one)."""
    import pyarrow as pa

    from lifecycle.tasks.data.dedup import substring as sub

    scratch = tempfile.mkdtemp(prefix="suffix-bench-", dir=os.environ.get("TMPDIR", "/tmp"))
    _warm(scratch)
    base = _status()
    peak_anon = [base["RssAnon"]]
    done = threading.Event()

    def sample():
        while not done.wait(0.02):
            peak_anon[0] = max(peak_anon[0], _status()["RssAnon"])

    threading.Thread(target=sample, daemon=True).start()
    limit = int(mb * 1e6)
    cfg = sub.SubstringConfig(enabled=True, min_length=min_length, shard_bytes=int(shard_mb * 2**20))
    t0, c0 = time.perf_counter(), _cpu()
    lengths = []
    if method == "ours":
        index = sub.SuffixDedup(Path(scratch) / "ours", cfg)
        for batch in _batches(corpus, limit):
            index.add(pa.array(batch))
            lengths += [len(t.encode()) for t in batch]
        t_read, c_read = time.perf_counter(), _cpu()
        index.build()
        t_build, c_build = time.perf_counter(), _cpu()
        cuts = index.cuts(np.array(lengths))
        marks, shards, size = index.marks, len(index.shards), index.size
    else:
        import pydivsufsort

        parts = []
        for batch in _batches(corpus, limit):
            for t in batch:
                b = t.encode()
                parts += [b, b"\xff"]
                lengths.append(len(b))
        text = b"".join(parts)
        del parts
        t_read, c_read = time.perf_counter(), _cpu()
        sa = pydivsufsort.divsufsort(text)
        lcp = pydivsufsort.kasai(text, sa)
        arr = np.frombuffer(text, np.uint8)
        marks = np.zeros((len(text) + 7) // 8, np.uint8)
        mark_adjacent(arr, sa, lcp, min_length, marks)
        t_build, c_build = time.perf_counter(), _cpu()
        index = sub.SuffixDedup(Path(scratch) / "peer", cfg)  # only its `cuts`, over these marks
        index._out.close()
        index.size, index.marks, shards, size = len(text), marks, 1, len(text)
        cuts = index.cuts(np.array(lengths))
    t_end, c_end = time.perf_counter(), _cpu()
    done.set()
    end = _status()
    import hashlib
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)
    return {"bench": "suffix_dedup", "method": method, "mb": mb, "input_bytes": size, "documents": len(lengths),
            "shards": shards, "shard_mb": shard_mb if method == "ours" else None, "min_length": min_length,
            "read_s": round(t_read - t0, 2), "build_s": round(t_build - t_read, 2), "cuts_s": round(t_end - t_build, 2),
            "total_s": round(t_end - t0, 2), "mb_per_s": round(size / 1e6 / (t_end - t0), 2),
            "cpu_read_s": round(c_read - c0, 2), "cpu_build_s": round(c_build - c_read, 2),
            "cpu_cuts_s": round(c_end - c_build, 2), "cpu_total_s": round(c_end - c0, 2),
            "mb_per_cpu_s": round(size / 1e6 / (c_end - c0), 2),
            "mb_per_cpu_s_index": round(size / 1e6 / (c_end - c_read), 2),
            "baseline_rss_mb": round(base["VmRSS"] / 2**20, 1),
            "peak_rss_mb": round((end["VmHWM"] - base["VmRSS"]) / 2**20, 1),
            "bytes_per_input_byte": round((end["VmHWM"] - base["VmRSS"]) / size, 2),
            "peak_anon_mb": round((peak_anon[0] - base["RssAnon"]) / 2**20, 1),
            "anon_bytes_per_input_byte": round((peak_anon[0] - base["RssAnon"]) / size, 2),
            "bytes_cut": int(sum(e - s for c in cuts for s, e in c)),
            "marks_sha256": hashlib.sha256(marks.tobytes()).hexdigest()[:16],
            "load": os.getloadavg()[0]}


@numba.njit(cache=True)
def mark_adjacent(text, sa, lcp, length, marks):
    """The peer's marking, the rule of `merge_marks` over one suffix array and its LCP array
    (pydivsufsort.kasai: lcp[i] is the LCP of the suffixes sa[i] and sa[i + 1])."""
    n = len(sa)
    first = 0
    valid = checked = False
    for r in range(n):
        p = sa[r]
        if r and lcp[r - 1] >= length:
            if not checked:
                checked = True
                valid = window_in_one_doc(text, p, length)
            if valid:
                if p < first:
                    marks[first >> 3] |= np.uint8(1) << np.uint8(first & 7)
                    first = p
                else:
                    marks[p >> 3] |= np.uint8(1) << np.uint8(p & 7)
        else:
            first = p
            checked = valid = False


def _warm(scratch: str) -> None:
    """Both numba kernels compiled (or loaded from numba's cache) before any clock starts."""
    import pyarrow as pa
    import pydivsufsort

    from lifecycle.tasks.data.dedup import substring as sub

    cfg = sub.SubstringConfig(enabled=True, min_length=8, shard_bytes=16)
    index = sub.SuffixDedup(Path(scratch) / "warm", cfg)
    index.add(pa.array(["warm up text one", "warm up text two"]))
    index.build()
    index.cuts(np.array([16, 16]))
    text = b"warm up text\xffwarm up text\xff"
    sa = pydivsufsort.divsufsort(text)
    mark_adjacent(np.frombuffer(text, np.uint8), sa, pydivsufsort.kasai(text, sa), 8, np.zeros(8, np.uint8))


def run_one(method: str, corpus: Path, mb: float, shard_mb: float, min_length: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.suffix_dedup", "--one", method, "--corpus", str(corpus),
                          "--sizes", str(mb), "--shard-mb", str(shard_mb), "--min-length", str(min_length)],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{method} at {mb} MB failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(points: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for method, label in (("ours", "sharded suffix arrays + k-way merge (ours)"),
                          ("in_memory", "one in-memory suffix array + LCP (peer)")):
        pts = sorted((p["mb"], p["cpu_total_s"]) for p in points if p["method"] == method and p.get("sweep") is None)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=label)
    ax.set_xlabel("corpus size (MB of text)")
    ax.set_ylabel("CPU seconds (read, index, cuts)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "suffix_dedup_time.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.suffix_dedup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4,16,64,160", help="corpus sizes in MB of text (default 4,16,64,160)")
    ap.add_argument("--shard-mb", type=float, default=64, help="ours: MiB of text per shard (default 64, the config's)")
    ap.add_argument("--min-length", type=int, default=100, help="bytes (default 100, the config's)")
    ap.add_argument("--shards-at", type=float, default=None, help="also run ours at this size with 1, 4, 16, 64 shards")
    ap.add_argument("--no-peer", action="store_true", help="ours only")
    ap.add_argument("--plots", type=Path, default=None, help="folder for suffix_dedup_time.png")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/real-corpus"), help="where corpora are built and reused")
    ap.add_argument("--corpus", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one", choices=["ours", "in_memory"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [float(x) for x in args.sizes.split(",")]
    if args.one:
        print(json.dumps(measure(args.one, args.corpus, sizes[0], args.shard_mb, args.min_length)), flush=True)
        return
    from bench.real_pipeline import corpus

    directory, _ = corpus(args.cache, max(sizes + ([args.shards_at] if args.shards_at else [])))
    points = []
    for mb in sizes:
        for method in ("ours",) + (() if args.no_peer else ("in_memory",)):
            p = run_one(method, directory, mb, args.shard_mb, args.min_length)
            points.append(p)
            print(json.dumps(p), flush=True)
    if args.shards_at:
        for k in (1, 4, 16, 64):
            p = run_one("ours", directory, args.shards_at, args.shards_at * 1e6 / 2**20 / k * 1.001, args.min_length)
            p["sweep"] = k
            points.append(p)
            print(json.dumps(p), flush=True)
    summary = {"bench": "suffix_dedup_summary", "min_length": args.min_length, "shard_mb": args.shard_mb,
               "sizes_mb": sizes, "same_marks": all(
                   len({p["marks_sha256"] for p in points if p["mb"] == mb and p.get("sweep") is None}) == 1
                   for mb in sizes)}
    if args.shards_at:
        summary["index_cpu_s_vs_shards"] = {p["shards"]: p["cpu_build_s"] for p in points if p.get("sweep")}
    if args.plots:
        summary["plot"] = str(plot(points, args.plots))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
