"""`lifecycle forget ID... --reason TEXT [--retrain | --unlearn]`: the command over `forgetting.py`.

lifecycle/cli.py registers it (`register`) and hands it the two things above this layer: how a command's run is
named (`run_config`) and `lifecycle run` itself, which `--retrain` calls with the same config.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys

from lifecycle.core.errors import UsageError
from lifecycle.core.paths import DEFAULT_CONFIG
from lifecycle.core.procs import Terminated

UNKNOWN_INPUTS = "<the inputs of a config not named>"
"""The collect pattern of a run no config names (lifecycle/cli.py `run_config`): never read; `--retrain` refuses it."""


def cmd_forget(args: argparse.Namespace, run_config, run) -> int:
    """Tombstone the documents (lineage/forgetting.py), then retrain (`lifecycle run` with the same config) or
    unlearn from the champion; neither flag only records the request (the next run honours it)."""
    from lifecycle.core.locking import check_workdir, workdir_lock
    from lifecycle.tasks.eval.unlearn import UnlearnConfig

    if args.retrain and args.unlearn:
        raise UsageError("choose one route: --retrain or --unlearn")
    cfg = run_config(args)
    if args.retrain and cfg.collect.inputs == [UNKNOWN_INPUTS]:
        raise UsageError(f"--retrain reruns the lifecycle of {cfg.workdir} on its inputs: name its config (--config)")
    ucfg = UnlearnConfig(**unlearn_knobs(args.unlearn_set or []))
    check_workdir(cfg.workdir)
    from lifecycle.lineage.forgetting import image_path, record_request, taint_versions

    if args.unlearn and image_path(cfg):
        raise UsageError("--unlearn is for the text path's language model; forget an image with --retrain (or "
                         "record it now and rerun the lifecycle)")
    info = sys.stderr if args.json else sys.stdout
    print(f"forget: work dir {cfg.workdir} (from {args.workdir_from})", file=info)
    with workdir_lock(cfg.workdir, wait=args.wait, holder="lifecycle forget"):
        rows = record_request(cfg, args.ids, args.reason)
        tainted = taint_versions(cfg, rows)
    print_recorded(cfg, rows, tainted, info, image_path(cfg))
    if args.retrain:
        # a rebuild of the whole corpus without the documents, not a run on new data: deduplicated within itself,
        # not against the dedup index and paragraph filter of earlier runs (they hold the forgotten document's
        # signature and paragraphs)
        rebuild = (args.set or []) + ["collect.incremental=false", "dedup.incremental=false",
                                      f"workdir={json.dumps(cfg.workdir)}"]
        print("retraining: a full run (collect.incremental=false, dedup.incremental=false)", file=info)
        return run(argparse.Namespace(config=args.config, set=rebuild, until=None, json=args.json,
                                      verbose=args.verbose, wait=args.wait, command_start=args.command_start,
                                      launch=args.launch))
    result = {"status": "recorded", "tombstones": rows, "tainted_versions": tainted}
    if args.unlearn:
        unlearned = unlearn(args, cfg, ucfg, rows, tainted, info)
        if isinstance(unlearned, int):
            return unlearned
        result = unlearned
    else:
        where = "images at image_collect" if image_path(cfg) else "documents at collect"
        print(f"recorded; the next `lifecycle run` rejects these {where} (reason `forgotten`)", file=info)
    if args.json:
        print(json.dumps(result, default=str))
    return 0 if result["status"] != "refused" else 4


def unlearn_knobs(items: list[str]) -> dict:
    """`--unlearn-set FIELD=VALUE` items as a dict, each VALUE parsed as YAML."""
    import yaml

    knobs = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(f"--unlearn-set {item!r}: expected FIELD=VALUE")
        knobs[key] = yaml.safe_load(value)
    return knobs


def print_recorded(cfg, rows: list[dict], tainted: list[str], info, images: bool = False) -> None:
    kind, ledger = ("image_id", "image_tombstones.parquet") if images else ("doc_id", "tombstones.parquet")
    for r in rows:
        print(f"tombstone {r['tombstone_id']}: {kind} {r['doc_id']} source_id {r['source_id']} ({r['reason']}, "
              f"{r['created_at']}) in {cfg.workdir}/{ledger}", file=info)
    if tainted:
        print(f"model versions trained on them, tagged lifecycle.forget.tainted: {', '.join(tainted)} (a tainted "
              "champion gives way to the next version without them and is no warm start)", file=info)
        if images:
            print("they still hold the images: retrain (`--retrain`, or the next `lifecycle run`) to register a "
                  "version without them", file=info)


def unlearn(args: argparse.Namespace, cfg, ucfg, rows: list[dict], tainted: list[str], info) -> dict | int:
    """`--unlearn`: the result to report, or the exit status when a signal stopped it."""
    from lifecycle.core.locking import workdir_lock
    from lifecycle.lineage.forgetting import unlearn_champion

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
    return result


def register(sub, run_config, run) -> None:
    """The `forget` parser; `run_config(args)` is the config of the run it names, `run(args)` is `lifecycle run`."""
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
    p.set_defaults(func=functools.partial(cmd_forget, run_config=run_config, run=run), names_run=True)
