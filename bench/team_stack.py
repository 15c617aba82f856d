"""The team set-up's figures (issue 46): what the Postgres-backed stack costs a run against the embedded default, and
two nodes against one.

`python -m bench.team_stack overhead [--repeat 3] [--docs 100]`: `lifecycle run deploy/configs/demo.yaml --until
scrub` on `--docs` documents (a new slice each round, so every stage computes), as a new process each round, (a)
with the embedded default (SQLite MLflow, the work dir's Prefect server; no warm runner, so both import the same)
and (b) against deploy/stack.sh's Prefect and MLflow servers on Postgres, the modes alternating. The fixed cost of a run is its wall time
less its stages' (the run's own `timing`); medians over rounds 2..N (round 1 makes stores and servers).

`python -m bench.team_stack two-node`: the two-machine topology of tests/deploy/twonode.py (network namespaces on
one host, root only); 20 steps of the tiny demo model at global batch 16 on 2 nodes x 2 ranks (micro-batch 4) and
on 1 node x 2 ranks (micro-batch 4, 2 accumulation steps): the worst relative loss difference per step, and the
median tokens/s of each over steps 3-20. On one host the 4 ranks share its cores: this is the overhead of the
launch and the network path, never a speed-up.

The last line is one JSON object. Figures: docs/benchmarks.md, "Issue 46".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import ROOT, corpus_records, last_json


def _slice_inputs(folder: Path, docs: int, round_: int) -> str:
    recs = corpus_records(docs * (round_ + 1), every_file=True)[docs * round_:]
    path = folder / f"round{round_}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def _run(workdir: Path, inputs: str, env: dict) -> dict:
    args = [sys.executable, "-m", "lifecycle.launch", "run", str(ROOT / "deploy/configs/demo.yaml"), "--json",
            "--until", "scrub", "--set", f"workdir={workdir}", "--set", f"collect.inputs={json.dumps([inputs])}",
            "--set", "collect.incremental=false"]
    start = time.time()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    end = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"bench.team_stack: run failed:\n{proc.stderr[-3000:]}")
    out = last_json(proc.stdout)
    t = out["timing"]
    stages = sum(v for k, v in t.items() if k.startswith("stage:"))
    return {"wall_s": end - start, "fixed_s": end - start - stages, "stages_s": stages}


def overhead(repeat: int, docs: int) -> dict:
    from tests.deploy.stack import Stack

    base = {**os.environ, "LIFECYCLE_EMBEDDED_RUNNER": "0", "LIFECYCLE_WARM": "0"}
    base.pop("PREFECT_API_URL", None)
    base.pop("MLFLOW_TRACKING_URI", None)
    stack = Stack()
    results: dict[str, list[dict]] = {"embedded": [], "stack": []}
    with tempfile.TemporaryDirectory(prefix="bench-team-") as tmp:
        root = Path(tmp)
        try:
            t0 = time.monotonic()
            stack.sh("start", "postgres", "s3", "mlflow", "prefect")
            start_s = time.monotonic() - t0
            for r in range(repeat):  # the modes alternate, so that a change of the machine's load hits both
                for mode, env in (("embedded", base), ("stack", {**base, **stack.client_env()})):
                    results[mode].append(_run(root / f"wd-{mode}", _slice_inputs(root, docs, r), env))
                    print(mode, r + 1, json.dumps(results[mode][-1]), flush=True)
        finally:
            stack.close()
    summary = {mode: {k: round(statistics.median(x[k] for x in rows[1:] or rows), 2) for k in rows[0]}
               for mode, rows in results.items()}
    summary["stack_start_s"] = round(start_s, 1)
    summary["extra_fixed_s"] = round(summary["stack"]["fixed_s"] - summary["embedded"]["fixed_s"], 2)
    return summary


def two_node() -> dict:
    from tests.deploy.stack import tiny_inputs
    from tests.deploy.test_two_nodes import losses, node1_env, run_args, two_node_args
    from tests.deploy.twonode import TwoNodes, why_no_two_nodes

    if why_no_two_nodes():
        raise SystemExit(f"bench.team_stack two-node: {why_no_two_nodes()}")
    with tempfile.TemporaryDirectory(prefix="bench-2n-") as tmp:
        root = Path(tmp)
        t = TwoNodes(root / "net").up()
        try:
            (root / "hostfile").write_text(f"{t.addrs[0]} slots=2\n{t.addrs[1]} slots=2\n")
            inputs = tiny_inputs(root / "in")
            runs = {"2x2": two_node_args(t, root, root / "wd-2x2", inputs),
                    "1x2": run_args(root / "wd-1x2", inputs, ["train.batch.num_ranks=2",
                                                               "train.batch.micro_batch_size=4",
                                                               "train.batch.grad_accum=2"])}
            speed, loss = {}, {}
            for name, args in runs.items():
                p = t.run(0, args, env=node1_env(t), cwd=ROOT, capture_output=True, text=True, timeout=1200)
                if p.returncode != 0:
                    raise SystemExit(f"bench.team_stack: {name} failed:\n{p.stderr[-3000:]}")
                wd = root / f"wd-{name}"
                loss[name] = losses(wd)
                (metrics,) = wd.glob("train/*/metrics.jsonl")
                recs = [json.loads(line) for line in metrics.read_text().splitlines()]
                speed[name] = statistics.median(r["tokens_per_s"] for r in recs
                                                if r.get("kind") == "train" and r["step"] >= 3)
        finally:
            t.down()
    worst = max(abs(loss["2x2"][s] - loss["1x2"][s]) / abs(loss["1x2"][s]) for s in loss["1x2"])
    return {"worst_rel_loss_diff": worst, "steps": len(loss["1x2"]),
            "tokens_per_s": {k: round(v) for k, v in speed.items()},
            "ratio_2x2_over_1x2": round(speed["2x2"] / speed["1x2"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["overhead", "two-node"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--docs", type=int, default=100)
    a = ap.parse_args()
    print(json.dumps(overhead(a.repeat, a.docs) if a.part == "overhead" else two_node()))


if __name__ == "__main__":
    main()
