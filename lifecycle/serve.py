"""`lifecycle serve [CONFIG] --cron "..."`: serve the lifecycle flow as a Prefect deployment on a schedule.

Schedules need a real Prefect server (the ephemeral one runs no scheduler): the work dir's server from
`lifecycle up`, or the one `PREFECT_API_URL` names. Overlapping runs are refused, not queued into a
burst: the deployment has a concurrency limit of 1 with the CANCEL_NEW collision strategy, so a run that
comes due while the previous one is still running is cancelled.
"""

from __future__ import annotations

import os
import sys

from lifecycle.config import DEFAULT_CONFIG, STAGES, ConfigError, load_config


def register(sub) -> None:
    p = sub.add_parser("serve", help="Serve the lifecycle flow as a scheduled Prefect deployment (needs a server).")
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override, as for `run`")
    p.add_argument("--cron", required=True, help='cron schedule, e.g. "0 2 * * *" (UTC unless --timezone)')
    p.add_argument("--timezone", default="UTC")
    p.add_argument("--name", default=None, help="deployment name (default: the pipeline name)")
    p.add_argument("--until", choices=STAGES, help="each scheduled run stops after this stage")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    try:
        cfg = load_config(args.config, args.set or [])
    except ConfigError as e:
        print(f"lifecycle: {e}", file=sys.stderr)
        return 2
    from lifecycle import servers

    live = servers.active(cfg.workdir)
    if live:
        os.environ["PREFECT_API_URL"] = live["prefect_api"]
        os.environ["MLFLOW_TRACKING_URI"] = live["mlflow"]
    elif not os.environ.get("PREFECT_API_URL"):
        print("lifecycle: serve needs a real Prefect server (the ephemeral one runs no scheduler): "
              "start one with `lifecycle up`, or set PREFECT_API_URL", file=sys.stderr)
        return 2
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", os.path.join(cfg.workdir, ".prefect-results"))
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.client.schemas.schedules import CronSchedule

    from flows.lifecycle import lifecycle_flow

    lifecycle_flow.serve(
        name=args.name or cfg.name,
        schedule=CronSchedule(cron=args.cron, timezone=args.timezone),
        parameters={"config": cfg.model_dump(mode="json"), "until": args.until},
        global_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
        description=f"lifecycle pipeline {cfg.name} on {args.cron} ({args.timezone}); work dir {cfg.workdir}",
        tags=["lifecycle"],
    )
    return 0
