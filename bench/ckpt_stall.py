"""Training stall of an async checkpoint save versus a synchronous one, on the same model and run.

`python -m bench.ckpt_stall` (one process, DeepSpeed ZeRO-2 on the CPU, gloo with world size 1).
The stall of a save is the training time it costs: the wall time of a window of `window` steps with
the save issued after its first step, minus the same window without a save (medians over interleaved
rounds). For the async save the window ends by waiting for the commit, so a persist that did not
overlap training counts as stall too. The time `save` blocks the training thread is printed beside it.
Goal: async <= 10 % of sync.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(n_layer: int = 6, n_embd: int = 384, window: int = 8, rounds: int = 5) -> dict:
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
    out = {"params": model.num_params(), "none": [], "sync": [], "async": [], "async_blocking": [], "sync_blocking": []}
    with tempfile.TemporaryDirectory() as tmp:
        plain_engine = engine.checkpoint_engine
        saver = AsyncSaver(engine, Path(tmp) / "async", keep_last=1, log=lambda m: None)  # installs its engine
        for r in range(rounds):
            for mode in ("none", "sync", "async"):  # interleaved, so load from other users hits all alike
                t0 = time.perf_counter()
                step()
                tb = time.perf_counter()
                engine.checkpoint_engine = saver.ds_engine if mode == "async" else plain_engine
                if mode == "sync":
                    tag = ckpt.save(engine, Path(tmp) / "sync", r + 1, {"step": r + 1}, mcfg, {})
                    ckpt.prune(Path(tmp) / "sync", 1, keep=(tag,))
                    out["sync_blocking"].append(time.perf_counter() - tb)
                elif mode == "async":
                    saver.start(r + 1, {"step": r + 1}, mcfg, {})
                    out["async_blocking"].append(time.perf_counter() - tb)
                for _ in range(window - 1):
                    step()
                    saver.poll()
                if mode == "async":
                    saver.finish()  # whatever did not overlap the window is stall too
                    assert ckpt.verify(Path(tmp) / "async" / ckpt.tag_name(r + 1)) is None
                out[mode].append(time.perf_counter() - t0)
        size = sum(p.stat().st_size for p in tag.rglob("*") if p.is_file())
        saver.close()
    none = statistics.median(out["none"])
    sync = statistics.median(out["sync"]) - none
    asyn = max(0.0, statistics.median(out["async"]) - none)
    base = none / window
    print(f"checkpoint stall, {out['params']:,}-parameter GPT, ZeRO-2, {size / 1e6:.0f} MB per checkpoint, "
          f"median of {rounds} rounds of {window}-step windows (step time {base * 1e3:.0f} ms)")
    print(f"  sync save : {sync:.3f} s of training stalled")
    print(f"    blocking the training thread: {statistics.median(out['sync_blocking']):.3f} s")
    print(f"  async save: {asyn:.3f} s of training stalled")
    print(f"    blocking the training thread: {statistics.median(out['async_blocking']):.3f} s (snapshot to host memory)")
    print(f"  async/sync: {asyn / sync:.3f} stalled, {statistics.median(out['async_blocking']) / statistics.median(out['sync_blocking']):.3f} blocking  (goal <= 0.10)")
    dist.destroy_process_group()
    return {**out, "ratio": asyn / sync, "bytes": size}


if __name__ == "__main__":
    main()
