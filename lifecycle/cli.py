"""The `lifecycle` command line.

    lifecycle run [CONFIG] [--set KEY=VALUE ...] [--until STAGE] [--json] [-v]
    lifecycle verify [CONFIG] [--workdir DIR] [--json]
    lifecycle config show [CONFIG] [--defaults] [--json] | lifecycle config schema [-o FILE]
    lifecycle forget ID... --reason TEXT [--retrain | --unlearn] [--config CONFIG] [--set KEY=VALUE ...]

Every command that reads a run names it the same way (`resolve_workdir`): CONFIG and --set as `run` takes them,
else --workdir, else $LIFECYCLE_WORKDIR, else the default config's work dir (said on stderr).

Other subcommands live beside the code they drive: each module in `COMMAND_MODULES` has a
`register(subparsers)` that adds its parser and sets `func`.
"""

from __future__ import annotations

import time

COMMAND_START = time.time()  # a cold run's `timing.command_start`: before the imports below (config, pydantic)

import argparse
import json
import os
import re
import signal
import sys
from collections import Counter
from pathlib import Path

from lifecycle.config import DEFAULT_CONFIG, ConfigError, load_config
from lifecycle.core.errors import one_line
from lifecycle.core.procs import Terminated
from lifecycle.tasks.stages import NAMES as STAGES

START_ENV = dict(os.environ)  # the command's environment before `prepare_environment`: the embedded runner's
EMBEDDED_USED: str | None = None  # the work dir whose embedded Prefect server this (cold) run used


def cmd_run(args: argparse.Namespace) -> int:
    global EMBEDDED_USED
    cfg = load_config(args.config, args.set or [])  # a ConfigError is one line and exit 2 (`main`)
    from lifecycle.core.locking import WorkdirBusy, check_workdir, workdir_lock

    check_workdir(cfg.workdir)
    from lifecycle.preflight import check_patterns, preflight

    check_patterns("collect.inputs", cfg.collect.inputs)  # an empty glob, an unreadable file, a bad URL: one line

    checked = preflight(cfg, args.until)  # files, packages and servers the stages need: one line, before Prefect
    cfg = checked.config

    t0 = time.time()
    out, err, log = sys.stdout, sys.stderr, None
    signal.signal(signal.SIGTERM, Terminated.raise_for)  # Prefect swaps in its own during the flow, then re-sends it here
    try:
        with workdir_lock(cfg.workdir, wait=args.wait, holder="lifecycle run"):
            if not args.verbose:  # the libraries' chatter goes to the log file, before any of them is imported
                from lifecycle.console import Capture, log_path_for

                capture = Capture(log_path_for(cfg.workdir))
                out, err, log = capture.out, capture.err, capture.log_path
            from lifecycle.console import RunConsole

            view = RunConsole(err if args.json else out, max_steps=cfg.train.max_steps,
                              live=False if args.verbose else None)
            view.print(f"lifecycle run {args.config or DEFAULT_CONFIG} -> {cfg.workdir}"
                       + (f" (log: {log})" if log else ""))
            for note in checked.notes:
                view.print(f"  note: {note}")
            timing = {"command_start": args.command_start, "prefect_start": time.time()}
            from lifecycle.flows.startup.environment import start_environment

            # Prefect's environment, before anything imports Prefect; an embedded server that has to start does so
            # while the flow's modules are imported
            mode, server = start_environment(cfg.workdir)
            if mode == "embedded":
                EMBEDDED_USED = cfg.workdir
            timing["prefect_launched"] = time.time()
            from lifecycle.flows.pipeline import lifecycle_flow

            if not (cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")):  # the work dir's SQLite
                from lifecycle.lineage.tracking import preload_sqlite_store

                preload_sqlite_store()
            timing["imports_done"] = time.time()
            if server is not None:
                server.wait()
            timing["prefect_ready"] = time.time()

            with view:
                timing["flow_call"] = time.time()
                summary = lifecycle_flow(config=cfg, until=args.until, reporter=view)
            summary["orchestration"] = mode
            if mode == "embedded":
                summary["left_running"] = left_running(cfg.workdir)
            summary["launch"] = args.launch
            summary["timing"] = {**timing, **summary.get("timing", {})}
    except WorkdirBusy as e:
        print(f"lifecycle run: error: {e}", file=err)
        if args.json:
            print(json.dumps({"status": "busy", "workdir": cfg.workdir, "error": str(e)}), file=out)
        return 3
    except (KeyboardInterrupt, Terminated) as e:
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        from lifecycle.flows.interrupts import cancel_interrupted

        cancel_interrupted()  # a flow run the interrupt ended is Cancelled, not Crashed
        print(f"lifecycle: interrupted by {signal.Signals(signum).name}; the ranks are stopped and the last "
              "committed checkpoint stands (rerun to resume)" + (f"; log: {log}" if log else ""), file=err)
        if args.json:
            print(json.dumps({"status": "interrupted", "signal": signal.Signals(signum).name}), file=out)
        return 128 + signum
    except Exception as e:  # the flow has logged the traceback; report and fail
        print(f"lifecycle run: run failed: {type(e).__name__}: {without_sql(one_line(str(e)))}"  # one line, as every error
              + disk_full_hint(e, cfg.workdir) + (f" (traceback and library logs: {log})" if log else ""), file=err)
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


def left_running(workdir: str) -> str:
    """What an embedded run leaves up for the next one in its work dir, and until when."""
    from lifecycle.flows.startup.embedded import EMBEDDED_IDLE_ENV, EMBEDDED_IDLE_S

    idle = float(os.environ.get(EMBEDDED_IDLE_ENV) or EMBEDDED_IDLE_S)
    return (f"this work dir's Prefect server and a warm runner, for faster later runs; both stop after "
            f"{idle / 60:.0f} min unused, or now with `lifecycle down --workdir {workdir}`")


# the figures a user decides on, printed in the summary; the rest are in the model card, MLflow and --json
# (with evaluate's own headline, metrics_text.HEADLINE)
SUMMARY_METRICS = ("train_loss", "train_steps", "train_params", "val_perplexity", "contamination_near_copy_rate")


def print_summary(s: dict, file=None) -> None:
    def p(text: str = "") -> None:
        print(text, file=file or sys.stdout)

    outcomes = ", ".join(f"{n} {o}" for o, n in Counter(s["stages"].values()).items())
    p(f"\nlifecycle run {s['status']} in {s['elapsed_s']} s" + (f": {len(s['stages'])} stages ({outcomes})"
                                                               if s["stages"] else ""))
    p(f"  work dir:        {s['workdir']}" + (" (each stage's output: latest/<stage>)" if s["stages"] else ""))
    if s.get("model"):
        promo = s.get("promotion") or {}
        p(f"  model:           {s['model']['name']} version {s['model']['version']}"
          + (f"; champion: {promo['decision']}" if promo.get("decision") else ""))
    from lifecycle.tasks.eval.evaluate.metrics_text import HEADLINE

    shown = {k: v for k, v in s["metrics"].items() if k in SUMMARY_METRICS + HEADLINE}
    for line in metric_lines(shown):
        p(line)
    if s["status"] == "no_new_inputs":  # a no-op scheduled tick: nothing was committed and no MLflow run opened
        p("  nothing to do: every input file was collected by an earlier run (no MLflow run was opened)")
        return
    rest = len(s["metrics"]) - len(shown)
    p(f"  MLflow run:      {s['mlflow_run_id']}" + (f" ({rest} more metrics there, in the model card and "
                                                      f"under --json)" if rest > 0 else ""))
    for name, label in (("funnel", "funnel chart"), ("loss_curves", "loss curves"), ("model_card", "model card")):
        if s.get("artifacts", {}).get(name):
            p(f"  {label + ':':<16} {s['artifacts'][name].removeprefix('file://')}")
    if s.get("log"):
        p(f"  log:             {s['log']}")
    if s.get("left_running"):
        p(f"  left running:    {s['left_running']}")
    bindir = os.path.dirname(sys.executable)  # the venv's, so that the commands work from any directory
    p(f"\nOpen the MLflow UI:  {bindir}/mlflow ui --backend-store-uri {s['mlflow_tracking_uri']} --port 5000")
    p(f"Why documents were dropped:  {bindir}/lifecycle sql \"SELECT stage, reason, count(*) FROM rejected GROUP BY "
      f"ALL ORDER BY 3 DESC\" --workdir {s['workdir']}")


def metric_lines(metrics: dict) -> list[str]:
    """One line per metric family, in order: {val_loss: 5.314, val_bpb: 2.063, step: 200} ->
    ['  val:             loss 5.314, bpb 2.063', '  step:            200']."""
    groups: dict[str, list[str]] = {}
    for k, v in metrics.items():
        family, _, name = k.partition("_")
        value = f"{v:.4g}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)
        groups.setdefault(family, []).append(f"{name} {value}" if name else value)
    return [f"  {family + ':':<16} " + ", ".join(items) for family, items in groups.items()]


# Modules that add subcommands (imported lazily, so `lifecycle run` stays fast).
COMMAND_MODULES: list[str] = ["lifecycle.flows.startup.commands", "lifecycle.flows.serve", "lifecycle.tasks.train.planner", "lifecycle.tasks.eval.export", "lifecycle.tasks.eval.code.cli", "lifecycle.lineage.cli"]


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


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash every committed dataset and checkpoint of a work dir: one line per damaged item, exit 1 on any."""
    from lifecycle.core.dataset import committed_datasets, verify_dataset
    from lifecycle.core.errors import UsageError
    from lifecycle.tasks.train import commit as ckpt

    wd = Path(args.workdir)
    if not wd.is_dir():
        raise UsageError(f"work dir {wd} ({args.workdir_from}): no such directory")
    datasets, checkpoints = committed_datasets(wd), sorted(wd.glob("train/*/checkpoints"))
    damaged = [{"kind": "dataset", "path": str(d), "problems": p} for d in datasets if (p := verify_dataset(d))]
    n_ckpt = 0
    for root in checkpoints:
        for _, tag in ckpt.list_committed(root):
            n_ckpt += 1
            if (reason := ckpt.verify(tag)) is not None:
                damaged.append({"kind": "checkpoint", "path": str(tag), "problems": [reason]})
    for d in damaged:
        print(f"DAMAGED {d['kind']} {d['path']}: {'; '.join(d['problems'])}")
    if args.json:
        print(json.dumps({"workdir": str(wd), "datasets": len(datasets), "checkpoints": n_ckpt, "damaged": damaged}))
    else:
        print(f"lifecycle verify: {len(datasets)} dataset(s), {n_ckpt} checkpoint(s) in {wd}: "
              + (f"{len(damaged)} damaged (the next run moves a damaged dataset aside and rebuilds it, and resumes "
                 "training from the newest sound checkpoint)" if damaged else "all match their manifests"))
    return 1 if damaged else 0


def register_verify(sub) -> None:
    p = sub.add_parser("verify", help="Check every committed dataset and checkpoint of a work dir against its "
                                      "manifest (full sha256); exit 1 if any is damaged.")
    p.add_argument("config", nargs="?", help="YAML config whose `workdir` is checked (see `lifecycle --help`)")
    p.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    p.set_defaults(func=cmd_verify, names_run=True)


# --------------------------------------------------------------------------------------------------
# naming a run: one resolution for every command that reads a work dir (its parser sets `names_run=True`)

WORKDIR_ENV = "LIFECYCLE_WORKDIR"


def add_run_naming(p: argparse.ArgumentParser) -> None:
    """Give a command CONFIG (-c/--config where it has no positional CONFIG), --set and --workdir."""
    dests = {a.dest for a in p._actions}
    if "config" not in dests:
        p.add_argument("-c", "--config", metavar="CONFIG",
                       help="YAML config whose `workdir` names the run, as `lifecycle run CONFIG` takes it")
    if "set" not in dests:
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="Override a config field, as for `run` (e.g. --set workdir=/tmp/w). Repeatable.")
    if "workdir" not in dests:
        p.add_argument("--workdir", metavar="DIR",
                       help=f"the work dir, when neither CONFIG nor --set names the run (then ${WORKDIR_ENV}, "
                            f"then the default config's)")
    p.set_defaults(config=None)


def resolve_workdir(args: argparse.Namespace) -> tuple[str, str, str | None]:
    """(work dir, what named it, a note when it fell back to the default). The order: CONFIG and --set (the
    config's `workdir`), --workdir, $LIFECYCLE_WORKDIR, then the default config's work dir."""
    config, sets = getattr(args, "config", None), getattr(args, "set", None) or []
    if config or sets:
        return load_config(config, sets).workdir, f"config {config or DEFAULT_CONFIG}", None
    if getattr(args, "workdir", None):
        return args.workdir, "--workdir", None
    if os.environ.get(WORKDIR_ENV):
        return os.environ[WORKDIR_ENV], f"${WORKDIR_ENV}", None
    given = getattr(args, getattr(args, "path_arg", None) or "", None)  # e.g. export's CHECKPOINT
    if given and (wd := workdir_holding(Path(given))):
        return str(wd), f"{args.path_arg.upper()} {given}", None

    if Path(DEFAULT_CONFIG).is_file():
        wd, source = load_config(DEFAULT_CONFIG).workdir, f"the default config {DEFAULT_CONFIG}"
    else:
        from lifecycle.config import PipelineConfig

        wd, source = str(Path(PipelineConfig.model_fields["workdir"].default).resolve()), "the built-in default"
    return wd, source, (f"work dir {wd}, from {source} (name a run with CONFIG, --set workdir=..., --workdir or "
                        f"${WORKDIR_ENV})")


def workdir_holding(path) -> Path | None:
    """The work dir a path lies in (the nearest folder above it, as written or resolved, that holds `datasets/`
    and `latest/` or `train/`), or None."""
    for p in (path.expanduser().absolute(), path.expanduser().resolve()):
        for d in p.parents:
            if (d / "datasets").is_dir() and ((d / "latest").is_dir() or (d / "train").is_dir()):
                return d
    return None


def run_config(args: argparse.Namespace):
    """The config of the run a command names (`resolve_workdir`, already applied to `args.workdir`): CONFIG and
    --set as given; else the default config when it names that work dir; else the built-in defaults (no inputs)
    with it."""
    if args.config or args.set:
        return load_config(args.config, args.set or [])
    wd = Path(args.workdir).expanduser().resolve()
    if Path(DEFAULT_CONFIG).is_file() and Path(load_config(DEFAULT_CONFIG).workdir).expanduser().resolve() == wd:
        return load_config(DEFAULT_CONFIG)
    from lifecycle.config import validate_config

    # no config names this work dir's inputs: a placeholder pattern, never read (`forget --retrain` refuses it)
    return validate_config({"workdir": str(wd), "collect": {"inputs": [UNKNOWN_INPUTS]}},
                           origin=f"the built-in defaults for {wd}")


UNKNOWN_INPUTS = "<the inputs of a config not named>"


# --------------------------------------------------------------------------------------------------
# lifecycle config show | schema


def cmd_config_show(args: argparse.Namespace) -> int:
    from lifecycle.config import config_fields

    if args.defaults and (args.config or args.set):
        from lifecycle.core.errors import UsageError

        raise UsageError("--defaults shows the built-in defaults: give it no CONFIG or --set")
    cfg = None if args.defaults else load_config(args.config, args.set or [])
    rows = config_fields(cfg)
    origin = "built-in defaults" if cfg is None else (args.config or DEFAULT_CONFIG)
    if args.json:
        print(json.dumps({"config": origin, "fields": rows}))
        return 0
    import textwrap

    print(f"# {origin}: every field, its value, its default and what it does"
          + ("" if cfg is None else " (* = differs from the default)"))
    for r in rows:
        value = "(required)" if r["required"] and cfg is None else json.dumps(r["value"])
        changed = cfg is not None and r["value"] != r["default"]
        default = "required" if r["required"] else json.dumps(r["default"])
        print(f"{'*' if changed else ' '} {r['field']}: {value}" + (f"   (default {default})" if changed else ""))
        for line in textwrap.wrap(f"{r['type']}. {r['doc']}", 108):
            print(f"      {line}")
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    from lifecycle.config import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}; editors with the YAML language server use it with a first line "
              f"`# yaml-language-server: $schema=<path to it>` in a config", file=sys.stderr)
    return 0


def register_config(sub) -> None:
    cfg = sub.add_parser("config", help="Discover the configuration: every field with its value, default and doc; "
                                        "a JSON Schema for editors.")
    csub = cfg.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="Print the resolved config: each field's value, default and doc.")
    show.add_argument("config", nargs="?", help=f"YAML config (default {DEFAULT_CONFIG})")
    show.add_argument("--set", action="append", metavar="KEY=VALUE", help="Override a field, as for `run`.")
    show.add_argument("--defaults", action="store_true", help="Show the built-in defaults instead of a config.")
    show.add_argument("--json", action="store_true",
                      help="Print one JSON object: {config, fields: [{field, value, default, required, type, doc}]}.")
    show.set_defaults(func=cmd_config_show)
    schema = csub.add_parser("schema", help="Write the config's JSON Schema (for editors: completion, docs on "
                                            "hover and checks in deploy/configs/*.yaml).")
    schema.add_argument("-o", "--output", metavar="FILE", help="where to write it (default: stdout)")
    schema.set_defaults(func=cmd_config_schema)


def cmd_forget(args: argparse.Namespace) -> int:
    """Tombstone the documents (lineage/forgetting.py), then retrain (`lifecycle run` with the same config) or
    unlearn from the champion; neither flag only records the request (the next run honours it)."""
    import yaml

    from lifecycle.core.errors import UsageError
    from lifecycle.core.locking import check_workdir, workdir_lock
    from lifecycle.tasks.eval.unlearn import UnlearnConfig

    if args.retrain and args.unlearn:
        raise UsageError("choose one route: --retrain or --unlearn")
    cfg = run_config(args)
    if args.retrain and cfg.collect.inputs == [UNKNOWN_INPUTS]:
        raise UsageError(f"--retrain reruns the lifecycle of {cfg.workdir} on its inputs: name its config (--config)")
    knobs = {}
    for item in args.unlearn_set or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(f"--unlearn-set {item!r}: expected FIELD=VALUE")
        knobs[key] = yaml.safe_load(value)
    ucfg = UnlearnConfig(**knobs)
    check_workdir(cfg.workdir)
    from lifecycle.lineage.forgetting import record_request, taint_versions, unlearn_champion

    info = sys.stderr if args.json else sys.stdout
    print(f"forget: work dir {cfg.workdir} (from {args.workdir_from})", file=info)
    with workdir_lock(cfg.workdir, wait=args.wait, holder="lifecycle forget"):
        rows = record_request(cfg, args.ids, args.reason)
        tainted = taint_versions(cfg, rows)
    for r in rows:
        print(f"tombstone {r['tombstone_id']}: doc_id {r['doc_id']} source_id {r['source_id']} ({r['reason']}, "
              f"{r['created_at']}) in {cfg.workdir}/tombstones.parquet", file=info)
    if tainted:
        print(f"model versions trained on them, tagged lifecycle.forget.tainted: {', '.join(tainted)} (a tainted "
              "champion gives way to the next version without them and is no warm start)", file=info)
    if args.retrain:
        # a rebuild of the whole corpus without the documents, not a run on new data: deduplicated within itself,
        # not against the dedup index and paragraph filter of earlier runs (they hold the forgotten document's
        # signature and paragraphs)
        rebuild = (args.set or []) + ["collect.incremental=false", "dedup.incremental=false",
                                      f"workdir={json.dumps(cfg.workdir)}"]
        print("retraining: a full run (collect.incremental=false, dedup.incremental=false)", file=info)
        return cmd_run(argparse.Namespace(config=args.config, set=rebuild, until=None, json=args.json,
                                          verbose=args.verbose, wait=args.wait, command_start=args.command_start,
                                          launch=args.launch))
    result = {"status": "recorded", "tombstones": rows, "tainted_versions": tainted}
    if args.unlearn:
        signal.signal(signal.SIGTERM, Terminated.raise_for)  # a stopped unlearning says so and marks its run KILLED
        try:
            with workdir_lock(cfg.workdir, wait=args.wait, holder="lifecycle forget --unlearn"):
                result = {**unlearn_champion(cfg, rows, ucfg, log=lambda s: print(s, file=info)),
                          "tombstones": rows, "tainted_versions": tainted}
        except (KeyboardInterrupt, Terminated) as e:
            name = signal.Signals(e.signum if isinstance(e, Terminated) else signal.SIGINT).name
            print(f"lifecycle forget: unlearning stopped by {name}: the tombstones are recorded, nothing was "
                  "unlearned and the champion stays tainted; rerun with --unlearn (or --retrain)", file=sys.stderr)
            return 128 + (e.signum if isinstance(e, Terminated) else signal.SIGINT)
        if result["status"] == "registered":
            m, p = result["model"], result["promotion"]
            print(f"unlearned: registered {m['name']} version {m['version']} (from {result['champion']}); "
                  f"champion: {p.get('decision')} ({p.get('reason')})", file=info)
        else:
            print(f"unlearning refused: {result['reason']}", file=info)
    else:
        print("recorded; the next `lifecycle run` rejects these documents at collect (reason `forgotten`)", file=info)
    if args.json:
        print(json.dumps(result, default=str))
    return 0 if result["status"] != "refused" else 4


def register_forget(sub) -> None:
    p = sub.add_parser("forget", help="Remove documents for good (tombstone ledger), then retrain or unlearn.")
    p.add_argument("ids", nargs="+", metavar="ID", help="doc_id or source_id of a collected document")
    p.add_argument("--reason", required=True, help="why (kept in the ledger; never the document's text)")
    p.add_argument("-c", "--config", help="YAML config of the runs (else --workdir, $LIFECYCLE_WORKDIR, then the "
                                          f"default {DEFAULT_CONFIG}, as every command that reads a run)")
    route = p.add_mutually_exclusive_group()
    route.add_argument("--retrain", action="store_true", help="rerun the lifecycle without the documents")
    route.add_argument("--unlearn", action="store_true",
                       help="gradient ascent on the champion (Jang et al. 2022); registers an unlearned version")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="Override a config field (as `run`).")
    p.add_argument("--unlearn-set", action="append", metavar="FIELD=VALUE",
                   help="Override an unlearning field (lr, chunk_size, max_epochs, check_every, sequence_tokens, "
                        "el_n, el_stride, never_seen, max_val_loss_increase, val_batches, seed: tasks/eval/unlearn.py).")
    p.add_argument("--json", action="store_true", help="Print one JSON object as the last line of stdout.")
    p.add_argument("-v", "--verbose", action="store_true", help="as `run -v`")
    p.add_argument("--wait", action="store_true", help="If another run holds the work dir, wait for it.")
    p.set_defaults(func=cmd_forget, names_run=True)


# --------------------------------------------------------------------------------------------------
# errors: what a user can get wrong is one line and exit 2; anything else is a bug (exit 1, traceback with -v)


def user_errors() -> tuple[type[BaseException], ...]:
    """A missing, unreadable or malformed file or argument (the library raising it names the file or field)."""
    import yaml
    from pydantic import ValidationError

    from lifecycle.core.errors import UsageError
    from lifecycle.core.paths import PathEscape

    return (UsageError, ConfigError, PathEscape, OSError, UnicodeError, json.JSONDecodeError, yaml.YAMLError,
            ValidationError)


_SQL_DETAIL = re.compile(r"\s*\[SQL: .*?(\(Background on this error at: [^)]*\)|$)", re.S)
_AUTOFLUSH = re.compile(r"\(raised as a result of Query-invoked autoflush[^)]*\);?\s*")  # SQLAlchemy's aside
FULL_BELOW = 64 << 20  # a file system with less free space than this counts as full


def without_sql(text: str) -> str:
    """SQLAlchemy's message without the statement, its parameters, its help link (a disk-full INSERT into the
    MLflow store printed the whole row) and its autoflush aside."""
    return _AUTOFLUSH.sub("", _SQL_DETAIL.sub("", text)).rstrip("; ")


def disk_full_hint(e: BaseException, workdir: str) -> str:
    """`; <workdir>'s file system is full ...` when the failure, or anything in its chain, is a full disk (ENOSPC,
    SQLite's `database or disk is full`), or the work dir's file system has under 64 MiB free: a full disk shows up
    as many other errors (a server that exits in its start-up, a store that cannot flush)."""
    import errno
    import shutil

    from lifecycle.core.errors import exception_chain

    full = any((isinstance(c, OSError) and c.errno == errno.ENOSPC) or "disk is full" in str(c)
               for c in exception_chain(e))
    try:
        free = shutil.disk_usage(workdir).free
    except OSError:
        free = None
    if not full and (free is None or free >= FULL_BELOW):
        return ""
    space = f"{free:,} bytes free" if free is not None else "no space"
    return (f"; the file system of {workdir} is full ({space}): free space there and rerun, the committed stages "
            "and checkpoints are reused")


def describe_error(e: BaseException) -> str:
    """What went wrong, in one line, naming the file where the exception knows it."""
    from lifecycle.core.errors import UsageError
    from lifecycle.core.paths import PathEscape

    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        what = f"{e.strerror.lower()} ({e.filename}" + (f" -> {e.filename2}" if e.filename2 else "") + ")"
    elif isinstance(e, UnicodeDecodeError):
        what = f"not UTF-8 text: byte {e.object[e.start:e.start + 1].hex()} at offset {e.start}"
    elif isinstance(e, (UsageError, ConfigError, PathEscape)):
        what = str(e)
    else:
        what = f"{type(e).__name__}: {e}"
    return one_line(what)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (`lifecycle run: error: ... (see lifecycle run --help)`), exit 2."""

    def error(self, message: str):
        line = f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)"
        print(line, file=sys.stderr)
        if self.json_errors:
            print(json.dumps({"status": "usage_error", "error": line}))
        sys.exit(2)

    json_errors = False  # `--json` on the command line: an error is also a JSON line on stdout


def _leaves(parser: argparse.ArgumentParser):
    """The parser of each (sub)command that runs something."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for action in subs:
        for child in dict.fromkeys(action.choices.values()):
            yield from _leaves(child)


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return _command_parser(action.choices[getattr(args, action.dest)], args)
    return parser


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    import importlib

    _Parser.json_errors = "--json" in (sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog="lifecycle", description=__doc__.strip().splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    register_run(sub)
    register_verify(sub)
    register_config(sub)
    register_forget(sub)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for leaf in _leaves(parser):
        if leaf.get_default("names_run"):
            add_run_naming(leaf)
        if "-v" not in leaf._option_string_actions:
            leaf.add_argument("-v", "--verbose", action="store_true", help="on an error, show its traceback")
    return parser


def main(argv: list[str] | None = None, command_start: float | None = None, launch: str = "cold") -> int:
    """The `lifecycle` command (`argv` None: the process's own arguments; a list: called in-process, e.g. tests).
    A run the warm runner forked (lifecycle/launch.py) passes the command's start and `launch="warm"`."""
    rc = _main(argv, COMMAND_START if command_start is None else command_start, launch)
    if argv is None and getattr(_main, "ran", None) == "run":
        if EMBEDDED_USED is not None and launch == "cold":  # the next run in this work dir goes warm
            from lifecycle.flows.startup.embedded_runner import start_embedded_runner

            try:
                start_embedded_runner(EMBEDDED_USED, START_ENV, os.getcwd())
            except OSError as e:  # a full disk, a removed work dir: the next run is only cold
                print(f"lifecycle: warning: no warm runner started for {EMBEDDED_USED}: {e}", file=sys.stderr)
        _exit_now(rc)
    return rc


def _exit_now(rc: int) -> None:
    """End the process as soon as `lifecycle run` is done: `finish_run`, then the interpreter's teardown of the
    thousands of modules Prefect, MLflow and their dependencies loaded (seconds of garbage collection and
    finalizers, nothing left to write: every dataset and manifest is fsynced and renamed into place) is skipped."""
    finish_run()
    os._exit(rc)


def finish_run() -> None:
    """What a process that ran `lifecycle run` does before `os._exit` (here, and in the warm runner's child): shard
    workers left behind are killed, the exit handlers (the libraries' own, the log capture's) run, the output is
    flushed."""
    import atexit

    from lifecycle.flows.pools import reap_workers

    reap_workers()  # no exit handler may wait on a shard worker
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass


def _main(argv: list[str] | None, command_start: float, launch: str) -> int:
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    args.command_start, args.launch = command_start, launch  # a run's `timing.command_start` and `launch`
    if extra:  # named by the subcommand that does not take them, not by `lifecycle`
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if getattr(args, "names_run", False):
            args.workdir, args.workdir_from, note = resolve_workdir(args)
            if note:
                print(f"{_command_parser(parser, args).prog}: {note}", file=sys.stderr)
        _main.ran = args.command  # type: ignore[attr-defined]  # read by `main` after the command returns
        return args.func(args)
    except KeyboardInterrupt:
        print("lifecycle: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        expected = isinstance(e, user_errors())
        if args.verbose:
            import traceback

            traceback.print_exc()
        prog = _command_parser(parser, args).prog
        line = (f"{prog}: error: {describe_error(e)}" if expected else
                f"{prog}: internal error: {describe_error(e)}" + ("" if args.verbose else
                                                                  f" (a bug: `{prog} ... -v` shows the traceback)"))
        print(line, file=sys.stderr)
        if getattr(args, "json", False):
            status = "invalid_config" if isinstance(e, ConfigError) else "error" if expected else "internal_error"
            print(json.dumps({"status": status, "error": line}))
        return 2 if expected else 1


if __name__ == "__main__":
    sys.exit(main())
