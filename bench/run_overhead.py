"""Fixed overhead of `lifecycle run`: from the command to its first stage, and from its last stage to the exit.

`python -m bench.run_overhead [--repeat 3] [--docs 200] [--python PY] [--modes embedded,servers,...]`

Each round runs `lifecycle run deploy/configs/demo.yaml --until scrub --json` as a new process (interpreter start
included) on a small corpus: `--docs` documents of the bundled Python documentation, a different slice each round,
so every stage computes (a user's hourly run on new data) while the work dir, its servers and its MLflow store are
reused. Two modes, each in a work dir of its own:
- `embedded`: no `lifecycle up`; the run's own Prefect server (round 1 starts it and creates the work dir's
  stores: reported apart as `cold`; the later rounds are the steady state). Round 1 also leaves the embedded
  server's warm runner, which the bench lets get ready (untimed) before round 2; every later round must say
  `launch: warm`;
- `embedded-no-runner`: the same with `LIFECYCLE_EMBEDDED_RUNNER=0` (every round imports everything itself: the
  peer of `embedded`, and the code before the embedded runner);
- `servers`: `lifecycle up` first (its start is not counted), then the same rounds; `lifecycle down` after. The
  command is the `lifecycle` console script, as users start it, so `up`'s warm runner (lifecycle/launch.py) forks
  each run from a process that imported everything once; every round but the first must say `launch: warm`;
- `servers-no-runner`: the same with `lifecycle up --no-runner`: each run imports Prefect and MLflow itself (the
  peer the runner is measured against, in the same bench run).

The run's `timing` (flows/runner.py RunSummary) says where the time went; the exit is taken here, when the process
has ended. Medians over the warm rounds. `--python` runs another checkout's interpreter (the code before a change:
its `timing` lacks some points, and the breakdown shows what it can). The last line is one JSON object.
Goals (issue 25): before + after <= 3 s against `lifecycle up` servers, <= 8 s with the embedded default.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = sorted((ROOT / "corpus" / "python-docs").glob("*.jsonl.gz"))
GOALS = {"servers": 3.0, "embedded": 8.0, "servers-no-runner": 3.0, "embedded-no-runner": 8.0}

BEFORE = [  # (label, from, to): from the process's spawn to the first stage
    ("interpreter + cli import", "spawn", "command_start"),
    ("config, lock, inputs, log capture", "command_start", "prefect_start"),
    ("Prefect server: found, or launched", "prefect_start", "prefect_launched"),
    ("imports (Prefect, MLflow, flow)", "prefect_launched", "imports_done"),
    ("waiting for the Prefect server", "imports_done", "prefect_ready"),
    ("Prefect temporary server start", "prefect_start", "prefect_ready"),  # the code before issue 25: no overlap
    ("imports (Prefect, MLflow, flow) ", "prefect_ready", "flow_call"),  # ditto (~0 s after: done above)
    ("flow run creation (Prefect engine)", "flow_call", "flow_start"),
    ("MLflow store open + parent run", "flow_start", "tracker_ready"),
    ("to the first stage (resolve inputs)", "tracker_ready", "first_stage_start"),
]
OLD_ONLY = {"Prefect temporary server start", "imports (Prefect, MLflow, flow) "}  # shown when prefect_launched is absent
AFTER = [  # from the last stage's end to the exit
    ("shard cluster shutdown (in the background: part of the tail)", "dask_close_start", "dask_closed"),
    ("flow tail (ledger, charts, MLflow end, the shutdown)", "last_stage_end", "flow_end"),
    ("flow return -> exit (Prefect, atexit)", "flow_end", "exit"),
]
INSIDE = [("shard workers start (in the first sharded stage)", "dask_start", "dask_ready")]


def make_inputs(d: Path, rounds: int, docs: int) -> list[Path]:
    """One JSONL file per round, each a different slice of the bundled corpus."""
    records = []
    for path in CORPUS:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            records += [json.loads(line) for line in f]
    if len(records) < rounds * docs:
        raise SystemExit(f"--docs {docs} x {rounds} rounds needs {rounds * docs} documents; the corpus has {len(records)}")
    out = []
    for r in range(rounds):
        p = d / f"round-{r}.jsonl"
        p.write_text("".join(json.dumps(x) + "\n" for x in records[r * docs:(r + 1) * docs]))
        out.append(p)
    return out


def lifecycle(py: str, cwd: Path, *args: str, check: bool = True, env: dict | None = None
              ) -> subprocess.CompletedProcess:
    script = Path(py).with_name("lifecycle")  # the console script, as users start it (the warm runner's client)
    proc = subprocess.run([str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    if check and proc.returncode != 0:
        raise SystemExit(f"lifecycle {' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def one_run(py: str, cwd: Path, workdir: Path, src: Path, env: dict | None = None) -> dict:
    args = ["run", str(ROOT / "deploy/configs/demo.yaml"), "--until", "scrub", "--json", "--set", f"workdir={workdir}",
            "--set", f"collect.inputs=[\"{src}\"]"]
    spawn = time.time()
    proc = lifecycle(py, cwd, *args, env=env)
    exit_ = time.time()
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    t = {k: v for k, v in summary.get("timing", {}).items() if not k.startswith("stage:")}
    t.update(spawn=spawn, exit=exit_)
    if "first_stage_start" not in t:
        raise SystemExit(f"the run's summary has no timing (is {py} a checkout with issue 25's timing?): {summary}")
    out = {"before_s": t["first_stage_start"] - spawn, "after_s": exit_ - t["last_stage_end"],
           "wall_s": exit_ - spawn, "orchestration": summary.get("orchestration"), "launch": summary.get("launch"),
           "stages": {k[6:]: v for k, v in summary["timing"].items() if k.startswith("stage:")}}
    out["overhead_s"] = out["before_s"] + out["after_s"]
    for label, a, b in BEFORE + AFTER + INSIDE:
        if label in OLD_ONLY and "prefect_launched" in t:
            continue
        if a in t and b in t:
            out[label] = t[b] - t[a]
    return out


def median_of(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], float)]
    return {k: round(statistics.median(r[k] for r in runs if k in r), 3) for k in keys}


def mode_rounds(mode: str, py: str, cwd: Path, base: Path, inputs: list[Path]) -> dict:
    wd = base / f"wd-{mode}"
    if mode.startswith("servers"):
        from lifecycle.core.procs import free_port

        lifecycle(py, cwd, "up", "--set", f"workdir={wd}", "--prefect-port", str(free_port()), "--mlflow-port",
                  str(free_port()), "--json", *(["--no-runner"] if mode == "servers-no-runner" else []))
    env = {**os.environ, "LIFECYCLE_EMBEDDED_RUNNER": "0"} if mode == "embedded-no-runner" else None
    try:
        runs = [one_run(py, cwd, wd, inputs[0], env)]
        if mode == "embedded":  # untimed: the warm runner round 1 left as it exited gets ready (a user's next run
            from lifecycle.flows.startup.embedded_runner import wait_embedded_runner  # comes an hour later)

            wait_embedded_runner(wd)
        runs += [one_run(py, cwd, wd, src, env) for src in inputs[1:]]
    finally:
        lifecycle(py, cwd, "down", "--set", f"workdir={wd}", check=False)  # also the embedded server, if any
    modes = {r["orchestration"] for r in runs}
    if modes != {mode.removesuffix("-no-runner")}:
        raise SystemExit(f"mode {mode}: the runs said orchestration {modes}")
    launches = [r["launch"] for r in runs[1:]]
    if mode in ("servers", "embedded") and set(launches) != {"warm"}:
        raise SystemExit(f"mode {mode}: the warm rounds said launch {launches} (is the runner up?)")
    return {"cold": runs[0], "warm": median_of(runs[1:]) if len(runs) > 1 else None, "rounds": len(runs)}


def print_mode(mode: str, res: dict) -> None:
    print(f"\n== {mode}: {res['rounds']} rounds (round 1 cold: new work dir, stores created"
          + (", server started" if mode.startswith("embedded") else "") + ")")
    rows = [("command -> first stage", "before_s"), ("last stage -> exit", "after_s"), ("sum (goal <= "
            f"{GOALS[mode]:.0f} s)", "overhead_s"), ("wall", "wall_s")]
    print(f"  {'':44} {'cold':>8} {'warm':>8}")
    warm = res["warm"] or {}
    for label, k in rows:
        print(f"  {label:44} {res['cold'][k]:8.2f} {warm.get(k, float('nan')):8.2f}")
    for title, part in (("before the first stage", BEFORE), ("after the last stage", AFTER), ("inside", INSIDE)):
        print(f"  {title}:")
        for label, _, _ in part:
            if label in res["cold"]:
                print(f"    {label:42} {res['cold'][label]:8.2f} {warm.get(label, float('nan')):8.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="rounds per mode (the first is the cold one)")
    ap.add_argument("--docs", type=int, default=200, help="documents per round")
    ap.add_argument("--modes", default="embedded,servers")
    ap.add_argument("--python", default=sys.executable, help="interpreter of the checkout to measure")
    ap.add_argument("--cwd", default=str(ROOT), help="that checkout's root")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(GOALS):
        raise SystemExit(f"--modes: unknown {sorted(unknown)} ({', '.join(GOALS)})")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="run-overhead-") as tmp:
        base = Path(tmp)
        inputs = make_inputs(base, args.repeat, args.docs)
        results = {m: mode_rounds(m, args.python, Path(args.cwd), base, inputs) for m in modes}
    for m, res in results.items():
        print_mode(m, res)
    load_after = os.getloadavg()
    print(f"\nload average (1 min) before {load[0]:.2f}, after {load_after[0]:.2f}; python {args.python}")
    line = {"bench": "run_overhead", "python": args.python, "repeat": args.repeat, "docs": args.docs,
            "load_1m": [round(load[0], 2), round(load_after[0], 2)]}
    for m, res in results.items():
        steady = res["warm"] or res["cold"]
        line[m] = {"before_s": round(steady["before_s"], 2), "after_s": round(steady["after_s"], 2),
                   "overhead_s": round(steady["overhead_s"], 2), "goal_s": GOALS[m],
                   "met": steady["overhead_s"] <= GOALS[m],
                   "cold": {k: round(res["cold"][k], 2) for k in ("before_s", "after_s", "overhead_s")},
                   "breakdown": {k: v for k, v in steady.items() if k not in ("before_s", "after_s", "overhead_s")
                                 and isinstance(v, float)}}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
