"""End to end: `lifecycle run` as users start it (ephemeral Prefect server, MLflow on SQLite, 2 DeepSpeed
CPU ranks) on a tiny slice of the bundled corpus plus planted duplicates, PII and bad records."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from tests.conftest import ROOT, corpus_records

pytestmark = pytest.mark.e2e

TINY = [
    "train.max_steps=16", "train.checkpoint_every=8", "train.log_every=1", "train.micro_batch_size=4", "train.warmup_steps=2",
    "train.model.n_layer=2", "train.model.n_embd=64", "train.model.n_head=2", "train.model.seq_len=64",
    "tokenize.vocab_size=512", "tokenize.val_fraction=0.2", "evaluate.max_batches=4", "orchestration.retry_backoff_s=0.1",
]


def run_cli(workdir, inputs, extra=(), flags=()):
    args = [sys.executable, "-m", "lifecycle.cli", "run", *flags, str(ROOT / "deploy/configs/demo.yaml"), "--json", "--set", f"workdir={workdir}",
            "--set", f"collect.inputs={json.dumps(inputs)}"]
    for s in [*TINY, *extra]:
        args += ["--set", s]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rows(manifest_path, kind="files"):
    """All rows of a dataset's kept (files) or rejected Parquet files, read through its manifest."""
    m = json.loads(open(manifest_path).read())
    return [r for f in m[kind] for r in pq.read_table(os.path.join(os.path.dirname(manifest_path), f["path"])).to_pylist()]


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    recs = corpus_records(120)
    notice = ("The library committee will meet again next week to review the budget and the plans for the "
              "reading room. Members who cannot attend should send their comments to the secretary before "
              "the meeting, so that the chair can read them out and the minutes can record them. The agenda "
              "also covers the new opening hours, the book sale in the spring and the repairs to the roof.")
    planted = [
        {"id": "planted-notice", "text": notice},
        {"id": "planted-exact", "text": "  " + notice.replace(" ", "\n ")},  # same text after normalisation
        {"id": "planted-pii", "text": (
            "Tickets for the summer concert in the park are now on sale, and the orchestra has added a second "
            "evening because the first one sold out within a day. If you have questions about seats, parking "
            "or access for wheelchairs, write to jane.doe@example.com or call +1 650-253-0000 during office "
            "hours. The booking form is served from 81.2.69.160 until the end of the month, and we will send "
            "a confirmation by post to everyone who books before then.")},
    ]
    with open(d / "docs.jsonl", "w") as f:
        for r in recs + planted:
            f.write(json.dumps(r) + "\n")
        f.write("{not json}\n")
    return [str(d / "docs.jsonl")]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_inputs):
    wd = tmp_path_factory.mktemp("work")
    return wd, run_cli(wd, tiny_inputs)


def test_full_run_outputs_and_accounting(first_run):
    wd, out = first_run
    assert out["status"] == "completed"
    assert set(out["datasets"]) == {"collect", "filter", "dedup", "scrub", "tokenize", "checkpoint"}
    assert all(v == "computed" for v in out["stages"].values()), out["stages"]
    for stage, manifest_path in out["datasets"].items():
        m = json.loads(open(manifest_path).read())
        if m["stats"]:
            s = m["stats"]
            assert s["rows_in"] == s["rows_kept"] + s["rows_rejected"], stage
    collect = json.loads(open(out["datasets"]["collect"]).read())
    assert collect["stats"]["rejected_by_reason"] == {"invalid_json": 1}
    dedup = json.loads(open(out["datasets"]["dedup"]).read())
    assert dedup["stats"]["rejected_by_reason"].get("exact_duplicate", 0) >= 1
    dup = next(r for r in rows(out["datasets"]["dedup"], "rejected") if r["source_id"] == "planted-exact")
    notice = next(r for r in rows(out["datasets"]["dedup"]) if r["source_id"] == "planted-notice")
    assert dup["reason"] == "exact_duplicate" and dup["duplicate_of"] == notice["doc_id"]
    pii = next(r for r in rows(out["datasets"]["scrub"]) if r["source_id"] == "planted-pii")
    assert "jane.doe@example.com" not in pii["text"] and "81.2.69.160" not in pii["text"]
    assert "650-253-0000" not in pii["text"] and "<EMAIL>" in pii["text"]
    assert pii["pii_email"] == 1 and pii["pii_ipv4"] == 1 and pii["pii_phone"] == 1
    # training: loss fell, checkpoint committed, evaluation ran
    m = out["metrics"]
    assert m["train_steps"] == 16 and m["val_loss"] > 0 and m["val_perplexity"] > 1
    assert (wd / "train").exists() and out["checkpoint"].endswith("step_00000016")
    assert os.path.exists(os.path.join(out["checkpoint"], "COMMITTED.json"))
    losses = [json.loads(l)["loss"] for l in open(next((wd / "train").glob("*/metrics.jsonl"))) if '"loss"' in l]
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses


def test_mlflow_lineage(first_run):
    wd, out = first_run
    client = MlflowClient(tracking_uri=f"sqlite:///{wd}/mlflow.db", registry_uri=f"sqlite:///{wd}/mlflow.db")
    parent = client.get_run(out["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_id"] == out["prefect_flow_run_id"]
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_stage = {r.data.tags["lifecycle.stage"]: r for r in children}
    assert set(by_stage) == {"collect", "filter", "dedup", "scrub", "tokenize", "train", "evaluate", "checkpoint"}
    collect_m = json.loads(open(out["datasets"]["collect"]).read())
    assert by_stage["collect"].data.metrics["rows_in"] == collect_m["stats"]["rows_in"]
    assert by_stage["collect"].data.metrics["rejected.invalid_json"] == 1
    assert by_stage["filter"].data.params["min_doc_words"] == "50"
    # datasets are logged with their sha256: MLflow's digest field holds 36 chars, the profile and a tag all 64
    logged = {next(t.value for t in d.tags if t.key == "mlflow.data.context"): d
              for d in by_stage["filter"].inputs.dataset_inputs}
    assert set(logged) == {"input", "output"}
    inp = logged["input"]
    assert len(collect_m["sha256"]) == 64 and inp.dataset.digest == collect_m["sha256"][:36]
    assert json.loads(inp.dataset.profile)["sha256"] == collect_m["sha256"]
    assert {t.key: t.value for t in inp.tags}["lifecycle.sha256"] == collect_m["sha256"]
    assert out["datasets"]["collect"] in inp.dataset.source
    loss_hist = client.get_metric_history(by_stage["train"].info.run_id, "loss")
    assert len(loss_hist) >= 2 and {h.step for h in loss_hist} >= {1, 16}
    assert "val_loss" in by_stage["evaluate"].data.metrics
    mv = client.get_model_version(out["model"]["name"], out["model"]["version"])
    assert mv.run_id == parent.info.run_id
    assert mv.tags["lifecycle.dataset.collect.sha256"] == collect_m["sha256"]
    assert json.loads(open(out["datasets"]["checkpoint"]).read())["sha256"] == mv.tags["lifecycle.model_package_sha256"]


def test_rerun_reuses_everything(first_run, tiny_inputs):
    wd, out = first_run
    before = {s: open(p).read() for s, p in out["datasets"].items()}
    again = run_cli(wd, tiny_inputs)
    assert again["status"] == "completed"
    assert "computed" not in again["stages"].values(), again["stages"]
    assert {s: open(p).read() for s, p in again["datasets"].items()} == before  # manifests untouched
    assert again["checkpoint"] == out["checkpoint"]
    assert again["model"] == out["model"]  # same package -> same registered version, not a new one
    assert again["metrics"]["val_loss"] == out["metrics"]["val_loss"]


def test_until_stops_after_stage(tmp_path, tiny_inputs):
    out = run_cli(tmp_path / "w", tiny_inputs, flags=["--until", "dedup"])
    assert out["status"] == "completed"
    assert list(out["stages"]) == ["collect", "filter", "dedup"]
    assert out["checkpoint"] is None and out["model"] is None
    assert not (tmp_path / "w" / "datasets" / "scrub").exists()
