"""The lifecycle flow: wires the eight stages together. It computes nothing itself.

collect -> filter -> dedup -> scrub -> tokenize -> train -> evaluate -> checkpoint (+ register)

Each stage returns a small reference (a `DatasetRef`, a `TrainResult`, metrics); rows stay in Parquet.
Every stage is logged to its own nested MLflow run under one parent run per flow run.
"""


import json
import tempfile
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.context import get_run_context

from flows.stage_tasks import ShardRunner, plain_task, shard_task, stage_task
from lifecycle.config import STAGES, PipelineConfig
from lifecycle.dataset import DatasetRef, RawFile, commit_plan
from lineage.card import model_card
from lineage.charts import funnel_png, loss_png
from lineage.tracking import Tracker
from tasks import checkpoint as ckpt_mod
from tasks import model as model_mod
from tasks import train_loop as loop_mod
from tasks.collect import plan_collect, record_collected, resolve_inputs
from tasks.dedup import plan_signatures, run_dedup
from tasks.evaluate import check_contamination, run_evaluate
from tasks.filter import plan_filter
from tasks.package import package_model, warm_start
from tasks.scrub import plan_scrub
from tasks.tokenizer import run_tokenize
from tasks.train import run_train


def funnel_metrics(ref: DatasetRef) -> dict[str, float]:
    stats = ref.manifest().get("stats") or {}
    out = {k: stats[k] for k in ("rows_in", "rows_kept", "rows_rejected", "bytes_in", "bytes_out") if k in stats}
    out.update({f"rejected.{k}": v for k, v in stats.get("rejected_by_reason", {}).items()})
    out.update({f"count.{k}": v for k, v in stats.get("counters", {}).items()})
    return out


def _outcome(state, value: Any) -> str:
    if state.name == "Cached":
        return "cached"
    if getattr(value, "reused", False) or getattr(value, "launched", True) is False:
        return "reused"
    return "computed"


def _call(task_fn, *args, **kwargs) -> tuple[Any, str]:
    """Run a stage task; if Prefect's cache points at a dataset that is gone, refresh it."""
    state = task_fn(*args, return_state=True, **kwargs)
    value = state.result()
    if state.name == "Cached" and isinstance(value, DatasetRef) and not value.manifest_path.exists():
        state = task_fn.with_options(refresh_cache=True)(*args, return_state=True, **kwargs)
        value = state.result()
    return value, _outcome(state, value)


def _log_charts(tracker: Tracker, summary: dict, train_rows: list[dict] | None) -> None:
    """funnel.png (documents kept per stage, top drop reasons) and loss_curves.png on the parent run."""
    manifests = {s: json.loads(Path(p).read_text()) for s, p in summary["datasets"].items()}
    with tempfile.TemporaryDirectory() as tmp:
        tracker.log_file(funnel_png(manifests, Path(tmp) / "funnel.png"))
        if train_rows:
            m = summary["metrics"]
            tracker.log_file(loss_png(train_rows, Path(tmp) / "loss_curves.png", m.get("val_loss"), m.get("step")))


def _log_card(tracker: Tracker, summary: dict, model_ref: DatasetRef, cfg: PipelineConfig, examples: list) -> None:
    """model_card.md on the parent run: every lineage fact of the registered version."""
    parent = tracker.client.get_run(tracker.parent_id)
    manifests = {s: json.loads(Path(p).read_text()) for s, p in summary["datasets"].items()}
    configs = {s: json.dumps(m.get("config"), sort_keys=True) for s, m in manifests.items() if s != "checkpoint"}
    configs["train"] = json.dumps(cfg.train.model_dump(mode="json"), sort_keys=True)
    configs["evaluate"] = json.dumps(cfg.evaluate.model_dump(mode="json"), sort_keys=True)
    card = model_card(name=summary["model"]["name"], version=summary["model"]["version"], run_id=tracker.parent_id,
                      prefect_flow_run_id=summary["prefect_flow_run_id"], tags=parent.data.tags,
                      lineage=json.loads((model_ref.dir / "lineage.json").read_text()), stage_configs=configs,
                      metrics=summary["metrics"], promotion=summary["promotion"], examples=examples)
    tracker.log_text(card, "model_card.md")


def _warm_start(tracker: Tracker, cfg: PipelineConfig, summary: dict):
    """`train.init_from: champion`: (champion's weights, tokenize config using its tokenizer) when the model
    config is unchanged, else (None, the configured tokenize config). The decision goes on the parent run."""
    found = tracker.champion_package()
    weights, reason = (None, "no champion registered yet") if found is None else warm_start(found[1], cfg.train)
    tok_cfg = cfg.tokenize
    if weights is not None:
        tok_cfg = cfg.tokenize.model_copy(update={"tokenizer_file": str(found[1] / "tokenizer.json")})
    decision = {"from_version": found[0] if weights else None, "weights": str(weights) if weights else None,
                "reason": reason}
    summary["warm_start"] = decision
    tracker.client.set_tag(tracker.parent_id, "lifecycle.warm_start", json.dumps(decision))
    print(f"[train] warm start: {'champion version ' + found[0] if weights else 'from scratch'} ({reason})")
    return weights, tok_cfg


@flow(name="lifecycle", log_prints=True)
def lifecycle_flow(config: PipelineConfig, until: str | None = None) -> dict:
    cfg, wd = config, config.workdir
    Path(wd).mkdir(parents=True, exist_ok=True)
    orch = cfg.orchestration
    stop_after = STAGES.index(until) if until else len(STAGES) - 1
    flow_run = get_run_context().flow_run
    tracker = Tracker(cfg.tracking, wd, cfg.name)
    run_id = tracker.start(
        run_name=flow_run.name,
        config=cfg,
        tags={"prefect.flow_run_id": str(flow_run.id), "lifecycle.workdir": wd, "lifecycle.until": until or "end"},
    )
    summary: dict[str, Any] = {"status": "running", "workdir": wd, "mlflow_run_id": run_id,
                               "mlflow_tracking_uri": tracker.uri, "prefect_flow_run_id": str(flow_run.id),
                               "datasets": {}, "stages": {}, "checkpoint": None, "model": None, "promotion": None,
                               "metrics": {}}

    def record(stage: str, stage_cfg, parent: DatasetRef | None, ref: DatasetRef, outcome: str,
               metrics: dict | None = None) -> DatasetRef:
        # collect's raw files are those its manifest holds (an incremental run skips collected ones)
        raw = [RawFile(**r) for r in ref.manifest()["inputs"]] if parent is None else []
        tracker.log_stage(stage, stage_cfg, outcome, inputs=[parent] if parent else [], outputs=[ref],
                          raw_inputs=raw, metrics={**funnel_metrics(ref), **(metrics or {})})
        summary["datasets"][stage] = str(ref.manifest_path)
        summary["stages"][stage] = outcome
        print(f"[{stage}] {outcome}: {ref.num_rows} rows -> {ref.path}")
        return ref

    def data_stage(stage: str, fn, parent: DatasetRef | None, stage_cfg, **kw) -> DatasetRef:
        t = stage_task(fn, stage, orch, orch.data_retries)
        args = (parent, stage_cfg, wd) if parent is not None else (stage_cfg, wd)
        ref, outcome = _call(t, *args, **kw)
        return record(stage, stage_cfg, parent, ref, outcome)

    def build_sharded(stage: str, plan_fn, *args, **kw) -> tuple[DatasetRef, str, dict]:
        """plan -> one task per shard on the shard runner (Dask) -> commit. A committed dataset with the same
        fingerprint is reused; after a crash only the shards without a published marker run again."""
        plan = plain_task(plan_fn, f"{stage}-plan")(*args, **kw)
        if isinstance(plan, DatasetRef):
            return plan, "reused", {}
        reused = len(plan.done_shards())
        print(f"[{stage}] {len(plan.shards)} shards ({reused} already built by an earlier attempt)")
        shards.map(shard_task(stage, orch, orch.data_retries), plan, len(plan.shards))
        ref = plain_task(commit_plan, f"{stage}-commit")(plan)
        return ref, "resumed" if reused else "computed", {"shards": len(plan.shards), "shards_reused": reused}

    def sharded_stage(stage: str, plan_fn, parent: DatasetRef | None, stage_cfg, **kw) -> DatasetRef:
        args = (parent, stage_cfg, wd) if parent is not None else (stage_cfg, wd)
        ref, outcome, metrics = build_sharded(stage, plan_fn, *args, **kw)
        return record(stage, stage_cfg, parent, ref, outcome, metrics=metrics)

    def dedup_stage(stage: str, _fn, parent: DatasetRef, stage_cfg) -> DatasetRef:
        """Signatures shard by shard (the costly half, resumable per shard), then one task for the global
        decisions (exact copies, LSH clusters, the index) over them."""
        sigs, sig_outcome, metrics = build_sharded("dedup-signatures", plan_signatures, parent, stage_cfg, wd)
        print(f"[dedup] signatures {sig_outcome}: {sigs.num_rows} rows -> {sigs.path}")
        t = stage_task(run_dedup, stage, orch, orch.data_retries)
        ref, outcome = _call(t, parent, stage_cfg, wd, signatures=sigs, memory_limit=orch.dedup_memory_limit)
        if outcome == "computed" and sig_outcome == "resumed":
            outcome = "resumed"
        return record(stage, stage_cfg, parent, ref, outcome, metrics=metrics)

    def done(stage: str) -> bool:
        return STAGES.index(stage) >= stop_after

    shards = ShardRunner(orch)
    try:
        inputs = plain_task(resolve_inputs, "resolve-inputs")(cfg.collect.inputs)
        ref = collected = sharded_stage("collect", plan_collect, None, cfg.collect, inputs=inputs)
        if cfg.collect.incremental and not ref.manifest()["inputs"]:
            print(f"[collect] no new input files: all {len(inputs)} were collected by earlier runs; nothing to do")
            summary["status"] = "no_new_inputs"
            tracker.end("FINISHED")
            return summary
        init_weights, stage_cfgs = None, {s: getattr(cfg, s) for s in ("filter", "dedup", "scrub", "tokenize")}
        if cfg.train.init_from == "champion" and not done("scrub"):
            init_weights, stage_cfgs["tokenize"] = _warm_start(tracker, cfg, summary)
        for stage, fn, run_stage in (("filter", plan_filter, sharded_stage), ("dedup", None, dedup_stage),
                                     ("scrub", plan_scrub, sharded_stage), ("tokenize", run_tokenize, data_stage)):
            if done(STAGES[STAGES.index(stage) - 1]):
                break
            ref = run_stage(stage, fn, ref, stage_cfgs[stage])
        shards.close()  # the Dask cluster is not needed past the data stages
        tokens = ref
        if not done("tokenize"):
            train_t = stage_task(run_train, "train", orch, orch.train_retries,
                                 extra_modules=(model_mod, loop_mod, ckpt_mod))
            result, outcome = _call(train_t, tokens, cfg.train, wd,
                                    init_weights=str(init_weights) if init_weights else None)
            rows = [json.loads(l) for l in Path(result.metrics_path).read_text().splitlines() if l.strip()]
            tracker.log_stage("train", cfg.train, outcome, inputs=[tokens],
                              metrics={"final_loss": result.final_loss, "steps": result.steps},
                              tags={"lifecycle.checkpoint": result.checkpoint_dir,
                                    "lifecycle.resumed_from": str(result.resumed_from)})
            tracker.log_series("train", rows, [k for k in ("loss", "lr", "val_loss") if any(k in r for r in rows)])
            summary["stages"]["train"] = outcome
            summary["checkpoint"] = result.checkpoint_dir
            summary["metrics"].update({"train_loss": result.final_loss, "train_steps": result.steps})
            print(f"[train] {outcome}: step {result.steps}, loss {result.final_loss:.4f} -> {result.checkpoint_dir}")
        if not done("train"):
            eval_t = stage_task(run_evaluate, "evaluate", orch, orch.data_retries, extra_modules=(model_mod,))
            evaluation, outcome = _call(eval_t, result.checkpoint_dir, tokens, cfg.evaluate)
            metrics = evaluation["metrics"]
            tracker.log_stage("evaluate", cfg.evaluate, outcome, inputs=[tokens], metrics=metrics)
            tracker.log_json(evaluation["examples"], "eval_examples.json", stage="evaluate")
            tracker.log_json(evaluation["examples"], "eval_examples.json")
            summary["stages"]["evaluate"] = outcome
            summary["metrics"].update(metrics)
            print(f"[evaluate] {outcome}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            check_contamination(metrics, cfg.evaluate)  # after logging, so a failed run still shows the rate
        if not done("evaluate"):
            pkg_t = stage_task(package_model, "checkpoint", orch, orch.data_retries, extra_modules=(ckpt_mod,))
            model_ref, outcome = _call(pkg_t, result.checkpoint_dir, tokens, wd)
            tracker.log_stage("checkpoint", {"checkpoint_dir": result.checkpoint_dir}, outcome, inputs=[tokens],
                              outputs=[model_ref])
            summary["datasets"]["checkpoint"] = str(model_ref.manifest_path)
            summary["stages"]["checkpoint"] = outcome
            name, version = tracker.register_or_reuse(model_ref, summary["metrics"])
            summary["model"] = {"name": name, "version": version}
            summary["promotion"] = tracker.promotion(name, version)
            print(f"[checkpoint] {outcome}: registered {name} version {version}; "
                  f"champion: {summary['promotion'].get('decision')} ({summary['promotion'].get('reason')})")
            _log_card(tracker, summary, model_ref, cfg, evaluation["examples"])
        _log_charts(tracker, summary, rows if "train" in summary["stages"] else None)
        tracker.log_parent_metrics({k: v for k, v in summary["metrics"].items() if isinstance(v, (int, float))})
        # every completed run records its raw files, so that a later incremental run skips them
        n = plain_task(record_collected, "record-collected")(wd, collected)
        print(f"[collect] ledger: {n} new input file(s) recorded in {wd}/collected.parquet")
        summary["status"] = "completed"
        tracker.end("FINISHED")
    except BaseException:
        tracker.end("FAILED")
        raise
    finally:
        shards.close()
    return summary
