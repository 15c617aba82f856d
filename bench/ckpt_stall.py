"""Training stall of an async checkpoint save versus a synchronous one, on the same model and run.

`python -m bench.ckpt_stall` (one process, DeepSpeed ZeRO-2 on the CPU, gloo with world size 1).
The stall of a save is the training time it costs: the time `save` blocks the training thread, plus,
for the async save, the slowdown of the steps that run while the background thread persists and commits
(their time above the median step time without a save). Goal: async <= 10 % of sync.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(n_layer: int = 6, n_embd: int = 384, steps_between: int = 12, rounds: int = 3) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    import deepspeed
    import torch
    import torch.distributed as dist

    from tasks import checkpoint as ckpt
    from tasks.async_ckpt import AsyncSaver
    from tasks.model import GPT
    from tasks.train import ModelConfig, TrainConfig
    from tasks.train_loop import ds_config, stub_muon

    stub_muon()
    torch.set_num_threads(1)  # the other core is the persist thread's (as with 2 ranks on 2 cores)
    deepspeed.init_distributed(dist_backend="gloo")
    mcfg = ModelConfig(vocab_size=4096, n_layer=n_layer, n_embd=n_embd, n_head=n_embd // 64, seq_len=128)
    cfg = TrainConfig(model=mcfg, micro_batch_size=4, num_ranks=1, zero_stage=2)
    torch.manual_seed(0)
    model = GPT(mcfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg))
    x = torch.randint(0, 4096, (4, 128))

    def step() -> float:
        t0 = time.perf_counter()
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    base = statistics.median(step() for _ in range(steps_between))
    out = {"params": model.num_params(), "base_step_s": base, "sync": [], "async": [], "async_blocking": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "sync"
        for r in range(rounds):
            t0 = time.perf_counter()
            tag = ckpt.save(engine, root, r + 1, {"step": r + 1}, mcfg, {})
            stall = time.perf_counter() - t0
            ckpt.prune(root, 1, keep=(tag,))
            out["sync"].append(stall)
            for _ in range(steps_between):
                step()
        size = sum(p.stat().st_size for p in tag.rglob("*") if p.is_file())
        saver = AsyncSaver(engine, Path(tmp) / "async", keep_last=1, log=lambda m: None)
        for r in range(rounds):
            t0 = time.perf_counter()
            saver.start(r + 1, {"step": r + 1}, mcfg, {})
            stall = time.perf_counter() - t0
            extra, n = 0.0, 0
            while saver.pending is not None or (saver.commit_job is not None and not saver.commit_job.done()):
                t1 = time.perf_counter()
                dt = step()
                saver.poll()
                extra += max(0.0, (time.perf_counter() - t1) - base)
                n += 1
                if n > 500:
                    raise RuntimeError("async save never finished")
            out["async"].append(stall + extra)
            out["async_blocking"].append(stall)
            assert ckpt.verify(Path(tmp) / "async" / ckpt.tag_name(r + 1)) is None
            for _ in range(steps_between):
                step()
        saver.finish()
        saver.close()
    sync, asyn = statistics.median(out["sync"]), statistics.median(out["async"])
    print(f"checkpoint stall, {out['params']:,}-parameter GPT, ZeRO-2, {size / 1e6:.0f} MB per checkpoint, "
          f"median of {rounds} saves (step time {base * 1e3:.0f} ms)")
    print(f"  sync save : {sync:.3f} s of training stalled")
    print(f"  async save: {asyn:.3f} s (blocking snapshot + slowdown of the steps that overlap the persist)")
    print(f"    of which blocking the training thread: {statistics.median(out['async_blocking']):.3f} s")
    print(f"  async/sync: {asyn / sync:.3f}  (goal <= 0.10)")
    dist.destroy_process_group()
    return {**out, "ratio": asyn / sync, "bytes": size}


if __name__ == "__main__":
    main()
