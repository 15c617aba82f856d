"""MFU and tokens/s of our DeepSpeed path on one GPU: a GPT-2-small-sized decoder (12 layers, width 768, seq 512,
85 M parameters with the tiny test vocabulary) for 60 bf16 ZeRO-2 steps through `run_train`, on the learnable
corpus of tests/train/test_train.py (repeated many times: this measures speed, not learning).

`python -m bench.gpu_mfu` on a host with a CUDA build of torch and DeepSpeed. Prints the medians of steps 21-60
(past warm-up) of the per-step metrics that training logs: step time, tokens/s, MFU (against the bf16 matmul
peak the rank measures on its GPU at start-up) and the loader's stall fraction, and the async save stalls.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "train")]


def main() -> dict:
    from bench.kill_resume import tokens
    from lifecycle.tasks.train.config import ModelConfig, TrainConfig
    from lifecycle.tasks.train.launch import run_train

    cfg = TrainConfig(model=ModelConfig(n_layer=12, n_head=12, n_embd=768, seq_len=512), max_steps=60,
                      optimizer={"decay_steps": 60, "warmup_steps": 5, "lr": 6e-4, "min_lr": 6e-5},
                      batch={"micro_batch_size": 16, "num_ranks": 1},
                      engine={"zero_stage": 2, "precision": "bf16", "accelerator": "cuda"},
                      checkpoint={"every": 30, "keep_last": 2}, logging={"every": 1, "eval_every": 0},
                      launch={"timeout_s": 300})
    with tempfile.TemporaryDirectory() as tmp:
        tok = tokens(str(Path(tmp) / "tok"))
        t0 = time.time()
        r = run_train(tok, cfg, str(Path(tmp) / "w"))
        rows = [row for row in map(json.loads, open(r.metrics_path)) if row["kind"] == "train"]
        stalls = re.findall(r"save stall ([\d.]+)s at step (\d+)", Path(r.log_path).read_text())
    late = rows[20:]
    out = {k: statistics.median(x[k] for x in late) for k in ("step_time", "tokens_per_s", "mfu", "stall_frac")}
    print(f"run_train {time.time() - t0:.1f}s; {rows[-1]['params']:,} parameters; "
          f"{rows[-1]['flops_per_token']:,} FLOPs per token")
    print(f"medians of steps 21-60: step {out['step_time'] * 1e3:.1f} ms, {out['tokens_per_s']:,.0f} tokens/s, "
          f"MFU {out['mfu']:.3f}, loader stall fraction {out['stall_frac']:.5f}")
    print("save stalls: " + ", ".join(f"{s}s at step {n}" for s, n in stalls))
    print("loss every 10 steps:", [round(x["loss"], 3) for x in rows[::10]])
    return out


if __name__ == "__main__":
    main()
