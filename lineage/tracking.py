"""The only module that talks to MLflow.

One parent run per lifecycle run, one nested child run per stage. Each child logs its stage config as
params, its funnel numbers as metrics, and its input and output datasets with their full sha256 (MLflow's
own dataset digest is 8 hex chars of MD5 over the first rows: too weak for lineage; its digest field holds at
most 36 characters, so the full sha256 also goes into the dataset profile and an input tag) and the manifest
path as source. Registering the model and the promotion policy live in `lineage.registry`.

The store is checked before anything is logged (`check_store`): a local SQLite store must pass
`PRAGMA quick_check` (a damaged one is refused, naming the file and the newest backup to restore), and a remote
tracking server must answer `GET <uri>/health` within seconds. A server that dies mid-run fails the run within
seconds too, naming its URI: MLflow's HTTP retries are bounded (`TrackingConfig.http_timeout_s`, `http_retries`),
and a connection failure in any client call is one `TrackingStoreError` (`GuardedClient`). Each completed run then
keeps an online copy of a SQLite store (`backup_store`, SQLite's backup API) in `<workdir>/backups/mlflow-<time>.db`,
the newest 3 kept. The store's checks and backups live in lineage/tracking_store.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core.dataset import DatasetRef, RawFile, sha256_json
from lifecycle.core.errors import one_line
from lifecycle.lineage.tracking_store import (  # the store's health and backups; re-exported for the callers
    BACKUPS as BACKUPS,
    HEALTH_TIMEOUT_S as HEALTH_TIMEOUT_S,
    KEEP_BACKUPS as KEEP_BACKUPS,
    TrackingStoreError as TrackingStoreError,
    backup_store,
    backups as backups,
    check_store,
    preload_client as preload_client,
    preload_sqlite_store as preload_sqlite_store,
    seed_sqlite_store,
    sqlite_path,
)

MAX_PARAM_LEN = 6000
MLFLOW_DIGEST_LEN = 36  # mlflow.utils.validation.MAX_DATASET_DIGEST_SIZE
class TrackingConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI. Default: a SQLite store `mlflow.db` in the work dir."
    )
    experiment: str | None = Field(None, description="MLflow experiment. Default: the pipeline name.")
    model_name: str = Field("lifecycle-gpt", description="Registered model name in the MLflow model registry.")
    http_timeout_s: int = Field(
        8, ge=1, description="With a tracking server: seconds one HTTP request to it may take (MLflow's "
        "MLFLOW_HTTP_REQUEST_TIMEOUT, 120 by default), unless that variable is set.")
    http_retries: int = Field(
        2, ge=0, description="With a tracking server: retries of a failed request (MLFLOW_HTTP_REQUEST_MAX_RETRIES, "
        "7 with a 2 s backoff factor by default: minutes of urllib3 `Retrying` warnings before a dead server is "
        "reported), unless that variable is set. A server that stops answering then fails the run within about "
        "(retries + 1) x timeout + 3 s, naming its URI.")


def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(d, BaseModel):
        d = d.model_dump(mode="json")
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    value = json.dumps(d) if isinstance(d, (list, tuple)) else str(d)
    return {prefix.rstrip("."): value[:MAX_PARAM_LEN]}


def git_commit(cwd: str | Path | None = None) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).parent, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


_HTTP_ENV_SET: dict[str, str] = {}  # MLFLOW_HTTP_* variable -> the value this process set (the user's are kept)


def bound_http_requests(cfg: TrackingConfig) -> None:
    """MLflow's HTTP client retries a dead server for minutes by default; bound it unless the user set it."""
    for var, value in (("MLFLOW_HTTP_REQUEST_TIMEOUT", cfg.http_timeout_s),
                       ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", cfg.http_retries),
                       ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", 1)):  # MLflow parses it as an int; sleeps 0, 2, 4 s
        if var not in os.environ or os.environ[var] == _HTTP_ENV_SET.get(var):
            os.environ[var] = _HTTP_ENV_SET[var] = str(value)


def open_server(uri: str) -> None:
    """Before an audit command reads a tracking store: a SQLite file must exist (reading creates nothing); a
    server gets bounded HTTP retries, and one that does not answer is one error naming it, within seconds."""
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        raise TrackingStoreError(f"--tracking-uri {uri}: no MLflow store at {db}")
    if uri.startswith(("http://", "https://")):
        bound_http_requests(TrackingConfig())
        check_store(uri, ".")


def unreachable(e: BaseException) -> BaseException | None:
    """The connection error, timeout or exhausted retry behind an MLflow call's exception, else None."""
    import requests

    from lifecycle.core.errors import exception_chain

    return next((c for c in exception_chain(e) if isinstance(c, (
        requests.exceptions.ConnectionError, requests.exceptions.Timeout, requests.exceptions.RetryError,
        ConnectionError, TimeoutError))), None)


# MlflowClient methods that move files through the server's artifact proxy (the rest go to its backend database)
ARTIFACT_CALLS = frozenset({"log_artifact", "log_artifacts", "log_text", "log_dict", "log_figure", "log_image",
                            "log_table", "download_artifacts", "list_artifacts"})


class GuardedClient:
    """An `MlflowClient` whose calls, when the tracking server stops answering mid-run, raise one
    `TrackingStoreError` naming the URI (instead of MLflow's `API request to ... failed` or a later
    `ObjectNotFound`); once the server is known down, every further call fails at once."""

    def __init__(self, client, uri: str):
        self._client, self._uri = client, uri
        self.down: str | None = None

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if self.down:
                raise TrackingStoreError(self.down)
            try:
                return attr(*args, **kwargs)
            except Exception as e:
                cause = unreachable(e)
                if cause is None:
                    raise
                import requests

                if isinstance(cause, requests.exceptions.RetryError):  # it answered, with server errors each time
                    store = ("the artifact store it proxies uploads to is not (its --artifacts-destination: S3, "
                             "MinIO, ...)" if name in ARTIFACT_CALLS else "its backend store is not (the database of "
                             "its --backend-store-uri)")
                    self.down = (f"MLflow tracking server {self._uri} answered {name} with server errors until "
                                 f"its retries ran out ({one_line(str(cause))[:200]}): the server is up, {store}; "
                                 "see the server's log, then rerun: the run resumes from what was committed")
                    raise TrackingStoreError(self.down) from None
                self.down = (f"MLflow tracking server {self._uri} stopped answering during the run ({name}: "
                             f"{type(cause).__name__}; MLFLOW_HTTP_REQUEST_TIMEOUT="
                             f"{os.environ.get('MLFLOW_HTTP_REQUEST_TIMEOUT')} s, MAX_RETRIES="
                             f"{os.environ.get('MLFLOW_HTTP_REQUEST_MAX_RETRIES')}); restart it (`lifecycle up`) "
                             "and rerun: the run resumes from what was committed")
                raise TrackingStoreError(self.down) from None

        return call


# the experiment tag MLflow 3's UI reads to show model-training runs (its other kind is "genai_development")
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


class Tracker:
    """Logs one lifecycle run. Runtime object: passed around, never part of the config."""

    def __init__(self, cfg: TrackingConfig, workdir: str, default_experiment: str):
        from mlflow import MlflowClient

        self.workdir = Path(workdir)
        # explicit config, else the user's MLFLOW_TRACKING_URI (`lifecycle up` exports it), else SQLite in the work
        # dir. The Tracker only uses its own MlflowClient and never calls `mlflow.set_tracking_uri`, which would
        # export MLFLOW_TRACKING_URI and make a later run in the same process (`serve`) log into this store.
        self.uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.workdir / 'mlflow.db'}"
        self.cfg = cfg
        check_store(self.uri, self.workdir)
        if (db := sqlite_path(self.uri)) is not None and not db.exists():
            seed_sqlite_store(db)
        if self.uri.startswith(("http://", "https://")):
            bound_http_requests(cfg)
        self.client = GuardedClient(MlflowClient(tracking_uri=self.uri, registry_uri=self.uri), self.uri)
        name = cfg.experiment or default_experiment
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            artifacts = (self.workdir / "mlartifacts").resolve().as_uri() if self.uri.startswith("sqlite:") else None
            self.experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
        else:
            self.experiment_id = exp.experiment_id
        if exp is None or exp.tags.get(EXPERIMENT_KIND) != MODEL_TRAINING:
            # MLflow 3's UI guesses the kind of an untagged experiment and may open its runs as GenAI evaluations
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        self.parent_id: str | None = None
        self.resumed = False
        self.stage_runs: dict[str, str] = {}
        self._open: set[str] = set()  # stage runs this tracker made RUNNING: no store round trip to check them
        self._logged: dict[str, set[tuple[str, int]]] = {}  # run id -> (metric key, step) already in the store

    # -------------------------------------------------------------------------------- runs
    def start(self, run_name: str, config: BaseModel, tags: dict[str, str]) -> str:
        """Open the parent run of this lifecycle run, or reopen the one an earlier flow run of the same config
        started. The run key is the config's sha256 (the work dir is part of the config), stored in the tag
        `lifecycle.run_key`: a rerun, a resume after a crash and a later `--until` run of the same config all
        log into one parent run and its child runs, and skip metric steps already logged. The Prefect flow-run
        id tag names the latest flow run; `lifecycle.prefect_flow_run_ids` lists all of them."""
        config_sha = sha256_json(config.model_dump(mode="json"))
        found = self.client.search_runs([self.experiment_id], filter_string=f"tags.`lifecycle.run_key` = '{config_sha}'",
                                        order_by=["attributes.start_time ASC"], max_results=1)
        flow_run_id = tags.get("prefect.flow_run_id", "")
        if found:
            self.parent_id = found[0].info.run_id
            self.resumed = True
            old = json.loads(found[0].data.tags.get("lifecycle.prefect_flow_run_ids", "[]"))
            self.client.update_run(self.parent_id, status="RUNNING")
            for k, v in {**tags, "lifecycle.git_commit": git_commit(),
                         "lifecycle.prefect_flow_run_ids": json.dumps(old + [flow_run_id])[:7900]}.items():
                self.client.set_tag(self.parent_id, k, v)
            for child in self.client.search_runs(
                    [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{self.parent_id}'"):
                self.stage_runs.setdefault(child.data.tags.get("lifecycle.stage", child.info.run_id), child.info.run_id)
        else:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags={
                "lifecycle.config_sha256": config_sha, "lifecycle.run_key": config_sha,
                "lifecycle.git_commit": git_commit(), "lifecycle.prefect_flow_run_ids": json.dumps([flow_run_id]),
                **tags})
            self.parent_id = run.info.run_id
            self.resumed = False
        self.client.log_text(self.parent_id, json.dumps(config.model_dump(mode="json"), indent=2), "config.json")
        return self.parent_id

    def end(self, status: str = "FINISHED") -> None:
        """Terminate the stage runs and the parent run; after a FINISHED run, back up a SQLite store."""
        if self.client.down:  # the server is gone: nothing can be marked; the run's error already names it
            return
        for rid in self.stage_runs.values():
            if self.client.get_run(rid).info.status == "RUNNING":
                self.client.set_terminated(rid, status)
        if self.parent_id:
            self.client.set_terminated(self.parent_id, status)
        if status == "FINISHED":
            backup_store(self.uri, self.workdir)

    def stage_run(self, stage: str, started: float | None = None) -> str:
        """The stage's child run, created (with `started`, epoch seconds, as its start time) or reopened."""
        if stage not in self.stage_runs:
            run = self.client.create_run(self.experiment_id, run_name=stage, tags={
                "mlflow.parentRunId": self.parent_id, "lifecycle.stage": stage},
                start_time=int(started * 1000) if started else None)
            self.stage_runs[stage] = run.info.run_id
        elif stage not in self._open and self.client.get_run(self.stage_runs[stage]).info.status != "RUNNING":
            self.client.update_run(self.stage_runs[stage], status="RUNNING")
        self._open.add(stage)
        return self.stage_runs[stage]

    def finish_stage(self, stage: str, status: str = "FINISHED", error: str | None = None) -> None:
        """Close the stage's child run now, when the stage ends (not when the flow does): its duration in the UI
        is the stage's. A failed stage gets a run even when it logged nothing, with the error as a tag."""

        rid = self.stage_run(stage)
        if error:
            self.client.set_tag(rid, "lifecycle.error", error[:7900])
        self.client.set_terminated(rid, status, end_time=int(time.time() * 1000))
        self._open.discard(stage)

    def _new_metrics(self, rid: str, metrics: list) -> list:
        """Drop metrics whose (key, step) the run already holds: MLflow metrics are append-only, and a
        rerun or resume must not log a step twice."""
        if rid not in self._logged:
            seen = set()
            for key in self.client.get_run(rid).data.metrics:
                seen |= {(key, m.step) for m in self.client.get_metric_history(rid, key)}
            self._logged[rid] = seen
        seen, out = self._logged[rid], []
        for m in metrics:
            if (m.key, m.step) not in seen:
                seen.add((m.key, m.step))
                out.append(m)
        return out

    def _log_metric_batch(self, rid: str, metrics: list) -> None:
        batch = self._new_metrics(rid, metrics)
        for i in range(0, len(batch), 500):
            self.client.log_batch(rid, metrics=batch[i : i + 500])

    # -------------------------------------------------------------------------------- stages
    def log_stage(
        self,
        stage: str,
        config: BaseModel | dict,
        outcome: str,
        inputs: Iterable[DatasetRef] = (),
        outputs: Iterable[DatasetRef] = (),
        raw_inputs: Iterable[RawFile] = (),
        metrics: dict[str, float] | None = None,
        tags: dict[str, str] | None = None,
    ) -> str:
        """Log one stage into its child run; `outcome` is computed, reused (committed dataset found) or cached."""
        from mlflow.entities import Param, RunTag

        rid = self.stage_run(stage)
        params = [Param(k, v) for k, v in flatten(config).items()]
        all_tags = [RunTag("lifecycle.outcome", outcome)] + [RunTag(k, str(v)) for k, v in (tags or {}).items()]
        for ref in outputs:
            all_tags.append(RunTag("lifecycle.output_sha256", ref.sha256))
            all_tags.append(RunTag("lifecycle.output_manifest", str(ref.manifest_path)))
        for i in range(0, len(params), 100):
            self.client.log_batch(rid, params=params[i : i + 100])
        self.client.log_batch(rid, tags=all_tags)
        if metrics:
            self.log_metrics(stage, metrics)
        self._log_datasets(rid, inputs, "input")
        self._log_datasets(rid, outputs, "output")
        if raw_inputs:
            raw = [r.model_dump() for r in raw_inputs]
            self.client.log_text(rid, json.dumps(raw, indent=2), "raw_inputs.json")
        return rid

    def log_metrics(self, stage: str, metrics: dict[str, float], step: int = 0) -> None:

        from mlflow.entities import Metric

        rid = self.stage_run(stage)
        now = int(time.time() * 1000)
        self._log_metric_batch(rid, [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None])

    def log_series(self, stage: str, rows: list[dict], keys: Iterable[str]) -> None:
        """Per-step metrics (e.g. train loss) with their step numbers."""

        from mlflow.entities import Metric

        rid = self.stage_run(stage)
        now = int(time.time() * 1000)
        self._log_metric_batch(rid, [Metric(k, float(r[k]), now, int(r["step"]))
                                     for r in rows for k in keys if r.get(k) is not None])

    def _log_datasets(self, rid: str, refs: Iterable[DatasetRef], context: str) -> None:
        """MLflow caps a dataset digest at 36 characters, so the digest is the first 36 hex chars of our
        sha256 and the full sha256 goes into the dataset profile and an input tag."""
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = []
        for ref in refs:
            with warnings.catch_warnings():  # two registered local-file sources match; both are the same class
                warnings.simplefilter("ignore", UserWarning)
                source = resolve_dataset_source(ref.manifest_path.resolve().as_uri())
            ds = Dataset(
                name=f"{ref.stage}-{ref.fingerprint[:12]}",
                digest=ref.sha256[:MLFLOW_DIGEST_LEN],
                source_type=source._get_source_type(),
                source=source.to_json(),
                profile=json.dumps({"sha256": ref.sha256, "num_rows": ref.num_rows, "stage": ref.stage,
                                    "fingerprint": ref.fingerprint}),
            )
            tags = [InputTag("mlflow.data.context", context), InputTag("lifecycle.sha256", ref.sha256)]
            inputs.append(DatasetInput(ds, tags=tags))
        if inputs:
            self.client.log_inputs(rid, datasets=inputs)

    def log_parent_datasets(self, refs: Iterable[DatasetRef], context: str) -> None:
        """Datasets on the parent run, so that the run's page shows what it read and trained on."""
        self._log_datasets(self.parent_id, refs, context)

    def log_parent_metrics(self, metrics: dict[str, float]) -> None:

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._log_metric_batch(self.parent_id, [Metric(k, float(v), now, 0) for k, v in metrics.items()])

    def log_json(self, obj: Any, artifact_file: str, stage: str | None = None) -> None:
        """A JSON artifact on a stage's child run, or on the parent run when stage is None."""
        rid = self.stage_run(stage) if stage else self.parent_id
        self.client.log_text(rid, json.dumps(obj, indent=2, default=str), artifact_file)

    def parent_tags(self) -> dict[str, str]:
        return self.client.get_run(self.parent_id).data.tags

    def set_parent_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.parent_id, key, value)

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.parent_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.parent_id, text, artifact_file)
