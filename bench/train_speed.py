"""Tokens/s of a plain PyTorch training loop versus our DeepSpeed path (ZeRO-0/1/2) on the CPU, same model.

`python -m bench.train_speed` (one process, world size 1, gloo; one torch thread each so the prefetch
thread has the other core, as with 2 ranks on 2 cores). The plain loop is what a user would write: torch
AdamW, gradient clipping, the same sampler called inline. Our path is the DeepSpeed engine with the
background prefetcher of lifecycle.tasks.train.loader, whose stall fraction (time the step waited for data / step time)
is printed too. Configurations run interleaved in rounds, and each figure is the median over rounds,
so load from other users of the machine hits them alike. Goal: ZeRO-0 >= 0.9x the plain loop.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from lifecycle.core.procs import free_port

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(steps: int = 20, rounds: int = 3) -> dict:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    import deepspeed
    import torch
    import torch.distributed as dist

    from tests.train.test_train import make_tokens

    from lifecycle.tasks.train.loader import Prefetcher
    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.data.tokenize.stage import token_shards
    from lifecycle.tasks.train.config import ModelConfig, TrainConfig
    from lifecycle.tasks.train.engine import ds_config, stub_muon
    from lifecycle.tasks.train.loader import get_batch

    stub_muon()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    with tempfile.TemporaryDirectory() as tmp:
        shards = token_shards(make_tokens(tmp, 1500))
        mcfg = ModelConfig(vocab_size=shards.vocab_size, n_layer=4, n_head=4, n_embd=128, seq_len=128)  # demo shape
        base = TrainConfig(model=mcfg, batch={"micro_batch_size": 16, "num_ranks": 1}, optimizer={"grad_clip": 1.0})
        tokens_per_step = base.batch.micro_batch_size * mcfg.seq_len

        def plain():
            torch.manual_seed(0)
            model = GPT(mcfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def run(n: int, start: int) -> tuple[float, float]:
                t0 = time.perf_counter()
                for s in range(start, start + n):
                    x, y = get_batch(shards, base, s, 0, 0)
                    _, loss = model(x, y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    loss.item()
                return time.perf_counter() - t0, 0.0
            return run

        def ours(stage: int):
            cfg = base.model_copy(update={"zero_stage": stage})
            torch.manual_seed(0)
            model = GPT(mcfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg))

            def run(n: int, start: int) -> tuple[float, float]:
                loader = Prefetcher(lambda k: get_batch(shards, cfg, k, 0, 0), range(start, start + n), 4)
                t0 = time.perf_counter()
                for s in range(start, start + n):
                    x, y = loader.get(s)
                    _, loss = engine(x, y)
                    engine.backward(loss)
                    engine.step()
                    loss.item()
                wall = time.perf_counter() - t0
                loader.close()
                return wall, loader.wait_s / wall
            return run

        runners = {"plain PyTorch": plain(), "ZeRO-0": ours(0), "ZeRO-1": ours(1), "ZeRO-2": ours(2)}
        for r in runners.values():
            r(3, 0)  # warm-up
        times = {k: [] for k in runners}
        stalls = {k: [] for k in runners}
        for rnd in range(rounds):
            for k, r in runners.items():
                wall, stall = r(steps, 1000 * (rnd + 1))
                times[k].append(steps * tokens_per_step / wall)
                stalls[k].append(stall)
    tps = {k: statistics.median(v) for k, v in times.items()}
    ref = tps["plain PyTorch"]
    print(f"training speed, {GPT(mcfg).num_params():,}-parameter GPT (demo shape), batch 16x128, 1 rank x 1 thread, "
          f"median of {rounds} rounds of {steps} steps")
    for k in runners:
        extra = "" if k.startswith("plain") else f"   stall fraction {statistics.median(stalls[k]):.4f}"
        print(f"  {k:<14} {tps[k]:>9,.0f} tokens/s   {tps[k] / ref:.3f}x plain{extra}")
    dist.destroy_process_group()
    return {"tokens_per_s": tps, "stall": {k: statistics.median(v) for k, v in stalls.items()}}


if __name__ == "__main__":
    main()
