"""SIGKILL a 2-rank DeepSpeed ZeRO-2 training run at random moments, resume it, and count the resumes whose loss
curve and final weights are bitwise-identical to an uninterrupted run.

`python -m bench.kill_resume [KILLS] [--accelerator cpu|cuda] [--ranks N] [--precision fp32|bf16] [--compile ...]` (default 10
kills, 2 CPU ranks, fp32; each trial is two launches, about a minute on 2 cores). On a GPU host,
`--accelerator cuda --ranks 1` runs the same trials on one GPU with NCCL.
Every third trial waits for a checkpoint being written (a tag directory without its commit marker) and
kills inside the save; the others kill after a uniform random delay into training. The kill takes the
supervisor (`run_train`) and both ranks down at once with SIGKILL; the rerun
is the same `run_train` call, which resumes from the last committed checkpoint.

The harness lives in tests/faults.py, which tests/train/test_faults.py runs too.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.faults import config, kill_and_resume, tokens  # noqa: E402,F401  (config, tokens: for bench.gpu_mfu)


def main(kills: int = 10, seed: int = 0, accelerator: str = "cpu", ranks: int = 2, precision: str = "fp32",
         compile: bool | str = "auto") -> dict:
    return kill_and_resume(kills, seed, accelerator, ranks, precision, compile=compile)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.kill_resume", description=__doc__.split("\n\n")[0])
    ap.add_argument("kills", type=int, nargs="?", default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--compile", choices=["auto", "true", "false"], default="auto",
                    help="train.engine.compile of every run (auto: on for cuda, off on the CPU)")
    a = ap.parse_args()
    main(a.kills, a.seed, a.accelerator, a.ranks, a.precision, {"true": True, "false": False}.get(a.compile, "auto"))
