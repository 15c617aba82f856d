"""Tracker against a real MLflow SQLite store: resumed runs reuse their MLflow runs without duplicate metric
steps, and the `champion` alias moves only to a version with lower validation bits per byte."""

import os

from mlflow import MlflowClient
from pydantic import BaseModel

from lifecycle.lineage.registry import CHAMPION, Registry
from lifecycle.lineage.tracking import Tracker, TrackingConfig


class Cfg(BaseModel):
    workdir: str
    lr: float = 0.1


def tracker(wd, cfg, flow_run="fr-1"):
    t = Tracker(TrackingConfig(model_name="m"), str(wd), "exp")
    t.start("run", cfg, {"prefect.flow_run_id": flow_run})
    return t


def test_resumed_run_reuses_runs_and_logs_no_duplicate_steps(tmp_path):
    cfg = Cfg(workdir=str(tmp_path))
    t1 = tracker(tmp_path, cfg)
    t1.log_series("train", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}], ["loss"])
    t1.log_metrics("collect", {"rows_in": 10})
    t1.end("FAILED")  # a crash halfway
    t2 = tracker(tmp_path, cfg, flow_run="fr-2")
    assert t2.resumed and t2.parent_id == t1.parent_id
    assert t2.stage_run("train") == t1.stage_runs["train"]
    t2.log_series("train", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 3, "loss": 2.0}], ["loss"])
    t2.log_metrics("collect", {"rows_in": 10})
    t2.end("FINISHED")
    c = t2.client
    assert [(m.step, m.value) for m in sorted(c.get_metric_history(t2.stage_runs["train"], "loss"), key=lambda m: m.step)] \
        == [(1, 3.0), (2, 2.5), (3, 2.0)]
    assert len(c.get_metric_history(t2.stage_runs["collect"], "rows_in")) == 1
    parent = c.get_run(t2.parent_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["prefect.flow_run_id"] == "fr-2"
    assert parent.data.tags["lifecycle.prefect_flow_run_ids"] == '["fr-1", "fr-2"]'
    assert len(c.search_runs([t2.experiment_id])) == 3  # one parent, two children: nothing duplicated
    t3 = tracker(tmp_path, Cfg(workdir=str(tmp_path), lr=0.2))  # another config: another parent run
    assert not t3.resumed and t3.parent_id != t1.parent_id


def test_champion_moves_only_on_lower_bpb(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "w.txt").write_text("weights")
    t = tracker(tmp_path, Cfg(workdir=str(tmp_path)))
    registry = Registry(t)
    decisions = []
    for bpb in (2.0, 2.5, 1.5):
        name, version = registry.register_model(tmp_path / "pkg", {"metric.val_bpb": repr(bpb),
                                                                   "lifecycle.eval_set_sha256": "e" * 64})
        decisions.append(registry.promote(name, version, bpb, "e" * 64))  # one eval set (tests/eval/test_gate.py)
    c = MlflowClient(tracking_uri=t.uri, registry_uri=t.uri)
    assert [d["decision"] for d in decisions] == ["promoted", "not_promoted", "promoted"]
    assert decisions[1]["champion_version_before"] == "1" and decisions[1]["champion_value_before"] == 2.0
    assert decisions[1]["candidate_value"] == 2.5
    assert str(c.get_model_version_by_alias("m", CHAMPION).version) == "3"
    v2 = c.get_model_version("m", "2").tags
    assert v2["lifecycle.promotion.decision"] == "not_promoted"
    assert v2["lifecycle.promotion.champion_value_before"] == "2.0" and v2["lifecycle.promotion.candidate_value"] == "2.5"
    assert c.get_run(t.parent_id).data.tags["lifecycle.promotion.decision"] == "promoted"  # the last decision


def test_each_work_dir_logs_to_its_own_store_in_one_process(tmp_path, monkeypatch):
    """A second run in the same process (`serve`, or tests) must not log into the first run's store: the Tracker
    exports nothing (no `mlflow.set_tracking_uri`). A URI the user exported still wins."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = Tracker(TrackingConfig(), str(tmp_path / "a"), "exp")
    assert "MLFLOW_TRACKING_URI" not in os.environ
    second = Tracker(TrackingConfig(), str(tmp_path / "b"), "exp")
    assert first.uri == f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}"
    assert second.uri == f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}"
    user = f"sqlite:///{tmp_path / 'user.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", user)
    assert Tracker(TrackingConfig(), str(tmp_path / "c"), "exp").uri == user


def test_a_stage_run_spans_its_stage_and_a_failed_stage_gets_a_failed_run(tmp_path):
    """Issue 41 §3: stage runs closed when the flow ended (collect showed 601 s for a stage that took 0), and after
    a failure the stages that had succeeded were marked FAILED while the failed one had no run."""
    import time

    t = tracker(tmp_path, Cfg(workdir=str(tmp_path)))
    began = time.time() - 5
    t.stage_run("collect", began)
    t.log_metrics("collect", {"rows_in": 10})
    t.finish_stage("collect")
    done = time.time()
    t.stage_run("tokenize", time.time())
    t.finish_stage("tokenize", "FAILED", "ContaminationError: 21 of 77 val documents")
    time.sleep(0.05)
    t.end("FAILED")  # the flow fails later: the stage that succeeded stays FINISHED
    collect = t.client.get_run(t.stage_runs["collect"]).info
    assert collect.status == "FINISHED" and collect.start_time == int(began * 1000)
    assert collect.end_time <= int(done * 1000) + 1
    tok = t.client.get_run(t.stage_runs["tokenize"])
    assert tok.info.status == "FAILED" and tok.data.tags["lifecycle.error"].startswith("ContaminationError")
    assert t.client.get_run(t.parent_id).info.status == "FAILED"
    # the UI shows the experiment as model training, not as GenAI evaluations (issue 41 §3)
    assert t.client.get_experiment(t.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"


def test_the_parent_run_is_named_after_the_pipeline_and_shows_its_datasets(tmp_path):
    """Issue 41 §3: the parent run was named after the Prefect flow run (`fair-kelpie`) and showed no datasets."""
    from tests.conftest import docs_table, make_collect

    ref = make_collect(tmp_path / "wd", [docs_table(["one document", "another"])])
    t = Tracker(TrackingConfig(model_name="m"), str(tmp_path), "exp")
    t.start("my-pipeline", Cfg(workdir=str(tmp_path)), {"prefect.flow_run_id": "fr-1"})
    t.log_parent_datasets([ref], "source")
    run = t.client.get_run(t.parent_id)
    assert run.info.run_name == "my-pipeline"
    [dataset] = run.inputs.dataset_inputs
    assert dataset.dataset.name == f"collect-{ref.fingerprint[:12]}"
    assert {tag.key: tag.value for tag in dataset.tags}["lifecycle.sha256"] == ref.sha256
