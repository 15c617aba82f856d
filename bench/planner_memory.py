"""The memory planner's prediction against the peak memory of real 2-rank CPU training runs.

`python -m bench.planner_memory` (a few minutes on 2 idle cores). Prints one JSON line per layout (predicted,
measured, error and the prediction's parts, bytes) and a summary line; `--table` adds a readable table on stderr. For each layout (ZeRO 0/1/2/3, two
micro-batch sizes, one with full activation checkpointing) it starts 2 ranks (gloo, one torch thread each) that
build the project's model, torch AdamW and the DeepSpeed engine as the trainer does
(`engine.ds_config`, fp32) and run 2 optimizer steps on random tokens (no data loader, no checkpointing).

What is measured, per rank and layout: the kernel's high-water mark of the resident set (VmHWM, reset with
`/proc/self/clear_refs`) during the training steps, minus the resident set before the model was built (after the
previous layout's objects are freed and `malloc_trim` has handed free heap pages back), so the imports, torch
and DeepSpeed are not counted and every byte the layout holds is: tensors, allocator slack, gloo's buffers.
The lazy imports are made before the baseline too (`warm_imports`: torch AdamW's first construction imports
torch._dynamo, 71 MiB, which had counted in every layout).
glibc is told to map every allocation above 64 KiB on its own (MALLOC_MMAP_THRESHOLD_=65536), so a freed
tensor's pages leave the resident set at once instead of staying in the heap. `init` is the same high-water
mark during `deepspeed.initialize` (its one-time flattening and partitioning copies), not what the planner
predicts (the steady state of training), shown beside it. Pages DeepSpeed reserves but never touches (its 5e8-element gradient bucket on a small model)
do not count, which is what the planner assumes with `device="cpu"` (`min(Ψ, bucket)`). The table prints the larger of the two
ranks (they agree within a few MiB) next to `planner.memory(...)` for the same layout, precision fp32,
fused attention (SDPA).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODEL = dict(vocab_size=4096, n_layer=4, n_embd=512, n_head=8, seq_len=256)
LAYOUTS = [  # (zero, micro_batch, activation checkpointing)
    (0, 1, False), (0, 4, False), (1, 1, False), (1, 4, False), (2, 1, False), (2, 4, False),
    (3, 1, False), (3, 4, False), (2, 4, True),
]
MiB = 2**20


def status_bytes(field: str) -> int:
    """VmRSS or VmHWM (the high-water mark) of this process, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def settle() -> int:
    """Free what the last layout left, hand free heap pages back to the kernel, reset the high-water mark
    (`echo 5 > /proc/self/clear_refs`), and return the resident set size now: the baseline of the next layout."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def warm_imports() -> None:
    """Import before the baseline what the first layout would otherwise import inside its measurement: the first
    `torch.optim.AdamW(...)` of a process imports torch._dynamo and sympy (hundreds of modules, +71 MiB resident
    on torch 2.13), the same for every layout and no part of any (the baseline is meant to hold the imports)."""
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p])
    p.grad = torch.zeros(1)
    opt.step()


def worker(steps: int, index: int) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment) of layout LAYOUTS[index]: one JSON line.
    One layout per process: a second layout in the same process starts from a baseline that still holds pages
    the first one frees later (DeepSpeed's engine is collected late), which made the deltas meaningless."""
    import deepspeed
    import torch

    from lifecycle.tasks.train.config import ModelConfig, TrainConfig
    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.engine import ds_config, stub_muon

    torch.set_num_threads(1)
    stub_muon()
    deepspeed.init_distributed(dist_backend="gloo")
    warm_imports()
    for zero, micro, ckpt in LAYOUTS[index:index + 1]:
        base = settle()
        cfg = TrainConfig(model=ModelConfig(**MODEL), batch={"micro_batch_size": micro, "grad_accum": 1, "num_ranks": 2},
                          engine={"zero_stage": zero, "activation_checkpointing": ckpt})
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.model)
        model.activation_checkpointing = ckpt
        n_params = model.num_params()
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-3)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg))
        init_peak = status_bytes("VmHWM")  # DeepSpeed's set-up copies (flattening, partitioning) included
        settle()  # reset the high-water mark: what follows is the training steps' own peak
        shmem_base = status_bytes("RssShmem")
        g = torch.Generator().manual_seed(int(os.environ["RANK"]))
        t0 = time.time()
        phases = {}  # the last step's resident set and high-water mark after each phase, minus the baseline
        for _ in range(steps):
            x = torch.randint(0, MODEL["vocab_size"], (micro, MODEL["seq_len"] + 1), generator=g)
            _, loss = engine(x[:, :-1], x[:, 1:])
            phases["forward"] = (status_bytes("VmRSS") - base, status_bytes("VmHWM") - base)
            engine.backward(loss)
            phases["backward"] = (status_bytes("VmRSS") - base, status_bytes("VmHWM") - base)
            engine.step()
            phases["step"] = (status_bytes("VmRSS") - base, status_bytes("VmHWM") - base)
        shmem = status_bytes("RssShmem") - shmem_base  # DeepSpeed's shm all-reduce buffers (own and the peers')
        peak = status_bytes("VmHWM")
        print(json.dumps({"zero": zero, "micro": micro, "ckpt": ckpt, "rank": int(os.environ["RANK"]), "base": base,
                          "peak": peak, "delta": peak - base, "init_delta": init_peak - base, "params": n_params,
                          "phases": {k: {"rss": r, "hwm": h} for k, (r, h) in phases.items()}, "shmem_delta": shmem,
                          "step_s": (time.time() - t0) / steps}), flush=True)
        engine.destroy() if hasattr(engine, "destroy") else None
        del engine, model, opt, decay, no_decay, loss, x


def run_pair(module: str, args: list[str], env: dict | None = None, timeout: float = 3000) -> list[dict]:
    """Start 2 CPU ranks of `python -m <module> --worker <args>` (gloo on a free port, one torch thread each) and
    return the JSON lines they print; `env` adds to their environment."""
    from lifecycle.core.procs import free_port

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", module, "--worker", *args]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        if p.returncode:
            raise RuntimeError(f"a rank failed: {stderr[-3000:]}")
        out += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return out


def run_ranks(steps: int, index: int) -> list[dict]:
    # every tensor its own mapping: freed pages leave the RSS at once
    return run_pair("bench.planner_memory", [str(steps), str(index)], {"MALLOC_MMAP_THRESHOLD_": "65536"})


def predict(zero: int, micro: int, ckpt: bool):
    from lifecycle.tasks.train.config import ModelConfig
    from lifecycle.tasks.train.planner import Layout, memory

    return memory(ModelConfig(**MODEL), Layout(dp=2, zero=zero, micro_batch=micro,
                                               recompute="full" if ckpt else "none"), precision="fp32",
                  device="cpu")  # the resident set: reserved pages never written do not count


def main(steps: int = 2, table: bool = False, only: list[int] | None = None) -> list[dict]:
    from lifecycle.tasks.train.supervise import prebuild_shm_op

    prebuild_shm_op("cpu", {**os.environ, "DS_ACCELERATOR": "cpu"})  # once, as the trainer's launcher does
    rows = []
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if table else (lambda text: None)
    say(f"model {MODEL}, 2 ranks, fp32, {steps} steps; MiB per rank (measured: the steps' peak RSS - RSS before "
        "the model was built; init: the same during deepspeed.initialize)")
    say(f"{'zero':>4} {'micro':>5} {'ckpt':>5} {'predicted':>9} {'states':>7} {'acts':>6} {'temp':>6} "
        f"{'measured':>8} {'error':>6} {'init':>6}")
    for i, (zero, micro, ckpt) in enumerate(LAYOUTS):
        if only is not None and i not in only:
            continue
        est = predict(zero, micro, ckpt)
        ranks = run_ranks(steps, i)
        peak = max(r["delta"] for r in ranks)
        init = max(r["init_delta"] for r in ranks)
        err = est.total_bytes / peak - 1
        row = {"zero": zero, "micro_batch": micro, "activation_checkpointing": ckpt,
               "predicted_bytes": est.total_bytes, "measured_bytes": peak, "error": round(err, 4),
               "init_bytes": init, "baseline_bytes": max(r["base"] for r in ranks),
               **{k: v for k, v in est.as_dict().items() if k.endswith("_bytes")},
               "ranks": [{k: r[k] for k in ("rank", "base", "peak", "delta", "step_s", "phases", "shmem_delta")} for r in ranks]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        say(f"{zero:>4} {micro:>5} {str(ckpt):>5} {est.total_bytes / MiB:>9.1f} {est.model_states_bytes / MiB:>7.1f} "
            f"{est.activation_bytes / MiB:>6.1f} {est.temp_bytes / MiB:>6.1f} {peak / MiB:>8.1f} {err:>+6.1%} "
            f"{init / MiB:>6.1f}")
    worst = max(abs(r["error"]) for r in rows)
    within = sum(abs(r["error"]) <= 0.15 for r in rows)
    print(json.dumps({"summary": True, "layouts": len(rows), "within_15pct": within, "worst_error": worst,
                      "model": MODEL, "steps": steps, "load_average": os.getloadavg()}), flush=True)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", type=int, nargs=2, metavar=("STEPS", "LAYOUT"), help="(internal) run as one rank")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", help="comma-separated indices into LAYOUTS (default: all)")
    ap.add_argument("--table", action="store_true", help="also print a readable table on stderr")
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
    else:
        main(a.steps, a.table, [int(i) for i in a.only.split(",")] if a.only else None)
