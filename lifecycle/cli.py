"""The `lifecycle` command line.

    lifecycle run [CONFIG] [--set KEY=VALUE ...] [--until STAGE] [--json] [-v]
    lifecycle verify [CONFIG] [--workdir DIR] [--json]
    lifecycle config show [CONFIG] [--defaults] [--json] | lifecycle config schema [-o FILE]
    lifecycle forget ID... --reason TEXT [--retrain | --unlearn] [--config CONFIG] [--set KEY=VALUE ...]

Every command that reads a run names it the same way (`resolve_workdir`): CONFIG and --set as `run` takes them,
else --workdir, else $LIFECYCLE_WORKDIR, else the default config's work dir (said on stderr).

`config show | schema` live in lifecycle/config.py, `forget` in lineage/forget_command.py, the run's summary in
lifecycle/console.py. Other subcommands live beside the code they drive: each module in `COMMAND_MODULES` has a
`register(subparsers)` that adds its parser and sets `func`.
"""

from __future__ import annotations

import time

COMMAND_START = time.time()  # a cold run's `timing.command_start`: before the imports below (config, pydantic)

import argparse
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from lifecycle.config import DEFAULT_CONFIG, ConfigError, load_config, register_config
from lifecycle.core.errors import disk_full_hint, one_line, without_sql
from lifecycle.core.procs import Terminated
from lifecycle.tasks.stages import NAMES as STAGES

START_ENV = dict(os.environ)  # the command's environment before `prepare_environment`: the embedded runner's
EMBEDDED_USED: str | None = None  # the work dir whose embedded Prefect server this (cold) run used


def cmd_run(args: argparse.Namespace) -> int:
    cfg, checked = checked_config(args)
    from lifecycle.core.locking import WorkdirBusy, workdir_lock

    t0 = time.time()
    io = RunOutput(sys.stdout, sys.stderr, None)  # the log capture replaces them once the work dir is held
    signal.signal(signal.SIGTERM, Terminated.raise_for)  # Prefect swaps in its own during the flow, then re-sends it here
    try:
        with workdir_lock(cfg.workdir, wait=args.wait, holder="lifecycle run"):
            summary = run_flow(args, cfg, checked, io)
    except WorkdirBusy as e:
        print(f"lifecycle run: error: {e}", file=io.err)
        if args.json:
            print(json.dumps({"status": "busy", "workdir": cfg.workdir, "error": str(e)}), file=io.out)
        return 3
    except (KeyboardInterrupt, Terminated) as e:
        return interrupted(e, args, io)
    except Exception as e:  # the flow has logged the traceback; report and fail
        print(f"lifecycle run: run failed: {type(e).__name__}: {without_sql(one_line(str(e)))}"  # one line, as every error
              + disk_full_hint(e, cfg.workdir) + (f" (traceback and library logs: {io.log})" if io.log else ""),
              file=io.err)
        if args.json:
            print(json.dumps({"status": "failed", "workdir": cfg.workdir, "error": f"{type(e).__name__}: {e}"}),
                  file=io.out)
        return 1
    summary["elapsed_s"] = round(time.time() - t0, 1)
    if io.log:
        summary["log"] = str(io.log)
    if args.json:
        print(json.dumps(summary), file=io.out)
    else:
        from lifecycle.console import print_summary

        print_summary(summary, io.out)
    return 0


def checked_config(args: argparse.Namespace):
    """The run's config and preflight (`lifecycle.preflight.Checked`): what a run needs, checked before Prefect."""
    cfg = load_config(args.config, args.set or [])  # a ConfigError is one line and exit 2 (`main`)
    from lifecycle.core.locking import check_workdir

    check_workdir(cfg.workdir)
    from lifecycle.preflight import check_image_patterns, check_patterns, preflight

    if cfg.image_collect.enabled:  # the image path reads image_collect.inputs, not collect.inputs
        check_image_patterns(cfg.image_collect.inputs)
    else:
        check_patterns("collect.inputs", cfg.collect.inputs)  # an empty glob, an unreadable file, a bad URL: one line

    checked = preflight(cfg, args.until)  # files, packages and servers the stages need: one line, before Prefect
    return checked.config, checked


@dataclass
class RunOutput:
    """Where `lifecycle run` writes: stdout and stderr (the log capture's copies of them unless -v), and the log."""

    out: TextIO
    err: TextIO
    log: Path | None


def run_flow(args: argparse.Namespace, cfg, checked, io: RunOutput) -> dict:
    """The run, in the held work dir: the console, Prefect's environment, the flow; its summary."""
    global EMBEDDED_USED
    if not args.verbose:  # the libraries' chatter goes to the log file, before any of them is imported
        from lifecycle.console import Capture, log_path_for

        capture = Capture(log_path_for(cfg.workdir))
        io.out, io.err, io.log = capture.out, capture.err, capture.log_path
    from lifecycle.console import RunConsole

    view = RunConsole(io.err if args.json else io.out, max_steps=cfg.train.max_steps,
                      live=False if args.verbose else None)
    view.print(f"lifecycle run {args.config or DEFAULT_CONFIG} -> {cfg.workdir}"
               + (f" (log: {io.log})" if io.log else ""))
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
    return summary


def interrupted(e: KeyboardInterrupt | Terminated, args: argparse.Namespace, io: RunOutput) -> int:
    signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
    from lifecycle.flows.interrupts import cancel_interrupted

    cancel_interrupted()  # a flow run the interrupt ended is Cancelled, not Crashed
    print(f"lifecycle: interrupted by {signal.Signals(signum).name}; the ranks are stopped and the last "
          "committed checkpoint stands (rerun to resume)" + (f"; log: {io.log}" if io.log else ""), file=io.err)
    if args.json:
        print(json.dumps({"status": "interrupted", "signal": signal.Signals(signum).name}), file=io.out)
    return 128 + signum


def left_running(workdir: str) -> str:
    """What an embedded run leaves up for the next one in its work dir, and until when."""
    from lifecycle.flows.startup.embedded import EMBEDDED_IDLE_ENV, EMBEDDED_IDLE_S

    idle = float(os.environ.get(EMBEDDED_IDLE_ENV) or EMBEDDED_IDLE_S)
    return (f"this work dir's Prefect server and a warm runner, for faster later runs; both stop after "
            f"{idle / 60:.0f} min unused, or now with `lifecycle down --workdir {workdir}`")


# Modules that add subcommands (imported lazily, so `lifecycle run` stays fast).
COMMAND_MODULES: list[str] = ["lifecycle.flows.startup.commands", "lifecycle.flows.serve", "lifecycle.tasks.train.plan_cli", "lifecycle.tasks.clip.export", "lifecycle.tasks.eval.code.cli", "lifecycle.lineage.cli"]


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
    from lifecycle.lineage.forget_command import UNKNOWN_INPUTS

    # no config names this work dir's inputs: a placeholder pattern, never read (`forget --retrain` refuses it)
    return validate_config({"workdir": str(wd), "collect": {"inputs": [UNKNOWN_INPUTS]}},
                           origin=f"the built-in defaults for {wd}")



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
    from lifecycle.lineage import forget_command

    forget_command.register(sub, run_config, cmd_run)
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
