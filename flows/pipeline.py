"""The lifecycle flow: the README's diagram, one registered stage per line. It computes nothing itself.

collect -> filter -> dedup -> scrub [-> decontaminate -> quality -> perplexity -> select] -> tokenize -> train
-> evaluate -> checkpoint (+ register); the bracketed stages are off unless their config section turns them on.
perplexity scores with the registry's champion, found once per run with `train.init_from: champion`'s lookup;
with no champion it is skipped, with the reason on the run (`RunSummary.skipped`, parent-run tag).

Each stage returns a small reference (a `DatasetRef`, or the train stage's `TrainResult`); rows stay in Parquet.
Every stage is logged to its own nested MLflow run under one parent run per flow run (`lineage.tracking`).
"""


import json
import logging
import tempfile
import time
from pathlib import Path

from prefect import flow
from prefect import get_run_logger
from prefect.context import get_run_context

from lifecycle.config import PipelineConfig, load_config
from lifecycle.core.dataset import DatasetDamaged, DatasetRef, RawFile, sha256_json
from lifecycle.core.fs import sha256_file
from lifecycle.core.latest import latest_targets, point_latest
from lifecycle.core.locking import workdir_lock
from lifecycle.flows.interrupts import interrupt_of, note_interrupted
from lifecycle.flows.reporting import Reporter
from lifecycle.flows.retry import plain_task
from lifecycle.flows.shards import ShardRunner
from lifecycle.flows.stage_runner import RunSummary, StageRunner
from lifecycle.lineage import catalog
from lifecycle.preflight import preflight
from lifecycle.lineage.card import model_card
from lifecycle.lineage.charts import funnel_png, loss_png
from lifecycle.lineage.registry import Registry
from lifecycle.lineage.tracking import Tracker
from lifecycle.tasks.data.collect.stage import collect_committed, new_inputs, record_collected, resolve_inputs
from lifecycle.tasks.eval.checkpoint.stage import warm_start
from lifecycle.tasks.eval.evaluate.gate import eval_set_of, rescore_package
from lifecycle.tasks.eval.evaluate.metrics_text import HEADLINE, scale_of, with_scale
from lifecycle.tasks.eval.evaluate.stage import examples_of
from lifecycle.tasks.eval.perplexity.stage import COLUMN as PERPLEXITY_COLUMN, ScoringModel
from lifecycle.tasks.stages import (CHECKPOINT, CLIP_EVALUATE, CLIP_TRAIN, COLLECT, DECONTAMINATE, DEDUP, EVALUATE, FILTER, IMAGE_COLLECT,
                                    IMAGE_DEDUP, IMAGE_FILTER, IMAGE_PREPROCESS, IMAGE_SCRUB, PERPLEXITY, QUALITY,
                                    SCRUB, SELECT, TOKENIZE, TRAIN, enabled, input_of)


log = logging.getLogger(__name__)

# No `from __future__ import annotations` in this module: Prefect builds the flow's parameter model from the
# annotations, and a served deployment cannot resolve `PipelineConfig` from a string.
@flow(name="lifecycle", log_prints=True)
def lifecycle_flow(config: PipelineConfig | None = None, until: str | None = None, config_file: str | None = None,
                   overrides: list[str] | None = None, reporter: Reporter | None = None) -> dict:
    """`config`: the resolved config (`lifecycle run` passes it). Or `config_file` and `overrides` (`--set`
    KEY=VALUE): a YAML file read when the run starts, which is what `lifecycle serve` deploys, so that an edited
    YAML applies to the next scheduled run; its sha256 goes on the flow run's log and the MLflow parent run.
    `reporter`: who hears of the run's progress (`lifecycle run`'s console; by default no one)."""
    flow_start = time.time()
    flow_run = get_run_context().flow_run
    tags = {}
    if (config is None) == (config_file is None):
        raise ValueError("lifecycle_flow takes either `config` or `config_file` (with `overrides`), not both or neither")
    if config_file is not None:
        config = load_config(config_file, overrides or [])
        checked = preflight(config, until)  # what `lifecycle run` checks before Prefect, here at the run's start
        config = checked.config
        for note in checked.notes:
            get_run_logger().info(f"note: {note}")
        tags = {"lifecycle.config_file": str(config_file), "lifecycle.config_file_sha256": sha256_file(config_file)}
        get_run_logger().info(f"config read at run start: {config_file} (file sha256 {tags['lifecycle.config_file_sha256'][:16]}, "
                              f"resolved config sha256 {sha256_json(config.model_dump(mode='json'))[:16]}"
                              + (f", overrides {' '.join(overrides)}" if overrides else "") + ")")
    # one run per work dir: a run `lifecycle serve` starts on its schedule refuses while a manual `lifecycle run`
    # holds the work dir, and the other way round (`lifecycle run` holds it already in this process)
    with workdir_lock(config.workdir, holder=f"flow run {flow_run.name} ({flow_run.id})", reentrant=True):
        return _pipeline(config, until, flow_run, tags, {"flow_start": flow_start},
                         reporter if reporter is not None else Reporter())


def _pipeline(cfg: PipelineConfig, until: str | None, flow_run, tags: dict[str, str], timing: dict,
              reporter: Reporter) -> dict:
    Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
    inputs = plain_task(resolve_inputs, "resolve-inputs")(cfg.collect.inputs)
    if cfg.collect.incremental and not new_inputs(inputs, cfg.workdir):
        # a scheduled tick with nothing new: no dataset, no MLflow run, one line on the flow run
        note = f"no new input files: all {len(inputs)} were collected by earlier runs; nothing to do"
        get_run_logger().info(f"[collect] {note}")
        reporter.note(note)
        return RunSummary(status="no_new_inputs", workdir=cfg.workdir, prefect_flow_run_id=str(flow_run.id),
                          timing={**timing, "flow_end": time.time()}).model_dump()
    shards = ShardRunner(cfg.orchestration, timing)
    if not collect_committed(cfg.collect, cfg.workdir, inputs):  # a rerun that reuses collect starts none early
        shards.start_soon()  # the data stages' workers start while MLflow sets up
    tracker, summary, logger, run = _open_run(cfg, until, flow_run, tags, timing, reporter, shards)
    timing["tracker_ready"] = time.time()
    try:
        docs, tokens, trained = _run_stages(run, inputs, cfg, tracker, summary, reporter)
        _finish(cfg, tracker, summary, docs, tokens, trained)
    except BaseException as e:
        signame = interrupt_of(e)
        try:
            logger.stage_failed(e, "KILLED" if signame else "FAILED")
            tracker.end("KILLED" if signame else "FAILED")
        except Exception as end_error:  # e.g. a full disk fails the store too: the run's own error is the news
            log.warning("could not mark the MLflow runs %s: %s", "KILLED" if signame else "FAILED", end_error)
        if signame:  # stopped on purpose: Cancelled, not Crashed, once Prefect's engine has recorded the crash
            note_interrupted(flow_run.id, signame)
        raise
    finally:
        run.close()
    timing["flow_end"] = time.time()
    return summary.model_dump()


def _open_run(cfg: PipelineConfig, until: str | None, flow_run, tags: dict[str, str], timing: dict,
              reporter: Reporter, shards: ShardRunner):
    """(tracker, summary, stage logger, stage runner), with the MLflow parent run started; the shard workers are
    stopped if any of it fails."""
    try:
        tracker = Tracker(cfg.tracking, cfg.workdir, cfg.name)
        summary = RunSummary(workdir=cfg.workdir, mlflow_tracking_uri=tracker.uri,
                             prefect_flow_run_id=str(flow_run.id))
        summary.timing = timing  # the very dict the workers' start thread writes to (pydantic would copy it)
        logger = _Logger(tracker, summary, reporter)
        run = StageRunner(cfg, summary, until, on_done=logger.stage_done, shards=shards, reporter=reporter)
        # the parent run is named after the pipeline (one parent per config; the Prefect flow run is a tag)
        summary.mlflow_run_id = tracker.start(run_name=cfg.name, config=cfg, tags={
            "prefect.flow_run_id": str(flow_run.id), "lifecycle.workdir": cfg.workdir, "lifecycle.until": until or "end",
            **tags})
    except BaseException:
        shards.close()  # the workers started above
        raise
    return tracker, summary, logger, run


def _run_stages(run: StageRunner, inputs, cfg: PipelineConfig, tracker: Tracker, summary: RunSummary,
                reporter: Reporter):
    """The diagram, one stage per line; (collect's, tokenize's and train's outputs) for the end of the run."""
    if cfg.image_collect.enabled:  # the image-text path instead
        pairs = run(IMAGE_COLLECT)
        clean = run(IMAGE_SCRUB, run(IMAGE_DEDUP, run(IMAGE_FILTER, pairs)))
        shards = run(IMAGE_PREPROCESS, clean)
        model = run(CLIP_TRAIN, shards)
        if (scores := run(CLIP_EVALUATE, model, shards)) is not None:  # the package as a model version
            name, version = Registry(tracker).register_package(model, scores.manifest()["metrics"], "clip")
            summary.model = {"name": name, "version": version}
        return pairs, None, None
    init_weights, tokenize_cfg = None, None
    warm = cfg.train.init_from == "champion" and run.wants(TOKENIZE)
    scoring = enabled(PERPLEXITY, cfg) and run.wants(PERPLEXITY)
    # the champion as this run starts (before it registers a model of its own), looked up once for both,
    # before any stage computes
    registry = Registry(tracker) if warm or scoring else None
    champion = registry.champion_package() if registry is not None else None
    taint = registry.champion_taint() if champion is not None else None  # never a warm start nor a scorer
    if warm:
        init_weights, tokenize_cfg = _warm_start(tracker, champion, taint, cfg, summary, reporter)
    docs = run(COLLECT, inputs=inputs)  # after the registry lookup: a server that fails, fails before compute
    kept = run(FILTER, docs)
    unique = run(DEDUP, kept, memory_limit=cfg.orchestration.dedup_memory_limit)
    clean = run(SCRUB, unique)
    clean = _optional_stages(run, clean, cfg, champion, taint, tracker, summary, reporter)
    tokens = run(TOKENIZE, clean, config=tokenize_cfg)
    trained = run(TRAIN, tokens, init_weights=str(init_weights) if init_weights else None,
                  on_metrics=reporter.train_metrics)
    scores = run(EVALUATE, trained, tokens,  # the data checks ran at tokenize, before training
                 progress=lambda text: reporter.progress("evaluate", text))
    model = run(CHECKPOINT, trained, tokens)
    if model is not None:
        _register(tracker, summary, model, cfg, scores, reporter)
    return docs, tokens, trained


def _optional_stages(run: StageRunner, clean, cfg: PipelineConfig, champion, taint, tracker: Tracker,
                     summary: RunSummary, reporter: Reporter):
    """Optional, off by default: decontaminate, quality, perplexity, select; tokenize then reads scrub's output."""
    for stage in (DECONTAMINATE, QUALITY, PERPLEXITY, SELECT):
        if not enabled(stage, cfg) or not run.wants(stage):
            continue
        if stage is PERPLEXITY:
            model, why = (None, tainted_reason(taint)) if taint else _scoring_model(champion)
            if model is None:
                _skip(tracker, summary, stage, why, reporter)
                continue
            clean = run(stage, clean, model=model)
        elif stage is SELECT and cfg.select.column == PERPLEXITY_COLUMN and PERPLEXITY.name in summary.skipped:
            _skip(tracker, summary, stage, f"select.column is {PERPLEXITY_COLUMN}, which was not scored "
                                           f"(perplexity skipped: {summary.skipped[PERPLEXITY.name]})", reporter)
        else:
            clean = run(stage, clean)
    return clean


def _finish(cfg: PipelineConfig, tracker: Tracker, summary: RunSummary, docs, tokens, trained) -> None:
    """The parent run's charts, metrics and datasets, the collected-files ledger, `latest/`, and the catalog."""
    _log_charts(tracker, summary, trained)
    tracker.log_parent_metrics({k: v for k, v in summary.metrics.items() if isinstance(v, (int, float))})
    tracker.log_parent_datasets([docs], "source")  # what the run read, and what it trained on
    tracker.log_parent_datasets([t for t in (tokens,) if t is not None], "training")
    # every completed run records its raw files, so that a later incremental run skips them
    n = plain_task(record_collected, "record-collected")(cfg.workdir, docs)
    print(f"[collect] ledger: {n} new input file(s) recorded in {cfg.workdir}/collected.parquet")
    # <workdir>/latest/<stage>: this run's datasets, and no link left from an earlier run past its --until
    point_latest(cfg.workdir, latest_targets(summary.datasets, summary.checkpoint), only=True)
    summary.status = "completed"
    tracker.end("FINISHED")
    _update_catalog(cfg.workdir, with_models=True)  # the registry as this run left it


def funnel_metrics(stats: dict) -> dict[str, float]:
    """MLflow metrics of a dataset's manifest `stats`."""
    out = {k: stats[k] for k in ("rows_in", "rows_kept", "rows_rejected", "bytes_in", "bytes_out") if k in stats}
    out.update({f"rejected.{k}": v for k, v in stats.get("rejected_by_reason", {}).items()})
    out.update({f"count.{k}": v for k, v in stats.get("counters", {}).items()})
    return out


class _Logger:
    """After each stage: its MLflow child run (config, outcome, datasets, metrics) and its summary line."""

    def __init__(self, tracker: Tracker, summary: RunSummary, reporter: Reporter):
        self.tracker, self.summary, self.reporter = tracker, summary, reporter
        self.parents: dict[str, DatasetRef] = {}
        self.by_group = {"data": self._data, "train": self._train, "eval": self._eval, "image_model": self._data}  # a stage's group -> its log

    def stage_done(self, stage, value, outcome: str, extra: dict, section) -> None:
        self.tracker.stage_run(stage.name, self.summary.timing.get(f"stage_start:{stage.name}"))
        self.by_group[stage.group](stage, value, outcome, extra, section)
        self.tracker.finish_stage(stage.name)  # the child run spans the stage, in the UI too

    def stage_failed(self, error: BaseException, status: str) -> None:
        """The stage that was running when the run failed gets its own run, FAILED (or KILLED), naming the error."""
        timing = self.summary.timing
        running = [k.removeprefix("stage_start:") for k in timing if k.startswith("stage_start:")
                   and k.removeprefix("stage_start:") not in self.summary.stages]
        for name in running:
            self.tracker.stage_run(name, timing[f"stage_start:{name}"])
            self.tracker.finish_stage(name, status, f"{type(error).__name__}: {error}")

    def _data(self, stage, ref: DatasetRef, outcome: str, extra: dict, section) -> None:
        manifest = ref.manifest()
        stats = manifest.get("stats") or None
        parent = input_of(stage.name, self.parents)  # an optional stage turned off is skipped over
        parents = [self.parents[parent]] if parent in self.parents else []
        raw = [RawFile(**r) for r in manifest["inputs"]] if not stage.parents or stage.optional else []
        tags = {"lifecycle.quality_model_sha256": manifest["model_sha256"]} if "model_sha256" in manifest else {}
        if scorer := manifest.get("scoring_model"):  # perplexity: which registered champion scored the documents
            tags.update({"lifecycle.scoring_model_version": scorer["version"],
                         "lifecycle.scoring_model_package_sha256": scorer["package_sha256"]})
        self.tracker.log_stage(stage.name, section, outcome, inputs=parents, outputs=[ref], raw_inputs=raw,
                               metrics={**funnel_metrics(stats or {}), **manifest.get("metrics", {}), **extra},
                               tags=tags or None)
        self.parents[stage.name] = ref
        _update_catalog(self.summary.workdir, with_models=False)
        print(f"[{stage}] {outcome}: {ref.num_rows} rows -> {ref.path}")
        self.reporter.stage_done(stage.name, outcome, stats, "" if stats else f"{ref.num_rows:,} rows")

    def _train(self, stage, result, outcome: str, extra: dict, section) -> None:
        tokens = self.parents["tokenize"]
        rows = _metrics_rows(result)
        base = [RawFile(path=str(Path(result.base_model) / n), sha256=h, bytes=(Path(result.base_model) / n).stat().st_size)
                for n, h in result.base_model_files.items()]  # the open model continued: a parent of the run
        self.tracker.log_stage("train", section, outcome, inputs=[tokens], raw_inputs=base,
                               metrics={"final_loss": result.final_loss, "steps": result.steps},
                               tags={"lifecycle.checkpoint": result.checkpoint_dir,
                                     "lifecycle.resumed_from": str(result.resumed_from),
                                     "lifecycle.layout": str(result.layout),
                                     **({"lifecycle.layout_change": result.layout_change}
                                        if result.layout_change else {}),
                                     **({"lifecycle.promotions": str(result.promotions)}  # hot spares used
                                        if result.promotions else {})})
        series = ("loss", "lr", "val_loss", "moe_aux_loss", "moe_dropped", "moe_drop_frac", *_per_expert(rows))
        self.tracker.log_series("train", rows, [k for k in series if any(k in r for r in rows)])
        self.summary.checkpoint = result.checkpoint_dir
        self.summary.metrics.update({"train_loss": result.final_loss, "train_steps": result.steps})
        if result.model_params:
            self.summary.metrics["train_params"] = result.model_params
        print(f"[train] {outcome}: step {result.steps}, loss {result.final_loss:.4f} -> {result.checkpoint_dir}")
        self.reporter.stage_done("train", outcome, None, f"step {result.steps}, loss {result.final_loss:.4f}")

    def _eval(self, stage, ref: DatasetRef, outcome: str, extra: dict, section) -> None:
        tokens = self.parents["tokenize"]
        if stage.name == "evaluate":
            metrics = ref.manifest()["metrics"]
            self.tracker.log_stage("evaluate", section, outcome, inputs=[tokens], outputs=[ref], metrics=metrics,
                                   tags={f"lifecycle.scale.{k}": scale_of(k) for k in metrics if scale_of(k)})
            examples = examples_of(ref)
            self.tracker.log_json(examples, "eval_examples.json", stage="evaluate")
            self.tracker.log_json(examples, "eval_examples.json")
            self.summary.metrics.update(metrics)
            print(f"[evaluate] {outcome}: " + ", ".join(with_scale(k, v) for k, v in metrics.items()))
            shown = [k for k in HEADLINE if k in metrics]  # the rest: the model card, MLflow, --json
            self.reporter.stage_done("evaluate", outcome, None, ", ".join(with_scale(k, metrics[k]) for k in shown)
                                     + f" (+{len(metrics) - len(shown)} more in the model card)")
        else:  # its console line comes with the registration (`_register`)
            self.tracker.log_stage(stage.name, {"checkpoint_dir": self.summary.checkpoint}, outcome, inputs=[tokens],
                                   outputs=[ref])


def _update_catalog(workdir: str, with_models: bool) -> None:
    """The audit catalog (`<workdir>/catalog/`) learns each commit as it happens, so `lifecycle sql` and
    `lifecycle lineage` read no manifest twice and import no MLflow. Not the run's business to fail on: a
    catalog that could not be updated is brought up to date by the next audit command."""
    try:
        catalog.update(workdir, with_models=with_models)
    except Exception as e:
        log.warning("audit catalog of %s not updated (the next audit command updates it): %s", workdir, e)


def _metrics_rows(result) -> list[dict]:
    return [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines() if line.strip()]


def _per_expert(rows: list[dict]) -> list[str]:
    """A mixture of experts' dropped routes per expert (a list in metrics.jsonl) as one MLflow series per expert,
    `moe_dropped_e<j>`; the rows get those keys. None for a dense run."""
    names: set[str] = set()
    for r in rows:
        for j, n in enumerate(r.get("moe_dropped_per_expert") or []):
            r[f"moe_dropped_e{j}"] = n
            names.add(f"moe_dropped_e{j}")
    return sorted(names, key=lambda k: int(k.removeprefix("moe_dropped_e")))


def _register(tracker: Tracker, summary: RunSummary, model_ref: DatasetRef, cfg: PipelineConfig,
              scores: DatasetRef, reporter: Reporter) -> None:
    """Register the packaged model (or find the version a rerun already registered), decide promotion (on the
    evaluation set's digest; a champion scored on another set is re-scored on this one), and put the model card
    on the parent run."""
    registry = Registry(tracker)
    examples = examples_of(scores)
    name, version = registry.register_or_reuse(model_ref, summary.metrics, eval_set_sha256=eval_set_of(scores),
                                               rescore=lambda package: rescore_package(package, scores))
    summary.model = {"name": name, "version": version}
    summary.promotion = registry.promotion(name, version)
    print(f"[checkpoint] {summary.stages['checkpoint']}: registered {name} version {version}; "
          f"champion: {summary.promotion.get('decision')} ({summary.promotion.get('reason')})")
    reporter.stage_done("checkpoint", summary.stages["checkpoint"], None,
                          f"registered {name} version {version}; champion: {summary.promotion.get('decision')}")
    manifests = {s: json.loads(Path(p).read_text()) for s, p in summary.datasets.items()}
    configs = {s: json.dumps(m.get("config"), sort_keys=True) for s, m in manifests.items()
               if s not in ("checkpoint", "evaluate")}
    configs["train"] = json.dumps(cfg.train.model_dump(mode="json"), sort_keys=True)
    configs["evaluate"] = json.dumps(cfg.evaluate.model_dump(mode="json"), sort_keys=True)
    lineage = json.loads((model_ref.dir / "lineage.json").read_text())
    card = model_card(name=name, version=version, run_id=tracker.parent_id,
                      prefect_flow_run_id=summary.prefect_flow_run_id, tags=tracker.parent_tags(),
                      lineage=lineage, stage_configs=configs, metrics=summary.metrics, promotion=summary.promotion,
                      examples=examples, stats_by_stage={s: m.get("stats") or {} for s, m in manifests.items()},
                      params=summary.metrics.get("train_params"))
    tracker.log_text(card, "model_card.md")
    raw = sorted({r["path"]: r for d in lineage["datasets"] for r in d.get("inputs", [])}.values(),
                 key=lambda r: r["path"])
    tracker.log_json(raw, "raw_inputs.json")  # the card counts them; the list is here
    summary.artifacts["model_card"] = _artifact_uri(tracker, "model_card.md")


def _log_charts(tracker: Tracker, summary: RunSummary, trained) -> None:
    """funnel.png (documents kept per stage, top drop reasons) and loss_curves.png on the parent run."""
    manifests = {s: json.loads(Path(p).read_text()) for s, p in summary.datasets.items()}
    with tempfile.TemporaryDirectory() as tmp:
        tracker.log_file(funnel_png(manifests, Path(tmp) / "funnel.png"))
        summary.artifacts["funnel"] = _artifact_uri(tracker, "funnel.png")
        if trained is not None:
            m = summary.metrics
            tracker.log_file(loss_png(_metrics_rows(trained), Path(tmp) / "loss_curves.png", m.get("val_loss"),
                                      m.get("step")))
            summary.artifacts["loss_curves"] = _artifact_uri(tracker, "loss_curves.png")


def _artifact_uri(tracker: Tracker, name: str) -> str:
    return f"{tracker.client.get_run(tracker.parent_id).info.artifact_uri}/{name}"


def _scoring_model(champion: tuple[str, Path] | None) -> tuple[ScoringModel | None, str]:
    """The champion to score perplexity with, or (None, why there is none)."""
    if champion is None:
        return None, "no champion registered yet: nothing to score perplexity with"
    version, package = champion
    if not Path(package).is_dir():
        return None, f"the champion's package {package} (version {version}) is gone"
    try:
        return ScoringModel.of_package(version, package), f"champion version {version}"
    except DatasetDamaged as e:
        return None, f"the champion's package (version {version}) is damaged: {e}"


def _skip(tracker: Tracker, summary: RunSummary, stage, reason: str, reporter: Reporter) -> None:
    """An enabled optional stage that cannot run: said on the console and the flow log, kept in the summary and
    on the MLflow parent run (`lifecycle.skipped.<stage>`); its children read its parent's output."""
    summary.skipped[stage.name] = reason
    tracker.set_parent_tag(f"lifecycle.skipped.{stage.name}", reason[:5000])
    print(f"[{stage.name}] skipped: {reason}")
    reporter.note(f"{stage.name} skipped: {reason}")


def tainted_reason(taint: tuple[str, str]) -> str:
    return f"champion version {taint[0]} was trained on forgotten documents (tombstones {taint[1][:200]})"


def _warm_start(tracker: Tracker, found: tuple[str, Path] | None, taint: tuple[str, str] | None,
                cfg: PipelineConfig, summary: RunSummary, reporter: Reporter):
    """`train.init_from: champion`: (champion's weights, tokenize config using its tokenizer) when the model
    config is unchanged, else (None, None: the configured tokenize config). The decision goes on the parent run."""
    if found is None:
        weights, reason = None, "no champion registered yet"
    elif taint is not None:
        weights, reason = None, tainted_reason(taint)
    else:
        weights, reason = warm_start(found[1], cfg.train)
    tok_cfg = None
    if weights is not None:
        tok_cfg = cfg.tokenize.model_copy(update={"tokenizer_file": str(found[1] / "tokenizer.json")})
    decision = {"from_version": found[0] if weights else None, "weights": str(weights) if weights else None,
                "reason": reason}
    summary.warm_start = decision
    tracker.set_parent_tag("lifecycle.warm_start", json.dumps(decision))
    note = f"warm start: {'champion version ' + found[0] if weights else 'from scratch'} ({reason})"
    print(f"[train] {note}")
    reporter.note(note)
    return weights, tok_cfg
