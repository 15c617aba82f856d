"""Activation memory and step time of one forward+backward with and without activation checkpointing.

`python -m bench.activation_memory` (one process, one torch thread, fp32, CPU). Memory is the peak that
torch's own tracker (`torch.distributed._tools.mem_tracker.MemTracker`) attributes to activations and in
total, counted over live tensor storages, so allocator caching and other processes do not blur it. Time is
the median of `rounds` interleaved forward+backward passes. Same model, same batch, same run.
"""

from __future__ import annotations

import statistics
import time


def main(n_layer: int = 6, n_embd: int = 256, seq_len: int = 256, batch: int = 8, rounds: int = 3) -> dict:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.config import ModelConfig

    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=4096, n_layer=n_layer, n_embd=n_embd, n_head=n_embd // 64, seq_len=seq_len)
    idx = torch.randint(0, 4096, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = GPT(cfg)

    def fwd_bwd() -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        return time.perf_counter() - t0

    out: dict = {}
    for on in (False, True):
        model.activation_checkpointing = on
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            fwd_bwd()
        peak = {str(k).rsplit(".", 1)[-1]: v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
        out[on] = {"act": peak["ACT"], "total": peak["Total"], "times": []}
    for _ in range(rounds):
        for on in (False, True):
            model.activation_checkpointing = on
            out[on]["times"].append(fwd_bwd())
    off, on = out[False], out[True]
    t_off, t_on = statistics.median(off["times"]), statistics.median(on["times"])
    mib = 2**20
    print(f"activation checkpointing, {model.num_params():,}-parameter GPT ({n_layer} blocks), batch {batch}x{seq_len}, fp32, "
          f"one forward+backward")
    print(f"  peak activation memory: {off['act'] / mib:.1f} MiB without, {on['act'] / mib:.1f} MiB with "
          f"({on['act'] / off['act']:.2f}x)")
    print(f"  peak total memory     : {off['total'] / mib:.1f} MiB without, {on['total'] / mib:.1f} MiB with "
          f"({on['total'] / off['total']:.2f}x)")
    print(f"  forward+backward time : {t_on / t_off:.2f}x (median of {rounds})")
    return {"act_ratio": on["act"] / off["act"], "total_ratio": on["total"] / off["total"], "time_ratio": t_on / t_off}


if __name__ == "__main__":
    main()
