"""`StageRunner` runs a registered stage as Prefect tasks; `RunSummary` is what a flow run did."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from pydantic import BaseModel

from lifecycle.core.dataset import StageStats
from lifecycle.core.shards import SHARD_MARKER, StagePlan, commit_plan
from lifecycle.flows.reporting import Reporter
from lifecycle.flows.retry import plain_task, stage_task
from lifecycle.flows.shards import ShardRunner


class RunSummary(BaseModel):
    """What a flow run did: returned by the flow, printed by `lifecycle run`, the last line under `--json`."""

    status: str = "running"
    workdir: str
    mlflow_run_id: str | None = None
    mlflow_tracking_uri: str | None = None
    prefect_flow_run_id: str | None = None
    datasets: dict[str, str] = {}
    """Each stage's committed `_manifest.json`."""
    stages: dict[str, str] = {}
    """computed, resumed (some shards came from an earlier attempt) or reused, per stage."""
    skipped: dict[str, str] = {}
    """Enabled stages that did not run, with the reason (perplexity with no champion registered)."""
    checkpoint: str | None = None
    model: dict[str, str] | None = None
    promotion: dict[str, Any] | None = None
    warm_start: dict[str, Any] | None = None
    metrics: dict[str, Any] = {}
    artifacts: dict[str, str] = {}
    """Where the parent MLflow run's charts and model card are: {funnel, loss_curves, model_card} -> artifact URI."""
    timing: dict[str, float] = {}
    """Where the run's wall time went (bench/run_overhead.py reads it). Epoch seconds: `command_start` (the
    `lifecycle` command's first line), `prefect_start`, `prefect_launched` (the embedded Prefect server found, or
    launched), `imports_done` (Prefect and the flow's modules imported meanwhile), `prefect_ready` (the server
    answers), `flow_call`, then
    `flow_start` (the flow function entered), `tracker_ready` (MLflow run open), `first_stage_start`,
    `last_stage_end`, `flow_end`, and `dask_start`/`dask_ready`/`dask_close_start`/`dask_closed` when the shard
    cluster ran; `stage:<name>`: each stage's duration in seconds, `stage_start:<name>` its start (epoch)."""


def outcome_of(value: Any) -> str:
    if getattr(value, "reused", False) or getattr(value, "launched", True) is False:
        return "reused"
    return "computed"


class StageRunner:
    """Runs registered stages (`lifecycle.tasks.stages`) as Prefect tasks, in the flow's order, up to `until`.

    `runner(STAGE, *parents, **kw)` calls the stage's entry points with (*parents, its config section, work dir,
    **kw): a sharded stage is planned, its missing shards mapped over the shard runner (`ShardRunner`) and
    committed; a single-task stage is one task. It returns the stage's output (a `DatasetRef`, or the train
    stage's `TrainResult`), or None once a stage at or after `until` has run, so the flow reads top to bottom.
    Each stage's outcome and manifest go into `summary`, its times into `summary.timing`;
    `on_done(stage, output, outcome, extra, section)` is called after each stage (the flow logs it to MLflow
    there); `reporter` hears each stage start and its shards' progress.
    """

    def __init__(self, cfg, summary: RunSummary, until: str | None, on_done: Callable,
                 shards: ShardRunner | None = None, reporter: Reporter | None = None):
        self.cfg, self.summary, self.on_done = cfg, summary, on_done
        self.until = until
        self.timing = summary.timing
        self.shards = shards if shards is not None else ShardRunner(cfg.orchestration, self.timing)
        self.reporter = reporter if reporter is not None else Reporter()

    def wants(self, stage) -> bool:
        """Whether `stage` will run (it is not past `until`)."""
        from lifecycle.tasks.stages import NAMES

        return self.until is None or NAMES.index(stage.name) <= NAMES.index(self.until)

    def __call__(self, stage, *parents, config: Any = None, **kw) -> Any:
        if not self.wants(stage):
            return None
        if stage.group != "data":
            self.shards.close_soon()  # the shard workers are not needed past the data stages
        orch = self.cfg.orchestration
        section = config if config is not None else (getattr(self.cfg, stage.name) if stage.configured else None)
        args = (*parents, *([section] if stage.configured else []), self.cfg.workdir)
        retries = orch.train_retries if stage.group == "train" else orch.data_retries
        extra: dict[str, Any] = {}
        outcome = None
        started = time.time()
        self.timing.setdefault("first_stage_start", started)
        self.timing[f"stage_start:{stage.name}"] = started
        self.reporter.stage_started(stage.name)
        if stage.plan:
            name = stage.sharded_name or stage.name
            ref, outcome, extra = self._sharded(stage.name, name, stage.entry("plan"), args, {} if stage.run else kw,
                                                retries)
            if stage.run:
                kw = {**kw, stage.sharded_arg: ref}
        if stage.run:
            value = stage_task(stage.entry("run"), stage.name, orch, retries)(*args, **kw)
            own = outcome_of(value)
            outcome = "resumed" if own == "computed" and outcome == "resumed" else own
        else:
            value = ref
        self.summary.stages[stage.name] = outcome
        if hasattr(value, "manifest_path"):
            self.summary.datasets[stage.name] = str(value.manifest_path)
        self.on_done(stage, value, outcome, extra, section)
        self.timing["last_stage_end"] = time.time()  # the workers' shutdown below is overhead, not the stage's
        self.timing[f"stage:{stage.name}"] = round(self.timing["last_stage_end"] - started, 4)
        if self.until == stage.name:
            self.shards.close_soon()
        return value

    def _sharded(self, stage: str, name: str, plan_fn: Callable, args: tuple, kw: dict, retries: int):
        """plan -> one task per missing shard on the shard runner -> commit. Returns (ref, outcome, metrics).
        `name`: the sharded dataset (dedup's is dedup-signatures); progress is reported for `stage`."""
        plan = plain_task(plan_fn, f"{name}-plan")(*args, **kw)
        if not isinstance(plan, StagePlan):
            return plan, "reused", {}
        reused = len(plan.done_shards())
        plain_task(self.shards.map, f"{name}-shards")(plan, len(plan.shards), retries,
                                                      on_progress=_ShardProgress(plan, stage, self.reporter))
        ref = plain_task(commit_plan, f"{name}-commit")(plan)
        return ref, "resumed" if reused else "computed", {"shards": len(plan.shards), "shards_reused": reused}

    def close(self) -> None:
        self.shards.close()


class _ShardProgress:
    """Reads the stats of newly published shards (their `_shard.json`) and reports the running total."""

    def __init__(self, plan: StagePlan, stage: str, rep: Reporter):
        self.plan, self.stage, self.reporter = plan, stage, rep
        self.seen: set[int] = set()
        self.stats = StageStats()

    def __call__(self) -> None:
        new = [i for i in self.plan.done_shards() if i not in self.seen]
        for i in new:  # a published shard directory is complete (renamed into place after its marker)
            marker = json.loads((self.plan.shard_dir(i) / SHARD_MARKER).read_text())
            self.stats = self.stats + StageStats.from_dict(marker["stats"])
            self.seen.add(i)
        if new:
            self.reporter.shards_done(self.stage, len(self.seen), len(self.plan.shards), self.stats.to_dict())
