"""Training stall of an async checkpoint save versus a synchronous one, on the same model and run.

`python -m bench.ckpt_stall [rounds]` (default 15 rounds; one process, DeepSpeed ZeRO-2 on the CPU, gloo with world size 1).
On a GPU host, `python -m bench.ckpt_stall 8 --accelerator cuda --precision bf16 --n-layer 12 --n-embd 768 --window 60
--batch 8` measures the same on one GPU (NCCL, world size 1), with a model whose save is worth hiding.
The stall of a save is the extra wall time it costs training: the wall time of a window of `window`
training steps with the save issued after its first step, minus the wall time of a window of the same
steps without a save, in the same round. Rounds interleave none/sync/async windows, so load from other
users of the machine hits all three alike; each figure is the median over rounds of the per-round
difference, printed with its quartiles (on a shared machine the spread is the honest error bar). For the
async save the window ends by waiting for the commit, so a persist that did not finish within the window
counts as stall too; the window ends there, at the commit (the bench's own check that the committed files match
their marker, a re-hash of every file, runs after the window's clock stops: it is not part of the save, and the
sync window has no such check). The time `save` blocks the training thread is printed beside it, and the stall
split into the extra time inside the training steps (the save's background work slowing them) and outside them
(staging, polls, the final wait); and the load average before and after the run (other work on the machine is
the main source of noise).
Goal: async <= 10 % of sync.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from lifecycle.core.procs import free_port


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (its /proc stat; the process is alive, not a waited child)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(n_layer: int = 6, n_embd: int = 384, window: int = 12, rounds: int = 15, batch: int = 2,
         accelerator: str = "cpu", precision: str = "fp32") -> dict:

    os.environ["DS_ACCELERATOR"] = accelerator  # before deepspeed is imported

    load_before = os.getloadavg()

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    import deepspeed
    import torch
    import torch.distributed as dist

    from lifecycle.tasks.train import commit as ckpt
    from lifecycle.tasks.train.async_saver import AsyncSaver
    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.config import ModelConfig, TrainConfig
    from lifecycle.tasks.train.distributed import select_device
    from lifecycle.tasks.train.engine import ds_config, stub_muon

    stub_muon()
    mcfg = ModelConfig(vocab_size=4096, n_layer=n_layer, n_embd=n_embd, n_head=n_embd // 64, seq_len=128)
    cfg = TrainConfig(model=mcfg, batch={"micro_batch_size": batch, "num_ranks": 1},
                      engine={"zero_stage": 2, "accelerator": accelerator, "precision": precision})
    device, backend = select_device(cfg)
    wait_device = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the other core is the persist thread's (as with 2 ranks on 2 cores)
    deepspeed.init_distributed(dist_backend=backend)
    torch.manual_seed(0)
    model = GPT(mcfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg))
    x = torch.randint(0, 4096, (batch, 128), device=device)

    in_steps = [0.0]  # wall time inside step() during the current window

    def step() -> float:
        t0 = time.perf_counter()
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        wait_device()  # a GPU step is done when its kernels are
        in_steps[0] += time.perf_counter() - t0
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    out = {"params": model.num_params(), "none": [], "sync": [], "async": [], "async_blocking": [], "sync_blocking": [],
           "async_finish_wait": [], "persist_cpu": [], "none_steps": [], "sync_steps": [], "async_steps": []}
    with tempfile.TemporaryDirectory() as tmp:
        plain_engine = engine.checkpoint_engine
        saver = AsyncSaver(engine, Path(tmp) / "async", keep_last=1, log=lambda m: None)  # installs its engine
        saver.start(0, {"step": 0}, mcfg, {})  # warm-up, not measured: starts the persist process, sizes its arena
        saver.finish()
        for r in range(rounds):
            for mode in ("none", "sync", "async"):  # interleaved, so load from other users hits all alike
                in_steps[0] = 0.0
                t0 = time.perf_counter()
                step()
                tb = time.perf_counter()
                engine.checkpoint_engine = saver.ds_engine if mode == "async" else plain_engine
                if mode == "sync":
                    tag = ckpt.save(engine, Path(tmp) / "sync", r + 1, {"step": r + 1}, mcfg, {})
                    ckpt.prune(Path(tmp) / "sync", 1, keep=(tag,))
                    out["sync_blocking"].append(time.perf_counter() - tb)
                elif mode == "async":
                    cpu0 = _cpu_seconds(saver.writer.proc.pid)
                    saver.start(r + 1, {"step": r + 1}, mcfg, {})
                    out["async_blocking"].append(time.perf_counter() - tb)
                for _ in range(window - 1):
                    step()
                    saver.poll()
                if mode == "async":
                    tf = time.perf_counter()
                    saver.finish()  # whatever did not overlap the window is stall too
                    out["async_finish_wait"].append(time.perf_counter() - tf)
                    out["persist_cpu"].append(_cpu_seconds(saver.writer.proc.pid) - cpu0)
                out[mode].append(time.perf_counter() - t0)  # the window ends at the commit
                out[f"{mode}_steps"].append(in_steps[0])
                if mode == "async":  # the bench's check, outside the window: a re-hash of all files from disk
                    assert ckpt.verify(Path(tmp) / "async" / ckpt.tag_name(r + 1)) is None
        size = sum(p.stat().st_size for p in tag.rglob("*") if p.is_file())
        saver.close()

    def quartiles(mode: str) -> list[float]:
        return statistics.quantiles([m - n for m, n in zip(out[mode], out["none"])], n=4)

    (s25, sync, s75), (a25, asyn, a75) = quartiles("sync"), quartiles("async")
    blocking = {m: statistics.median(out[f"{m}_blocking"]) for m in ("sync", "async")}
    base = statistics.median(out["none"]) / window
    print(f"checkpoint stall, {out['params']:,}-parameter GPT, ZeRO-2, {accelerator}, {precision}, "
          f"{size / 1e6:.0f} MB per checkpoint, "
          f"{rounds} rounds of {window}-step windows (median step time {base * 1e3:.0f} ms); load average "
          f"{' '.join(f'{x:.2f}' for x in load_before)} before, {' '.join(f'{x:.2f}' for x in os.getloadavg())} after")
    print(f"  sync save : {sync:.3f} s of training stalled (quartiles {s25:.3f} .. {s75:.3f})")
    print(f"    blocking the training thread: {blocking['sync']:.3f} s")
    print(f"  async save: {asyn:.3f} s of training stalled (quartiles {a25:.3f} .. {a75:.3f})")
    print(f"    blocking the training thread: {blocking['async']:.3f} s (staging into shared memory); "
          f"waiting at the window's end for the persist and commit: {statistics.median(out['async_finish_wait']):.3f} s")
    print(f"    persist process CPU time per save (user + system): {statistics.median(out['persist_cpu']):.3f} s")
    for mode in ("sync", "async"):
        inside = [m - n for m, n in zip(out[f"{mode}_steps"], out["none_steps"])]
        outside = [(m - ms) - (n - ns) for m, ms, n, ns in
                   zip(out[mode], out[f"{mode}_steps"], out["none"], out["none_steps"])]
        print(f"    {mode} stall split (medians of per-round differences): inside the training steps "
              f"{statistics.median(inside):+.3f} s (quartiles {' .. '.join(f'{q:+.3f}' for q in statistics.quantiles(inside, n=4)[::2])}), "
              f"outside them {statistics.median(outside):+.3f} s")
    print(f"  async/sync: {asyn / sync:.3f} stalled, {blocking['async'] / blocking['sync']:.3f} blocking  (goal <= 0.10)")
    dist.destroy_process_group()
    return {**out, "ratio": asyn / sync, "blocking_ratio": blocking["async"] / blocking["sync"], "bytes": size}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.ckpt_stall", description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", type=int, nargs="?", default=15)
    ap.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--window", type=int, default=12)
    ap.add_argument("--batch", type=int, default=2)
    a = ap.parse_args()
    main(a.n_layer, a.n_embd, a.window, a.rounds, a.batch, a.accelerator, a.precision)
