"""The `lifecycle up`, `lifecycle down` and `lifecycle status` commands (flows/startup/servers.py does the work)."""

from __future__ import annotations

import json
from pathlib import Path

from lifecycle.flows.startup.servers import down, status, up


def register(sub) -> None:
    from lifecycle.config import DEFAULT_CONFIG

    for name, fn, help_ in (("up", cmd_up, "Start a Prefect and an MLflow server for the work dir."),
                            ("down", cmd_down, "Stop the servers `up` started for the work dir."),
                            ("status", cmd_status, "Show the work dir's servers.")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config", nargs="?", help=f"config whose work dir to use (default {DEFAULT_CONFIG})")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override (e.g. workdir=...)")
        p.add_argument("--json", action="store_true", help="Print one JSON object.")
        if name == "up":
            p.add_argument("--prefect-port", type=int, help="the Prefect server's port (default 4200; a running "
                           "server on another port: refused)")
            p.add_argument("--mlflow-port", type=int, help="the MLflow server's port (default 5000; a running "
                           "server on another port: refused)")
            p.add_argument("--no-runner", action="store_true", help="start no warm runner (lifecycle/launch.py): "
                           "every `lifecycle run` then imports Prefect and MLflow itself (~4 s more each)")
        p.set_defaults(func=fn, names_run=True)  # the work dir: `lifecycle` resolves it (args.workdir)


def _workdir(args) -> Path:
    return Path(args.workdir).resolve()


def _print(args, obj, text: str) -> None:
    print(json.dumps(obj) if args.json else text)


def cmd_up(args) -> int:
    st = up(_workdir(args), args.prefect_port, args.mlflow_port, runner=not args.no_runner)
    _print(args, st, "\n".join(f"{n}: {e['url']} (pid {e['pid']}, log {e['log']})" for n, e in st.items())
           + f"\nlifecycle run now uses these servers. Prefect UI: {st['prefect']['url']}  MLflow UI: {st['mlflow']['url']}")
    return 0


def cmd_down(args) -> int:
    stopped = down(_workdir(args))
    _print(args, {"stopped": stopped}, f"stopped: {', '.join(stopped) or 'nothing was running'}")
    return 0


def cmd_status(args) -> int:
    st = status(_workdir(args))
    _print(args, st, "\n".join(f"{n}: {'up' if e['healthy'] else 'running' if e['running'] else 'down'} {e['url']}"
                               + (f" (its main process pid {e['pid']} is gone; pids {e['leftover_pids']} still run: "
                                  "`lifecycle down` stops them)" if e.get("leftover_pids") else "")
                               for n, e in st.items()) or "no servers started for this work dir")
    return 0
