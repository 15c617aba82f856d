"""Data-loader stall fraction and MFU of the demo train config (deploy/configs/demo.yaml `train:`), 2 DeepSpeed
ranks on the CPU, on the tiny corpus of tests/train/test_train.py: `python -m bench.demo_stall`.

`python -m bench.demo_stall --compile` instead times the demo's whole train stage (its 200 steps, `run_train`'s wall
time: launch, compile and saves included) eager and with `train.engine.compile: true`, the compiled one twice: first
with an empty inductor cache (a new machine's first run), then with the cache that run left (every later run).
That is what `train.engine.compile: auto` (off on the CPU) is chosen from.

The stall fraction is the time the training step waited for its batch over the step time, from the
`stall_frac` of each metrics.jsonl record (weighted by the steps it covers). Goal: <= 1 %.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def demo_config(max_steps: int, **engine):
    from lifecycle.tasks.train.config import TrainConfig

    demo = yaml.safe_load((ROOT / "deploy" / "configs" / "demo.yaml").read_text())["train"]
    return TrainConfig.model_validate({**demo, "max_steps": max_steps,
                                       "engine": {**demo.get("engine", {}), **engine},
                                       "logging": {**demo.get("logging", {}), "every": 10},
                                       "launch": {**demo.get("launch", {}), "timeout_s": 1200}})


def compile_compare(max_steps: int = 200) -> dict:
    """Wall time of the demo's train stage, eager against compiled (cold and warm inductor cache)."""
    from tests.train.test_train import make_tokens

    from lifecycle.tasks.train.launch import run_train

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokens = make_tokens(tmp, 3000)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # the ranks inherit it: empty at first
        for name, compiled in (("eager", False), ("compiled, cold cache", True), ("compiled, warm cache", True)):
            t0 = time.time()
            r = run_train(tokens, demo_config(max_steps, compile=compiled), str(Path(tmp) / name.replace(" ", "_")))
            wall = time.time() - t0
            recs = [x for x in map(json.loads, open(r.metrics_path)) if x["kind"] == "train" and x["step"] > 10]
            out[name] = {"wall_s": wall, "tokens_per_s": statistics.median(x["tokens_per_s"] for x in recs)}
            print(f"  {name:22} train stage {wall:6.1f} s, {out[name]['tokens_per_s']:9,.0f} tokens/s after step 10",
                  flush=True)
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
    e = out["eager"]["wall_s"]
    print(f"compiled / eager wall time: cold {out['compiled, cold cache']['wall_s'] / e:.2f}, "
          f"warm {out['compiled, warm cache']['wall_s'] / e:.2f}")
    return out


def main(max_steps: int = 100) -> dict:
    from tests.train.test_train import make_tokens

    from lifecycle.tasks.train.launch import run_train

    cfg = demo_config(max_steps)
    with tempfile.TemporaryDirectory() as tmp:
        r = run_train(make_tokens(tmp, 3000), cfg, tmp)
        recs = [x for x in map(json.loads, open(r.metrics_path)) if x["kind"] == "train" and x["step"] > 1]
    steps = [b["step"] - a["step"] for a, b in zip(recs, recs[1:])]
    pairs = list(zip(steps, recs[1:]))
    stall = sum(n * x["stall_frac"] * x["step_time"] for n, x in pairs) / sum(n * x["step_time"] for n, x in pairs)
    mfu = sum(n * x["mfu"] for n, x in pairs) / sum(steps)
    tps = sum(n * x["tokens_per_s"] for n, x in pairs) / sum(steps)
    print(f"demo train config, {max_steps} steps, {cfg.batch.num_ranks} ranks, ZeRO-{cfg.engine.zero_stage}, "
          f"{r.model_params:,} matmul parameters, {r.flops_per_token:,} FLOPs/token")
    print(f"  stall fraction {stall:.4f} (goal <= 0.01)   MFU {mfu:.3f} (vs a measured fp32 matmul peak per rank)   "
          f"{tps:,.0f} tokens/s")
    return {"stall_frac": stall, "mfu": mfu, "tokens_per_s": tps}


if __name__ == "__main__":
    import sys

    compile_compare() if "--compile" in sys.argv[1:] else main()
