"""The memory planner's prediction against the peak memory of real 2-rank CPU training runs.

`python -m bench.plan_validate` (about 3-4 minutes on 2 cores). For each layout (ZeRO 0/1/2/3, two
micro-batch sizes, one with full activation checkpointing) it starts 2 ranks (gloo, one torch thread each) that
build the project's model, torch AdamW and the DeepSpeed engine exactly as the trainer does
(`trainer.ds_config`, fp32) and run 2 optimizer steps on random tokens (no data loader, no checkpointing).

What is measured, per rank: the peak resident set size of the process (`ru_maxrss`, the kernel's high-water
mark) minus the resident set size right after the imports and `init_distributed`, before the model is built.
That is every byte training touched on top of the interpreter, torch and DeepSpeed: tensors, allocator slack,
gloo's buffers. Pages DeepSpeed reserves but never touches (its 5e8-element gradient bucket on a small model)
do not count, which is what the planner assumes (`min(Ψ, bucket)`). The table prints the larger of the two
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
    (0, 2, False), (0, 8, False), (1, 2, False), (1, 8, False), (2, 2, False), (2, 8, False),
    (3, 2, False), (3, 8, False), (2, 8, True),
]
MiB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(zero: int, micro: int, ckpt: bool, steps: int) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment): print a JSON line of its memory."""
    import resource

    import deepspeed
    import torch

    from lifecycle.tasks.train.config import ModelConfig, TrainConfig
    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.trainer import ds_config, stub_muon

    torch.set_num_threads(1)
    stub_muon()
    deepspeed.init_distributed(dist_backend="gloo")
    base = rss()
    cfg = TrainConfig(model=ModelConfig(**MODEL), batch={"micro_batch_size": micro, "grad_accum": 1, "num_ranks": 2},
                      engine={"zero_stage": zero, "activation_checkpointing": ckpt})
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    model.activation_checkpointing = ckpt
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg))
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    t0 = time.time()
    for _ in range(steps):
        x = torch.randint(0, MODEL["vocab_size"], (micro, MODEL["seq_len"] + 1), generator=g)
        _, loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"rank": int(os.environ["RANK"]), "base": base, "peak": peak, "delta": peak - base,
                      "params": model.num_params(), "step_s": (time.time() - t0) / steps}), flush=True)


def run_layout(zero: int, micro: int, ckpt: bool, steps: int) -> list[dict]:
    from lifecycle.core.procs import free_port

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.plan_validate", "--worker", str(zero), str(micro), str(int(ckpt)), str(steps)]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"rank failed (zero={zero} micro={micro}): {stderr[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def predict(zero: int, micro: int, ckpt: bool):
    from lifecycle.tasks.train.config import ModelConfig
    from lifecycle.tasks.train.planner import Layout, memory

    return memory(ModelConfig(**MODEL), Layout(dp=2, zero=zero, micro_batch=micro,
                                               recompute="full" if ckpt else "none"), precision="fp32")


def main(steps: int = 2) -> list[dict]:
    from lifecycle.tasks.train.supervise import prebuild_shm_op

    prebuild_shm_op("cpu", {**os.environ, "DS_ACCELERATOR": "cpu"})  # once, as the trainer's launcher does
    rows = []
    print(f"model {MODEL}, 2 ranks, fp32, {steps} steps; MiB per rank (measured: peak RSS - RSS after imports)")
    print(f"{'zero':>4} {'micro':>5} {'ckpt':>5} {'predicted':>9} {'states':>7} {'acts':>6} {'temp':>6} "
          f"{'measured':>8} {'error':>6}")
    for zero, micro, ckpt in LAYOUTS:
        est = predict(zero, micro, ckpt)
        ranks = run_layout(zero, micro, ckpt, steps)
        measured = max(r["delta"] for r in ranks)
        err = est.total_bytes / measured - 1
        rows.append({"zero": zero, "micro_batch": micro, "activation_checkpointing": ckpt,
                     "predicted_bytes": est.total_bytes, "measured_bytes": measured, "error": err,
                     "ranks": ranks, **{k: v for k, v in est.as_dict().items() if k.endswith("_bytes")}})
        print(f"{zero:>4} {micro:>5} {str(ckpt):>5} {est.total_bytes / MiB:>9.1f} {est.model_states_bytes / MiB:>7.1f} "
              f"{est.activation_bytes / MiB:>6.1f} {est.temp_bytes / MiB:>6.1f} {measured / MiB:>8.1f} {err:>+6.1%}",
              flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.1%} (goal: within 15%); {sum(abs(r['error']) <= 0.15 for r in rows)} of {len(rows)} within")
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=4, type=int, metavar=("ZERO", "MICRO", "CKPT", "STEPS"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", help="also write the rows to this file")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1], bool(a.worker[2]), a.worker[3])
    else:
        result = main(a.steps)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
