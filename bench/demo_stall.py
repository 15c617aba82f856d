"""Data-loader stall fraction and MFU of the demo train config (deploy/configs/demo.yaml `train:`), 2 DeepSpeed
ranks on the CPU, on the tiny corpus of tests/train/test_train.py: `python -m bench.demo_stall`.

The stall fraction is the time the training step waited for its batch over the step time, from the
`stall_frac` of each metrics.jsonl record (weighted by the steps it covers). Goal: <= 1 %.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main(max_steps: int = 100) -> dict:
    from tests.train.test_train import make_tokens

    from lifecycle.tasks.train.config import TrainConfig

    from lifecycle.tasks.train.launch import run_train

    demo = yaml.safe_load((ROOT / "deploy" / "configs" / "demo.yaml").read_text())["train"]
    cfg = TrainConfig.model_validate({**demo, "max_steps": max_steps,
                                      "logging": {**demo.get("logging", {}), "every": 10},
                                      "launch": {**demo.get("launch", {}), "timeout_s": 1200}})
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
    main()
