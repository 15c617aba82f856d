"""`lifecycle serve [CONFIG] --cron "..."`: serve the lifecycle flow as a Prefect deployment on a schedule.

Schedules need a real Prefect server (the ephemeral one runs no scheduler): `lifecycle up`'s, or the one
`PREFECT_API_URL` names. A run that comes due while the previous one runs is cancelled, not queued (a concurrency
limit of 1, CANCEL_NEW). A run killed under a real server does not stay "Running": served runs send heartbeats,
and `ensure_zombie_automation` marks a run Crashed when they stop; a rerun resumes from what was committed.
Each run reads the YAML when it starts (the deployment's parameters are its path and the `--set` overrides), so
an edited YAML applies to the next run. Runs are incremental unless `--full`: collect takes only the files no
earlier completed run collected, and dedup's persistent index drops what duplicates earlier documents.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from lifecycle.config import DEFAULT_CONFIG, load_config
from lifecycle.core.errors import UsageError
from lifecycle.tasks.stages import NAMES as STAGES


def register(sub) -> None:
    p = sub.add_parser("serve", help="Serve the lifecycle flow as a scheduled Prefect deployment (needs a server).")
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override, as for `run`")
    p.add_argument("--cron", required=True, help='cron schedule, e.g. "0 2 * * *" (UTC unless --timezone)')
    p.add_argument("--timezone", default="UTC", help="IANA time zone of --cron, e.g. Europe/Paris (default UTC)")
    p.add_argument("--name", default=None, help="deployment name (default: the pipeline name)")
    p.add_argument("--until", choices=STAGES, help="each scheduled run stops after this stage")
    p.add_argument("--full", action="store_true",
                   help="collect every input file on each run (default: only files not collected by an earlier "
                   "completed run, i.e. collect.incremental=true)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    # scheduled runs are incremental unless --full (a later --set may still override it); a bad config is one line
    overrides = ([] if args.full else ["collect.incremental=true"]) + (args.set or [])
    cfg = load_config(args.config, overrides)
    from lifecycle.flows.startup.servers import active

    live = active(cfg.workdir)
    if live:
        os.environ["PREFECT_API_URL"] = live["prefect_api"]
        os.environ["MLFLOW_TRACKING_URI"] = live["mlflow"]
    elif not os.environ.get("PREFECT_API_URL"):
        raise UsageError("serve needs a real Prefect server (the ephemeral one runs no scheduler): start one with "
                         "`lifecycle up`, or set PREFECT_API_URL")
    os.environ.setdefault("PREFECT_RUNNER_HEARTBEAT_FREQUENCY", "30")
    ensure_zombie_automation()
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.client.schemas.schedules import CronSchedule

    from lifecycle.flows.pipeline import lifecycle_flow

    name = args.name or cfg.name
    print(serve_message(args.config, name, os.environ["PREFECT_API_URL"]), flush=True)
    lifecycle_flow.serve(
        name=name,
        schedule=CronSchedule(cron=args.cron, timezone=args.timezone),
        # the YAML's path, not its contents: each run reads it when it starts (cfg above only checks it now)
        parameters=deployment_parameters(args.config, overrides, args.until),
        global_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
        description=f"lifecycle pipeline {cfg.name} on {args.cron} ({args.timezone}); work dir {cfg.workdir}; "
                    f"config read from {Path(args.config).resolve()} at each run",
        tags=["lifecycle"],
        print_starting_message=False,  # its `prefect deployment run` hint lacks PREFECT_API_URL: ours has it
    )
    return 0


def deployment_parameters(config: str, overrides: list[str], until: str | None) -> dict:
    """The served deployment's parameters: the config file (absolute) and the overrides, read at each run."""
    return {"config_file": str(Path(config).resolve()), "overrides": overrides, "until": until}


def serve_message(config: str, name: str, api_url: str) -> str:
    """What `serve` prints: that the YAML is read at each run, and a `prefect deployment run` command that works
    pasted into any shell (it names the server; Prefect's own hint assumes PREFECT_API_URL is exported)."""
    prefect = Path(sys.executable).parent / "prefect"
    cmd = f"PREFECT_API_URL={shlex.quote(api_url)} {shlex.quote(str(prefect))} deployment run " \
          f"{shlex.quote(f'lifecycle/{name}')}"
    return (f"serving deployment lifecycle/{name}; each run reads {Path(config).resolve()} when it starts (edits apply "
            f"to the next run; --set, --until and --cron are fixed until serve restarts)\n"
            f"start a run now with:\n  {cmd}")


ZOMBIE_AUTOMATION = "lifecycle-zombie-runs"


def ensure_zombie_automation(silence_s: int = 90) -> None:
    """Mark a flow run Crashed when its heartbeats stop (Prefect's documented zombie-run recipe)."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    try:
        if Automation.read(name=ZOMBIE_AUTOMATION):
            return
    except ValueError:  # not found
        pass
    Automation(
        name=ZOMBIE_AUTOMATION,
        description=f"A running flow run without a heartbeat for {silence_s} s is marked Crashed.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match={"prefect.resource.id": ["prefect.flow-run.*"]},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=silence_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"No heartbeat for {silence_s} s: the run's process died")],
    ).create()
