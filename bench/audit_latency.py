"""Audit-command latency, before (a git ref, default `main`) and after (this checkout), in the same run.

`python -m bench.audit_latency [--workdir runs/demo] [--before main] [--repeat 3]`

Each command runs as a user runs it, `python -m lifecycle.cli ...` in a new process, on the work dir given (not a
copy: the registry's tags name files by absolute path, and a copy's would lie outside it). The "after" code adds
its catalog, `<workdir>/catalog/`, as any run of this version does; the "before" code does not read it. The
"before" code is `git archive <ref>` laid out as the installed package (`lifecycle`, `lifecycle.flows`, ...) in a
temporary folder put first on PYTHONPATH; both use this checkout's environment. Per command: the first call
(the "after" code builds its catalog there), then the median of `--repeat` further calls, and after/before as a
ratio. Also `python -c "import lifecycle.cli"` alone. Goal: every audit command under 2 s on the demo work dir.
Absolute times on a shared machine are noise; the ratio is the result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = {"lifecycle": "", "flows": "flows", "tasks": "tasks", "lineage": "lineage"}  # folder -> under lifecycle/


def checkout(ref: str, dest: Path) -> Path:
    """`ref`'s source as an importable `lifecycle` package in `dest` (pyproject's package-dir, by hand)."""
    src = dest / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref, *LAYOUT], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = dest / "path" / "lifecycle"
    shutil.copytree(src / "lifecycle", pkg)
    for folder, under in LAYOUT.items():
        if under:
            shutil.copytree(src / folder, pkg / under)
    return dest / "path"


def timed(argv: list[str], env: dict, cwd: Path) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - t0, p.returncode, (p.stdout + p.stderr)[-400:]


def commands(workdir: Path) -> dict[str, list[str]]:
    """The audit commands measured, with arguments that have an answer in this work dir."""
    import duckdb

    kept = sorted(workdir.glob("datasets/collect/*/*.parquet")) + sorted(workdir.glob("datasets/collect/*/*/*.parquet"))
    kept = [p for p in kept if "rejected" not in p.name]
    sid = duckdb.sql(f"SELECT source_id FROM read_parquet('{kept[0]}') LIMIT 1").fetchall()[0][0]
    out = {"sql": ["sql", "SELECT stage, count(*) AS n, sum(num_rows) AS rows FROM datasets GROUP BY ALL ORDER BY 1"],
           "sql rejected": ["sql", "SELECT stage, reason, count(*) AS n FROM rejected GROUP BY ALL ORDER BY ALL"],
           "lineage doc": ["lineage", "doc", sid]}
    if (workdir / "mlflow.db").exists():
        import sqlite3

        with sqlite3.connect(f"file:{workdir}/mlflow.db?mode=ro", uri=True) as con:
            model = con.execute("SELECT name FROM registered_models LIMIT 1").fetchone()
        if model:
            out["lineage model"] = ["lineage", "model", model[0]]
    return {k: ["-m", "lifecycle.cli", *v, "--workdir", str(workdir), "--json"] for k, v in out.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="runs/demo", help="a work dir from a demo run (copied, never changed)")
    ap.add_argument("--before", default="main", help="git ref of the code to compare with (default main)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    src = Path(args.workdir).resolve()
    if not (src / "datasets").is_dir():
        raise SystemExit(f"{src}: not a lifecycle work dir (make one: lifecycle run deploy/configs/demo.yaml)")
    before_commit = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True,
                                   text=True, check=True).stdout.strip()
    after_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout.strip()
    results: dict = {"workdir": str(src), "before": f"{args.before} ({before_commit})",
                     "after": f"HEAD ({after_commit}) + working tree", "repeat": args.repeat, "commands": {}}
    with tempfile.TemporaryDirectory(prefix="audit-latency-") as tmp:
        tmp = Path(tmp)
        old_path = checkout(args.before, tmp / "before")
        envs = {}
        for side in ("before", "after"):
            env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
            if side == "before":
                env["PYTHONPATH"] = str(old_path)
            envs[side] = (env, src)
        # the same code is imported either way: check it
        for side, (env, _) in envs.items():
            where = subprocess.run([sys.executable, "-c", "import lifecycle.lineage.cli as m; print(m.__file__)"],
                                   env=env, cwd=tmp, capture_output=True, text=True, check=True).stdout.strip()
            assert where.startswith(str(old_path) if side == "before" else str(ROOT)), (side, where)
        cmds = {"import lifecycle.cli": ["-c", "import lifecycle.cli"]}
        cmds.update(commands(envs["after"][1]))
        for name, cmd in cmds.items():
            row = {}
            for side, (env, wd) in envs.items():
                argv = cmd
                first, rc, tail = timed(argv, env, tmp)
                if rc != 0:
                    raise SystemExit(f"{side}: {' '.join(argv)} exited {rc}: {tail}")
                runs = [timed(argv, env, tmp)[0] for _ in range(args.repeat)]
                row[side] = {"first_s": round(first, 2), "median_s": round(statistics.median(runs), 2),
                             "runs_s": [round(r, 2) for r in runs]}
            row["ratio_after_before"] = round(row["after"]["median_s"] / row["before"]["median_s"], 3)
            results["commands"][name] = row
            print(f"{name:<22} before {row['before']['median_s']:>6.2f} s (first {row['before']['first_s']:.2f})   "
                  f"after {row['after']['median_s']:>6.2f} s (first {row['after']['first_s']:.2f})   "
                  f"after/before {row['ratio_after_before']:.3f}", flush=True)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
