"""Disk bytes per epoch of the image loader's cache against the page cache, under a memory cap (issue 48):
`python -m bench.image_cache [--cap-mb 128] [--ratio 2] [--epochs 4] [--item-kb 64] [--json PATH]` (as root).

A data set of `ratio` x the cap (random bytes in 16 shard files, items of `item_kb`, read with `pread` at their
offsets as `tasks.clip.loader.Pairs.read` reads JPEGs) is walked for `epochs` random epochs, one permutation per
epoch (the loader's `step_rows`), by a child process inside a memory cgroup capped at `cap_mb` (cgroup v1's
memory.limit_in_bytes, or v2's memory.max), the page cache included: the kernel charges the pages a process reads
to its cgroup and reclaims them at the cap. Two arms, the caches dropped before each:
- `page_cache`: plain reads; what the kernel keeps is all the caching there is;
- `no_evict`: the loader's `NoEvictCache` (CoorDL's policy) in the process, sized to the cap less the process's
  resident set at start and a 16 MiB margin, in front of the same reads.
Measured per epoch: bytes the child read from the block device (`read_bytes` of /proc/self/io), and the cache's
hits. Epoch 1 fills either cache; the later epochs are the steady state the figure reports (their mean).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from lifecycle.tasks.clip.cache import NoEvictCache

SHARDS = 16
MiB = 2**20


def places(items: int, size: int) -> list[tuple[str, int]]:
    """[(shard, offset)] of each item: `items` items of `size` bytes over SHARDS shard files, in order."""
    per = -(-items // SHARDS)
    return [(f"shard-{i // per:02d}.bin", (i % per) * size) for i in range(items)]


def make_dataset(root: Path, items: int, size: int) -> None:
    """The shard files of `places`, random bytes."""
    for name in dict.fromkeys(shard for shard, _ in places(items, size)):
        n = sum(1 for shard, _ in places(items, size) if shard == name)
        (root / name).write_bytes(os.urandom(n * size))


def device_reads() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes line")


def resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def walk(arm: str, root: Path, items: int, size: int, epochs: int, capacity: int, seed: int = 0) -> dict:
    """The child: `epochs` random epochs over the data set, through a no-evict cache of `capacity` bytes (arm
    `no_evict`) or none; bytes read from the device and hits per epoch."""
    where = places(items, size)
    fds = {name: os.open(root / name, os.O_RDONLY) for name in {w[0] for w in where}}
    cache = NoEvictCache(capacity if arm == "no_evict" else 0)
    out = []
    for epoch in range(epochs):
        before, hits = device_reads(), cache.hits
        for i in np.random.default_rng([seed, epoch]).permutation(items):
            name, offset = where[i]
            cache.get(str(i), lambda name=name, offset=offset: os.pread(fds[name], size, offset))
        out.append({"epoch": epoch + 1, "device_read_bytes": device_reads() - before, "hits": cache.hits - hits})
    return {"arm": arm, "capacity_bytes": cache.capacity, "epochs": out}


def cgroup(cap: int) -> tuple[Path, str]:
    """A fresh memory cgroup capped at `cap` bytes: (its directory, the file to write a pid into)."""
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    if (v1 / "memory.limit_in_bytes").exists():
        d = v1 / f"lifecycle-bench-{os.getpid()}"
        d.mkdir()
        (d / "memory.limit_in_bytes").write_text(str(cap))
    elif "memory" in (v2 / "cgroup.controllers").read_text() if (v2 / "cgroup.controllers").exists() else False:
        d = v2 / f"lifecycle-bench-{os.getpid()}"
        d.mkdir()
        (d / "memory.max").write_text(str(cap))
    else:
        raise SystemExit("bench.image_cache: no cgroup memory controller here (/sys/fs/cgroup/memory or a v2 "
                         "memory.max); it needs one, and root")
    return d, str(d / "cgroup.procs")


def run_arm(arm: str, root: Path, a: argparse.Namespace, items: int, size: int) -> dict:
    Path("/proc/sys/vm/drop_caches").write_text("3\n")  # (after a sync) both arms start from a cold page cache
    cap = a.cap_mb * MiB
    d, procs = cgroup(cap)
    try:
        cmd = [sys.executable, "-m", "bench.image_cache", "--child", arm, "--root", str(root), "--items", str(items),
               "--item-kb", str(a.item_kb), "--epochs", str(a.epochs), "--cap-mb", str(a.cap_mb)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              preexec_fn=lambda: Path(procs).write_text(str(os.getpid())))
        if done.returncode:
            raise RuntimeError(f"{arm} failed (exit {done.returncode}): {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        d.rmdir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap-mb", type=int, default=128)
    ap.add_argument("--ratio", type=float, default=2.0, help="data set size / memory cap")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--item-kb", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--items", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    size = a.item_kb * 1024
    if a.child:
        capacity = max(0, a.cap_mb * MiB - resident() - 16 * MiB)  # what the cap leaves beside this process
        print(json.dumps(walk(a.child, Path(a.root), a.items, size, a.epochs, capacity)))
        return
    items = int(a.ratio * a.cap_mb * MiB) // size
    with tempfile.TemporaryDirectory(dir=os.environ.get("LIFECYCLE_BENCH_DIR", "/var/tmp")) as tmp:
        make_dataset(Path(tmp), items, size)
        os.sync()
        rows = [run_arm(arm, Path(tmp), a, items, size) for arm in ("page_cache", "no_evict")]
    data = items * size
    print(f"data set {data / MiB:.0f} MiB ({items} items of {a.item_kb} KiB), cap {a.cap_mb} MiB, {a.epochs} epochs")
    for r in rows:
        steady = [e["device_read_bytes"] for e in r["epochs"][1:]]
        r["steady_read_fraction"] = sum(steady) / len(steady) / data
        per = ", ".join(f"{e['device_read_bytes'] / MiB:.0f}" for e in r["epochs"])
        print(f"{r['arm']:10} cache {r['capacity_bytes'] / MiB:5.0f} MiB  MiB read per epoch: {per}  "
              f"steady state: {r['steady_read_fraction']:.2f} of the data set per epoch")
    ratio = rows[1]["steady_read_fraction"] / rows[0]["steady_read_fraction"]
    print(f"no_evict / page_cache, disk bytes per epoch (steady state): {ratio:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"cap_mb": a.cap_mb, "items": items, "item_bytes": size, "rows": rows,
                                            "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
