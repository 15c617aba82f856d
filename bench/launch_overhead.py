"""Train-stage launch overhead on the CPU demo: from the stage's start (`run_train` called) to the end of the first
optimizer step, and where the time goes; optionally against older code (`--before REF`) in the same run.

`python -m bench.launch_overhead [--workdir runs/demo] [--repeat 2] [--before REF]`

Needs a work dir with a committed tokenize dataset (`lifecycle run deploy/configs/demo.yaml --until tokenize`).
Each round calls `run_train` on it with the demo's train config (2 DeepSpeed CPU ranks, ZeRO-2, fp32) and
`max_steps=1`, a new seed each round so each is a fresh launch (its run directory in a temporary work dir). The
supervisor writes `launch-timing.json` and every rank `launch-timing-rank<r>.json` (tasks/train/launch.py,
tasks/train/trainer.py); phases are reported from rank 0 except the first step, which ends when the slowest rank
ends it. DeepSpeed's CPU shm op must be built already (the first launch on a machine builds it: 1-2 min, not
counted here; the "op build check" phase is the check that finds it built). The peak FLOPS probe runs once per
machine and thread count (its result is kept in ~/.cache/lifecycle/peak-flops.json), so it counts in the first
round on a fresh machine only. Goal: <= 10 s with the op built.

`--before REF`: each round runs twice in a new process, first with `REF`'s code (`git archive`, laid out as the
installed package and put first on PYTHONPATH, which the ranks inherit; the same environment otherwise), then
with this checkout's, so both see the same load; the table gives both medians and after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PHASES = [  # (label, what it measures)
    ("supervisor setup", "token shard metadata, run fingerprint, launch config (stage start -> op check)"),
    ("op build check", "shm op already built? (stale-lock check under the build lock)"),
    ("supervisor launch prep", "memory tier, port ownership, heartbeats, launcher command"),
    ("rank process start", "supervisor starts the rank processes, until their exec (before branch launch24: "
                           "DeepSpeed's launch.py interpreter, which imports torch and DeepSpeed, until rank 0 exists)"),
    ("rank interpreter start", "rank process created -> trainer module starts (python, runpy, parent watch)"),
    ("imports", "torch, numpy and the project's train modules"),
    ("import deepspeed", "deepspeed (and its accelerator detection)"),
    ("process group init", "deepspeed.init_distributed over gloo, without the op load"),
    ("op load", "loading the built shm op (DeepSpeed's JIT loader: ninja check + dlopen)"),
    ("engine build", "model init, AdamW, deepspeed.initialize (ZeRO-2 partitioning)"),
    ("peak FLOPS probe", "0.3 s matmul probe for MFU, every launch, none with logging.peak_flops_per_rank"),
    ("checkpointer and restore", "checkpointer, restore check (nothing to restore here)"),
    ("data loader start", "prefetch thread started"),
    ("first batch", "waiting for the first micro-batch"),
    ("first step", "forward, backward, optimizer step, loss all-reduce (slowest rank)"),
]


def breakdown(run_dir: Path, world: int) -> dict[str, float]:
    sup = json.loads((run_dir / "launch-timing.json").read_text())
    ranks = [json.loads((run_dir / f"launch-timing-rank{r}.json").read_text()) for r in range(world)]
    r0 = ranks[0]
    t = dict(r0["phases"])
    op = r0["op_load"][1] - r0["op_load"][0] if len(r0["op_load"]) == 2 else 0.0
    first_step_end = max(dict(r["phases"])["first step"] for r in ranks)
    # ranks started directly: the supervisor's clock after their exec; else the rank's create time (psutil, from
    # clock ticks since a boot time in whole seconds: up to 1 s off, fine against a launcher's seconds)
    created = sup.get("ranks_started", r0["process_created"])
    out = {
        "supervisor setup": sup["supervisor_setup"] - sup["stage_start"],
        "op build check": sup["op_build_check"] - sup["supervisor_setup"],
        "supervisor launch prep": sup["launcher_popen"] - sup["op_build_check"],
        "rank process start": created - sup["launcher_popen"],
        "rank interpreter start": t["interpreter ready"] - created,
        "imports": t["imports"] - t["interpreter ready"],
        "import deepspeed": t["import deepspeed"] - t["imports"],
        "process group init": t["process group init"] - t["import deepspeed"] - op,
        "op load": op,
        "engine build": t["engine build"] - t["process group init"],
        "peak FLOPS probe": t["peak FLOPS probe"] - t["engine build"],
        "checkpointer and restore": t["checkpointer and restore"] - t["peak FLOPS probe"],
        "data loader start": t["data loader start"] - t["checkpointer and restore"],
        "first batch": t["first batch"] - t["data loader start"],
        "first step": first_step_end - t["first batch"],
    }
    out["total"] = first_step_end - sup["stage_start"]
    return out


def one_round(workdir: str, seed: int, overrides: list[str]) -> dict[str, float]:
    """One fresh launch with `max_steps=1` in a temporary work dir: its breakdown."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LIFECYCLE_TIMELINE"] = "1"  # the ranks write their launch timeline (tasks/train/timeline.py)
    from lifecycle.config import load_config, parse_override, set_dotted
    from lifecycle.core.dataset import DatasetRef
    from lifecycle.tasks.train.config import TrainConfig
    from lifecycle.tasks.train.launch import run_train

    manifests = sorted(Path(workdir).glob("datasets/tokenize/*/_manifest.json"), key=lambda p: p.stat().st_mtime)
    if not manifests:
        raise SystemExit(f"{workdir}: no committed tokenize dataset (lifecycle run deploy/configs/demo.yaml "
                         "--until tokenize)")
    m = json.loads(manifests[-1].read_text())
    tokens = DatasetRef(stage="tokenize", path=str(manifests[-1].parent.resolve()), fingerprint=m["fingerprint"],
                        sha256=m["sha256"], num_rows=m["num_rows"])
    base = load_config(ROOT / "deploy/configs/demo.yaml").train.model_dump(mode="json")
    # stall_s: the final save after step 1 sends no heartbeat; on a loaded machine it can outlast the default 60 s
    for item in ["max_steps=1", "optimizer.warmup_steps=0", "logging.eval_every=0", "launch.stall_s=900", *overrides]:
        set_dotted(base, *parse_override(item))
    with tempfile.TemporaryDirectory(prefix="launch-overhead-") as tmp:
        cfg = TrainConfig.model_validate({**base, "seed": seed})
        result = run_train(tokens, cfg, tmp)
        return breakdown(Path(result.run_dir), cfg.batch.num_ranks)


def subprocess_round(workdir: str, seed: int, overrides: list[str], pythonpath: Path | None, cwd: Path) -> dict[str, float]:
    """One round in a new process, with `pythonpath` (an older `lifecycle`) first on PYTHONPATH. It runs in `cwd`,
    not in this checkout: `python -m` puts its working directory first on sys.path, and the checkout's `lifecycle/`
    folder would shadow the older package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*([str(pythonpath)] if pythonpath else []), str(ROOT),
                                         *filter(None, [env.get("PYTHONPATH")])])
    argv = [sys.executable, "-m", "bench.launch_overhead", "--workdir", str(Path(workdir).resolve()),
            "--round-seed", str(seed)]
    done = subprocess.run([*argv, *(f"--set={o}" for o in overrides)], env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"round failed ({'before' if pythonpath else 'after'}):\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    lines = done.stdout.strip().splitlines()
    where = next(line[6:] for line in lines if line.startswith("code: "))
    assert where.startswith(str(pythonpath if pythonpath is not None else ROOT)), (pythonpath, where)
    return json.loads(lines[-1])


def median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r.get(k, 0.0) for r in rounds) for k in rounds[0]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="runs/demo", help="work dir holding a committed tokenize dataset")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="train config override (e.g. logging.peak_flops_per_rank=1e11)")
    ap.add_argument("--before", default=None, metavar="REF",
                    help="git ref of older code to measure in the same run, alternating rounds (e.g. main)")
    ap.add_argument("--round-seed", type=int, default=None, help=argparse.SUPPRESS)  # one round, JSON out
    args = ap.parse_args(argv)
    if args.round_seed is not None:
        import lifecycle.tasks.train.launch as code

        print(f"code: {code.__file__}")
        print(json.dumps(one_round(args.workdir, args.round_seed, args.set)))
        return {}
    out: dict = {"workdir": args.workdir, "overrides": args.set, "load_before": os.getloadavg()}
    if args.before is None:
        rounds = []
        for i in range(args.repeat):
            rounds.append(one_round(args.workdir, 1000 + i, args.set))
            print(f"round {i + 1}: stage start -> first step {rounds[-1]['total']:.1f} s", flush=True)
        med = out["median"] = median_of(rounds)
        out["rounds"] = rounds
        print(f"\nlaunch overhead, median of {len(rounds)} (seconds; phases of rank 0, first step of the slowest rank)")
        for name, what in PHASES:
            print(f"  {name:<26} {med[name]:>6.2f}   {what}")
        print(f"  {'total':<26} {med['total']:>6.2f}   goal <= 10 s with the op built")
    else:
        from bench.audit_latency import checkout

        commit = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        sides: dict[str, list] = {"before": [], "after": []}
        with tempfile.TemporaryDirectory(prefix="launch-overhead-before-") as tmp:
            old = checkout(args.before, Path(tmp))
            for i in range(args.repeat):
                for side in sides:
                    sides[side].append(subprocess_round(args.workdir, 1000 + i, args.set,
                                                        old if side == "before" else None, Path(tmp)))
                    print(f"round {i + 1} {side}: stage start -> first step {sides[side][-1]['total']:.1f} s", flush=True)
        med = {side: median_of(r) for side, r in sides.items()}
        out.update({"before": f"{args.before} ({commit})", "rounds": sides, "median": med,
                    "ratio_total": med["after"]["total"] / med["before"]["total"]})
        print(f"\nlaunch overhead, median of {args.repeat} rounds each, before = {args.before} ({commit}), after = this "
              "checkout (seconds; phases of rank 0, first step of the slowest rank)")
        print(f"  {'phase':<26} {'before':>7} {'after':>7}")
        for name, _ in PHASES:
            print(f"  {name:<26} {med['before'].get(name, 0.0):>7.2f} {med['after'].get(name, 0.0):>7.2f}")
        print(f"  {'total':<26} {med['before']['total']:>7.2f} {med['after']['total']:>7.2f}   after/before "
              f"{out['ratio_total']:.3f}; goal <= 10 s with the op built")
    out["load_after"] = os.getloadavg()
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    if str(ROOT) not in sys.path:  # appended: a --before round's older package on PYTHONPATH must come first
        sys.path.append(str(ROOT))
    main()
