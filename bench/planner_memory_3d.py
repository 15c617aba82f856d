"""The memory planner against measured peak memory of composed layouts on CPU ranks (issue 45).

    python -m bench.planner_memory_3d [--only tp2,tp2pp2] [--table]

As bench.planner_memory measures data-parallel layouts, this measures tensor, pipeline and tensor × pipeline
layouts: for each, N gloo ranks (one torch thread each, MALLOC_MMAP_THRESHOLD_=65536) build the model, the
`Parallelism` and the DeepSpeed engine through the trainer's own `engine.build_engine`, and run two optimizer
steps through `Parallelism.forward_backward` (the pipeline schedule for pp). Measured per rank: the resident
set's high-water mark during the steps minus the resident set before the model was built (bench.planner_memory's
method); the table shows the largest rank (the heaviest pipeline stage) beside `planner.memory(...)` for the same
layout (fp32, fused attention, device cpu: pages never written do not count). Goal: within ±15 %.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.planner_memory import MODEL, MiB, settle, status_bytes, warm_imports

# name: (ranks, parallel section, zero stage, micro-batch, grad_accum)
LAYOUTS = {
    "tp2": (2, {"tp": 2}, 1, 4, 1),
    "tp2-seq": (2, {"tp": 2, "tp_sequence_parallel": True}, 1, 4, 1),
    "pp2": (2, {"pp": 2}, 1, 4, 2),
    "tp2pp2": (4, {"tp": 2, "pp": 2}, 1, 4, 2),
    "tp2pp2-zero0": (4, {"tp": 2, "pp": 2}, 0, 4, 2),
}


def config(name: str):
    from lifecycle.tasks.train.config import ModelConfig, TrainConfig

    ranks, parallel, zero, micro, accum = LAYOUTS[name]
    return TrainConfig(model=ModelConfig(**MODEL), parallel=parallel,
                       batch={"micro_batch_size": micro, "grad_accum": accum, "num_ranks": ranks},
                       engine={"zero_stage": zero, "precision": "fp32", "compile": False})


def worker(name: str, steps: int) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment): one JSON line."""
    import deepspeed
    import torch

    from lifecycle.tasks.train.engine import build_engine, stub_muon
    from lifecycle.tasks.train.parallel.parallelism import Parallelism

    torch.set_num_threads(1)
    stub_muon()
    deepspeed.init_distributed(dist_backend="gloo")
    warm_imports()
    cfg, rank = config(name), int(os.environ["RANK"])
    base = settle()
    par = Parallelism(cfg, rank, torch.device("cpu"))
    with tempfile.TemporaryDirectory() as run_dir:
        built = build_engine(cfg, {}, par, rank, Path(run_dir), lambda *a, **k: None, time.time())
    settle()  # the training steps' own peak from here
    g = torch.Generator().manual_seed(rank)
    micro, seq = cfg.batch.micro_batch_size, MODEL["seq_len"]

    def batch(m: int):
        x = torch.randint(0, MODEL["vocab_size"], (micro, seq + 1), generator=g)
        return x[:, :-1], x[:, 1:]

    for _ in range(steps):
        par.begin_step(built.engine)
        par.forward_backward(built.engine, batch).get()
    peak = status_bytes("VmHWM")
    print(json.dumps({"layout": name, "rank": rank, "delta": peak - base}), flush=True)


def run_ranks(name: str, steps: int, timeout: float = 1800) -> list[dict]:
    from lifecycle.core.procs import free_port

    n = LAYOUTS[name][0]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(n), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, "-m", "bench.planner_memory_3d", "--worker", name, str(steps)]
    with tempfile.TemporaryDirectory() as logs:  # files, not pipes: a rank blocked on a full pipe stalls them all
        files = [(open(f"{logs}/{r}.out", "w+"), open(f"{logs}/{r}.err", "w+")) for r in range(n)]
        procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=o, stderr=e,
                                  text=True) for r, (o, e) in enumerate(files)]
        out = []
        for p, (o, e) in zip(procs, files):
            p.wait(timeout=timeout)
            o.seek(0), e.seek(0)
            if p.returncode:
                raise RuntimeError(f"a rank of {name} failed: {e.read()[-3000:]}")
            out += [json.loads(line) for line in o.read().splitlines() if line.startswith("{")]
            o.close(), e.close()
    return out


def predict(name: str) -> float:
    from lifecycle.tasks.train.parallel.mesh import Layout
    from lifecycle.tasks.train.planner import memory

    cfg = config(name)
    return memory(cfg.model, Layout.of(cfg), precision="fp32", micro_batches=cfg.batch.grad_accum,
                  device="cpu").total_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, metavar=("LAYOUT", "STEPS"), help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated layout names (default: all)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return 0
    from lifecycle.tasks.train.supervise import prebuild_shm_op

    prebuild_shm_op("cpu", {**os.environ, "DS_ACCELERATOR": "cpu"})
    rows = []
    for name in (args.only.split(",") if args.only else LAYOUTS):
        measured = max(r["delta"] for r in run_ranks(name, args.steps))
        predicted = predict(name)
        rows.append({"layout": name, "measured": measured, "predicted": predicted,
                     "error": predicted / measured - 1})
        print(json.dumps(rows[-1]), flush=True)
    if args.table:
        for r in rows:
            print(f"{r['layout']:14} measured {r['measured'] / MiB:8.1f} MiB  predicted {r['predicted'] / MiB:8.1f} MiB"
                  f"  {r['error']:+.1%}", file=sys.stderr)
    worst = max(abs(r["error"]) for r in rows)
    print(json.dumps({"summary": True, "layouts": len(rows), "worst_error": worst,
                      "within_15pct": sum(abs(r["error"]) <= 0.15 for r in rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
