"""Expert parallelism against one rank holding every expert: `python -m bench.moe_agreement [--zero 0 1 2]
[--steps 20] [--top-k 2] [--capacity-factor 1.0] [--grad-clip 1.0]`.

For each ZeRO stage, two real `run_train` launches on the same tiny corpus (tests/train/test_train.py's) from the
same seed: ep=2 on 2 gloo CPU ranks (micro-batch 8 each) and 1 rank with all 4 experts (micro-batch 8, 2
accumulated micro-batches: the same 16 sequences per step, the same per-micro-batch token groups for the
router's capacity). Prints one JSON line per stage: the max relative difference of the logged LM losses over
the steps, the wall time of each launch, routes dropped by each, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zero", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity-factor", type=float, default=1.0)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="train.optimizer.grad_clip (0: no clipping)")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from lifecycle.tasks.train.launch import run_train
    from tests.train.test_parallel_moe import moe_cfg
    from tests.train.test_train import make_tokens

    with tempfile.TemporaryDirectory() as tmp:
        tokens = make_tokens(Path(tmp) / "tokens", 600)
        for zero in args.zero:
            over = {"engine": {"zero_stage": zero}, "max_steps": args.steps, "optimizer": {"grad_clip": args.grad_clip},
                    "moe": {"top_k": args.top_k, "capacity_factor": args.capacity_factor}}
            out = {"zero_stage": zero, "steps": args.steps, "top_k": args.top_k, "grad_clip": args.grad_clip,
                   "capacity_factor": args.capacity_factor}
            losses = {}
            for name, ranks in (("ep2", 2), ("one_rank", 1)):
                t0 = time.perf_counter()
                r = run_train(tokens, moe_cfg(ranks, ranks, **over), str(Path(tmp) / f"z{zero}-{name}"))
                out[f"{name}_wall_s"] = round(time.perf_counter() - t0, 1)
                recs = [json.loads(x) for x in open(r.metrics_path)]
                train = [x for x in recs if x["kind"] == "train"]
                losses[name] = [x["loss"] for x in train]
                out[f"{name}_dropped_routes"] = sum(x["moe_dropped"] for x in train)
            a, b = losses["one_rank"], losses["ep2"]
            out["max_rel_loss_diff"] = max(abs(x - y) / abs(x) for x, y in zip(a, b))
            out["first_last_loss"] = [b[0], b[-1]]
            out["loadavg_1m"] = os.getloadavg()[0]
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
