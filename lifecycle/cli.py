"""The `lifecycle` command line.

    lifecycle run [CONFIG] [--set KEY=VALUE ...] [--until STAGE] [--json] [-v]

Other subcommands live beside the code they drive: each module in `COMMAND_MODULES` has a
`register(subparsers)` that adds its parser and sets `func`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lifecycle.config import DEFAULT_CONFIG, STAGES, ConfigError, PipelineConfig, load_config


def _prefect_env(cfg: PipelineConfig) -> str:
    """Use the work dir's servers when `lifecycle up` started them. Otherwise the embedded defaults: without
    a configured Prefect API, keep Prefect's home (its SQLite database and the ephemeral server it starts)
    inside the work dir, give the ephemeral server time to start on 2 cores, and let MLflow write SQLite."""
    from lifecycle.flows import servers

    live = servers.active(cfg.workdir)
    if live:
        os.environ["PREFECT_API_URL"] = live["prefect_api"]
        os.environ["MLFLOW_TRACKING_URI"] = live["mlflow"]
    mode = "servers" if live else ("prefect-api" if os.environ.get("PREFECT_API_URL") else "embedded")
    if not os.environ.get("PREFECT_API_URL"):
        home = Path(os.environ.setdefault("PREFECT_HOME", str(Path(cfg.workdir) / ".prefect")))
        home.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    # task results (the small references stages return) live beside the data they point to
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(Path(cfg.workdir) / ".prefect-results"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if mode == "embedded":
        _share_ephemeral_server()
    return mode


def _share_ephemeral_server() -> None:
    """Start Prefect's temporary server now and export its URL, so that Dask worker processes (which
    inherit the environment) report their task runs to it instead of each starting a server of its own.
    It is the same singleton Prefect's client would start, and Prefect stops it when this process exits."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    os.environ["PREFECT_API_URL"] = server.api_url


def cmd_run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.set or [])
    except ConfigError as e:
        print(f"lifecycle: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"status": "invalid_config", "error": str(e)}))
        return 2
    from lifecycle.core.locking import WorkdirBusy, workdir_lock

    t0 = time.time()
    out, err, log = sys.stdout, sys.stderr, None
    try:
        with workdir_lock(cfg.workdir, wait=args.wait):
            if not args.verbose:  # the libraries' chatter goes to the log file, before any of them is imported
                from lifecycle.console import Capture, log_path_for

                capture = Capture(log_path_for(cfg.workdir))
                out, err, log = capture.out, capture.err, capture.log_path
            from lifecycle.console import RunConsole

            view = RunConsole(err if args.json else out, max_steps=cfg.train.max_steps,
                              live=False if args.verbose else None)
            view.print(f"lifecycle run {args.config or DEFAULT_CONFIG} -> {cfg.workdir}"
                       + (f" (log: {log})" if log else ""))
            mode = _prefect_env(cfg)  # sets Prefect's environment: before anything imports Prefect
            from lifecycle.flows.pipeline import lifecycle_flow
            from lifecycle.flows.runner import reporting

            with view, reporting(view):
                summary = lifecycle_flow(config=cfg, until=args.until)
            summary["orchestration"] = mode
    except WorkdirBusy as e:
        print(f"lifecycle: {e}", file=err)
        if args.json:
            print(json.dumps({"status": "busy", "workdir": cfg.workdir, "error": str(e)}), file=out)
        return 3
    except KeyboardInterrupt:
        print("lifecycle: interrupted" + (f"; log: {log}" if log else ""), file=err)
        return 130
    except Exception as e:  # the flow has logged the traceback; report and fail
        print(f"lifecycle: run failed: {type(e).__name__}: {e}" + (f"\n  traceback and library logs: {log}" if log else ""),
              file=err)
        if args.json:
            print(json.dumps({"status": "failed", "workdir": cfg.workdir, "error": f"{type(e).__name__}: {e}"}), file=out)
        return 1
    summary["elapsed_s"] = round(time.time() - t0, 1)
    if log:
        summary["log"] = str(log)
    if args.json:
        print(json.dumps(summary), file=out)
    else:
        print_summary(summary, out)
    return 0


def print_summary(s: dict, file=None) -> None:
    def p(text: str = "") -> None:
        print(text, file=file or sys.stdout)

    p(f"\nlifecycle run {s['status']} in {s['elapsed_s']} s")
    p(f"  work dir:        {s['workdir']}")
    for stage, outcome in s["stages"].items():
        where = s["datasets"].get(stage) or (s["checkpoint"] if stage == "train" else "")
        p(f"  {stage:<10} {outcome:<9} {where}")
    if s.get("model"):
        p(f"  model:           {s['model']['name']} version {s['model']['version']}")
    for k, v in s["metrics"].items():
        p(f"  {k:<16} {v:.4g}" if isinstance(v, float) else f"  {k:<16} {v}")
    p(f"  MLflow run:      {s['mlflow_run_id']}")
    if s.get("log"):
        p(f"  log:             {s['log']}")
    p(f"\nOpen the MLflow UI on these results:\n  .venv/bin/mlflow ui --backend-store-uri {s['mlflow_tracking_uri']}"
      f" --host 127.0.0.1 --port 5000\nQuery the data with DuckDB, e.g.:\n"
      f"  .venv/bin/python -c \"import duckdb; print(duckdb.sql(\\\"SELECT reason, count(*) FROM "
      f"read_parquet('{s['workdir']}/datasets/*/*/**/rejected-*.parquet', union_by_name=true) GROUP BY ALL\\\"))\"")


# Modules that add subcommands (imported lazily, so `lifecycle run` stays fast).
COMMAND_MODULES: list[str] = ["lifecycle.flows.servers", "lifecycle.flows.serve", "lifecycle.tasks.train.sizing", "lifecycle.tasks.eval.export", "lifecycle.lineage.cli"]


def register_run(sub) -> None:
    run = sub.add_parser("run", help="Run the whole lifecycle (or up to --until) as one Prefect flow.")
    run.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="Override a config field by dotted path; VALUE is parsed as YAML. Repeatable.")
    run.add_argument("--until", choices=STAGES, help="Stop after this stage.")
    run.add_argument("--json", action="store_true",
                     help="Print one JSON summary object as the only line of stdout (progress goes to stderr).")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="Show Prefect, Dask, MLflow and DeepSpeed logs live instead of writing them to "
                          "<workdir>/logs/run-<time>.log.")
    run.add_argument("--wait", action="store_true",
                     help="If another run holds the work dir, wait for it instead of refusing.")
    run.set_defaults(func=cmd_run)


def main(argv: list[str] | None = None) -> int:
    import importlib

    parser = argparse.ArgumentParser(prog="lifecycle", description=__doc__.strip().splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    register_run(sub)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
