"""End to end: `lifecycle run` as users start it (ephemeral Prefect server, MLflow on SQLite, 2 DeepSpeed
CPU ranks) on a tiny slice of the bundled corpus plus planted duplicates, PII and bad records."""

import json
from pathlib import Path
import os

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from lifecycle.core.fs import sha256_file
from tests.conftest import ROOT, corpus_records, last_json, lifecycle
from tests.conftest import lifecycle_in_process as audit

pytestmark = pytest.mark.e2e

TINY = [
    "train.max_steps=16", "train.checkpoint.every=8", "train.logging.eval_every=8", "train.logging.eval_batches=2", "train.logging.every=1", "train.batch.micro_batch_size=4", "train.optimizer.warmup_steps=2",
    "train.model.n_layer=2", "train.model.n_embd=64", "train.model.n_head=2", "train.model.seq_len=64",
    "tokenize.vocab_size=512", "tokenize.val_fraction=0.2", "evaluate.max_batches=4", "orchestration.retry_backoff_s=0.1",
]


def run_cli(workdir, inputs, extra=()):
    args = ["run", ROOT / "deploy/configs/demo.yaml", "--json", "--set", f"workdir={workdir}",
            "--set", f"collect.inputs={json.dumps(inputs)}"]
    for s in [*TINY, *extra]:
        args += ["--set", s]
    return last_json(lifecycle(*args).stdout)


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
    assert set(out["datasets"]) == {"collect", "filter", "dedup", "scrub", "tokenize", "evaluate", "checkpoint"}
    assert all(v == "computed" for v in out["stages"].values()), out["stages"]
    for stage, manifest_path in out["datasets"].items():
        m = json.loads(open(manifest_path).read())
        if m["stats"]:
            s = m["stats"]
            assert s["rows_in"] == s["rows_kept"] + s["rows_rejected"], stage
    collect = json.loads(open(out["datasets"]["collect"]).read())
    assert collect["stats"]["rejected_by_reason"] == {"invalid_json": 1}
    dedup = json.loads(open(out["datasets"]["dedup"]).read())
    assert dedup["stats"]["rejected_by_reason"].get("duplicate", 0) >= 1
    assert dedup["stats"]["counters"].get("duplicate_exact", 0) >= 1
    dup = next(r for r in rows(out["datasets"]["dedup"], "rejected") if r["source_id"] == "planted-exact")
    notice = next(r for r in rows(out["datasets"]["dedup"]) if r["source_id"] == "planted-notice")
    assert (dup["reason"], dup["duplicate_kind"], dup["duplicate_of"]) == ("duplicate", "exact", notice["doc_id"])
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
    # <workdir>/latest/<stage> names what this completed run used; the summary says where charts and card are
    for stage, manifest_path in out["datasets"].items():
        assert (wd / "latest" / stage).resolve() == Path(manifest_path).parent.resolve(), stage
    assert (wd / "latest" / "train").resolve() == Path(out["checkpoint"]).resolve()
    assert {k: v.rsplit("/", 1)[-1] for k, v in out["artifacts"].items()} == {
        "funnel": "funnel.png", "loss_curves": "loss_curves.png", "model_card": "model_card.md"}


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
    assert by_stage["filter"].data.params["gopher_quality.min_doc_words"] == "50"
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
    ev = by_stage["evaluate"].data.metrics
    assert {"val_loss", "val_perplexity", "val_bpb", "gen_bleu", "gen_rougeL", "contamination_doc_rate"} <= set(ev)
    # bits per byte is nats/token rescaled by tokens per byte: bytes are counted from the val tokens themselves
    assert ev["val_bpb"] == pytest.approx(ev["val_loss"] * ev["val_tokens"] / (ev["val_bytes"] * 0.6931471805599453))
    assert 1.0 < ev["val_bytes"] / ev["val_tokens"] < 6  # bytes per token of a 512-symbol byte-level BPE
    assert ev["gen_prompts"] > 0 and 0 <= ev["contamination_doc_rate"] <= 0.1
    val_hist = client.get_metric_history(by_stage["train"].info.run_id, "val_loss")  # in-training evaluation
    assert {h.step for h in val_hist} == {8, 16}
    examples = json.loads(open(client.download_artifacts(parent.info.run_id, "eval_examples.json", str(wd))).read())
    assert examples and {"prompt", "reference", "generated", "doc_id"} <= set(examples[0])
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"funnel.png", "loss_curves.png", "model_card.md", "config.json", "model"} <= arts
    png = open(client.download_artifacts(parent.info.run_id, "funnel.png", str(wd)), "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    card = open(client.download_artifacts(parent.info.run_id, "model_card.md", str(wd))).read()
    assert collect_m["sha256"] in card and out["datasets"]["tokenize"] in card
    mv = client.get_model_version(out["model"]["name"], out["model"]["version"])
    assert mv.run_id == parent.info.run_id
    assert mv.tags["lifecycle.dataset.collect.sha256"] == collect_m["sha256"]
    assert json.loads(open(out["datasets"]["checkpoint"]).read())["sha256"] == mv.tags["lifecycle.model_package_sha256"]
    # registry tags: every dataset, raw inputs, tokenizer, checkpoint marker, config hash, git commit
    tok_m = json.loads(open(out["datasets"]["tokenize"]).read())
    for stage in ("collect", "filter", "dedup", "scrub", "tokenize"):
        assert mv.tags[f"lifecycle.dataset.{stage}.sha256"] == json.loads(open(out["datasets"][stage]).read())["sha256"]
    raw = collect_m["inputs"][0]
    assert mv.tags["lifecycle.raw_input.0"] == f"{raw['sha256']} {raw['path']}"
    assert mv.tags["lifecycle.tokenizer_sha256"] == tok_m["tokenizer_sha256"]
    assert mv.tags["lifecycle.checkpoint_marker_sha256"] == sha256_file(os.path.join(out["checkpoint"], "COMMITTED.json"))
    assert mv.tags["lifecycle.config_sha256"] == parent.data.tags["lifecycle.config_sha256"]
    assert len(mv.tags["lifecycle.git_commit"]) == 40
    assert float(mv.tags["metric.val_bpb"]) == ev["val_bpb"]
    for k in (mv.tags["lifecycle.tokenizer_sha256"], mv.tags["lifecycle.checkpoint_marker_sha256"],
              mv.tags["lifecycle.git_commit"]):
        assert k in card
    # the card counts the raw files; the list, each with its sha256, is the artifact beside it (issue 41 §3)
    listed = json.loads(open(client.download_artifacts(parent.info.run_id, "raw_inputs.json", str(wd))).read())
    assert {r["sha256"] for r in listed} == {r["sha256"] for r in collect_m["inputs"]}
    assert f"{len(listed):,} files, " in card.split("## Raw input files")[1]  # counted in the card
    # first version of the model: it becomes the champion, and the decision is recorded on version and run
    assert str(client.get_model_version_by_alias(out["model"]["name"], "champion").version) == out["model"]["version"]
    assert mv.tags["lifecycle.promotion.decision"] == "promoted" == parent.data.tags["lifecycle.promotion.decision"]
    assert out["promotion"]["decision"] == "promoted"


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
    # the rerun reopened the same MLflow parent and child runs and logged no metric step twice
    assert again["mlflow_run_id"] == out["mlflow_run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{wd}/mlflow.db")
    parent = client.get_run(out["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["prefect.flow_run_id"] == again["prefect_flow_run_id"]
    assert json.loads(parent.data.tags["lifecycle.prefect_flow_run_ids"]) == [out["prefect_flow_run_id"],
                                                                               again["prefect_flow_run_id"]]
    runs = client.search_runs([parent.info.experiment_id])
    assert len(runs) == 9  # one parent + eight stages
    train = next(r for r in runs if r.data.tags.get("lifecycle.stage") == "train")
    steps = [h.step for h in client.get_metric_history(train.info.run_id, "loss")]
    assert len(steps) == len(set(steps)) == 16
    assert len(client.get_metric_history(parent.info.run_id, "val_bpb")) == 1


def test_a_rerun_prints_one_screen(first_run, tiny_inputs):
    """Issue 41 §4: what a user reads after a run fits one screen (the demo printed ~1,500 characters of metrics)."""
    wd, _ = first_run
    args = ["run", ROOT / "deploy/configs/demo.yaml", "--set", f"workdir={wd}", "--set",
            f"collect.inputs={json.dumps(tiny_inputs)}", *(a for s in TINY for a in ("--set", s))]
    lines = lifecycle(*args).stdout.splitlines()
    assert len(lines) <= 30 and max(len(ln) for ln in lines) < 400, "\n".join(lines)
    assert any(ln.startswith("  val:") for ln in lines) and not any(ln.startswith("  robust:") for ln in lines)


def test_audit_cli(first_run, capsys):
    wd, out = first_run
    name, version = out["model"]["name"], out["model"]["version"]
    rc, model = audit(capsys, "lineage", "model", f"{name}@champion", "--workdir", str(wd))
    assert rc == 0 and model["model"]["version"] == version and "champion" in model["model"]["aliases"]
    assert [d["stage"] for d in model["datasets"]] == ["tokenize", "scrub", "dedup", "filter", "collect"]
    collect = model["datasets"][-1]
    assert collect["raw_inputs"][0]["sha256"] == json.loads(open(out["datasets"]["collect"]).read())["inputs"][0]["sha256"]
    assert model["datasets"][0]["config"]["vocab_size"] == 512 and model["checkpoint"]["step"] == 16
    assert audit(capsys, "lineage", "model", f"{name}/{version}", "--workdir", str(wd))[1] == model

    rc, dup = audit(capsys, "lineage", "doc", "planted-exact", "--workdir", str(wd))
    notice = next(r for r in rows(out["datasets"]["dedup"]) if r["source_id"] == "planted-notice")
    rejected = [e for e in dup["events"] if e["outcome"] == "rejected"]
    assert rc == 0 and [e["stage"] for e in rejected] == ["dedup"]
    assert rejected[0]["reason"] == "duplicate" and rejected[0]["duplicate_kind"] == "exact"
    assert rejected[0]["duplicate_of"] == notice["doc_id"]
    assert dup["trained_by"] == [] and dup["evaluated_by"] == []

    rc, pii = audit(capsys, "lineage", "doc", "planted-pii", "--workdir", str(wd))
    by_stage = {e["stage"]: e for e in pii["events"]}
    assert by_stage["scrub"]["pii_email"] == 1 and by_stage["scrub"]["pii_phone"] == 1
    tok = by_stage["tokenize"]
    assert tok["outcome"] == "tokenized" and tok["token_end"] > tok["token_start"]
    ref = {"name": name, "version": int(version), "aliases": "champion"}
    assert (pii["trained_by"], pii["evaluated_by"]) == (([ref], []) if tok["split"] == "train" else ([], [ref]))

    rc, forget = audit(capsys, "lineage", "forget", "planted-pii", "no-such-source", "--workdir", str(wd))
    assert rc == 0 and forget["not_found"] == ["no-such-source"] and len(forget["doc_ids"]) == 1
    assert {d["stage"] for d in forget["datasets"]} == {"collect", "filter", "dedup", "scrub", "tokenize",
                                                         "dedup-signatures", "dedup-index"}
    # a document's MinHash signature is derived from its text: the report names every place that holds it
    assert {d["stage"] for d in forget["datasets"] if d["held_as"].startswith("MinHash")} == \
        {"dedup-signatures", "dedup", "dedup-index"}
    assert json.loads(open(forget["report"]).read())["doc_ids"] == forget["doc_ids"]
    if tok["split"] == "train":
        assert {c["tag_dir"] for c in forget["checkpoints"]} >= {out["checkpoint"]}
        assert [m["version"] for m in forget["model_versions"]] == [int(version)]
    else:
        assert forget["checkpoints"] == [] and forget["model_versions"] == []

    rc, q = audit(capsys, "sql", "SELECT stage, reason, count(*) AS n FROM rejected GROUP BY ALL ORDER BY ALL",
                  "--workdir", str(wd))
    assert rc == 0 and {"stage": "collect", "reason": "invalid_json", "n": 1} in q
    rc, err = audit(capsys, "sql", "SELECT nope FROM datasets", "--workdir", str(wd))
    assert rc == 2 and "nope" in err["error"]


def test_next_run_starts_from_the_champion(first_run, tiny_inputs, tmp_path):
    """Runs last: it adds a second run (new data, `train.init_from=champion`) to the shared work dir. It must
    reuse the champion's tokenizer, start from its weights, and register a new version."""
    wd, out = first_run
    extra = tmp_path / "more.jsonl"
    extra.write_text("".join(json.dumps({**r, "id": f"more-{k}"}) + "\n"
                             for k, r in enumerate(corpus_records(200)[120:200])))
    client = MlflowClient(tracking_uri=f"sqlite:///{wd}/mlflow.db")
    champion = client.get_model_version_by_alias(out["model"]["name"], "champion")
    package = os.path.dirname(champion.tags["lifecycle.model_package_manifest"])
    again = run_cli(wd, [*tiny_inputs, str(extra)], extra=["train.init_from=champion", "collect.incremental=true"])
    assert again["status"] == "completed" and again["stages"]["collect"] == "computed"
    assert again["warm_start"]["from_version"] == str(champion.version), again["warm_start"]
    collect = json.loads(open(again["datasets"]["collect"]).read())
    assert [i["path"] for i in collect["inputs"]] == [str(extra)]  # the first run's file was collected before
    tok = json.loads(open(again["datasets"]["tokenize"]).read())
    first_tok = json.loads(open(out["datasets"]["tokenize"]).read())
    assert tok["tokenizer_sha256"] == first_tok["tokenizer_sha256"]  # the champion's tokenizer, not a new one
    run_dir = os.path.dirname(os.path.dirname(again["checkpoint"]))
    launch = json.load(open(os.path.join(run_dir, "config.json")))
    assert launch["init_weights"] == os.path.join(package, "model.safetensors")
    assert launch["init_weights_sha256"] == sha256_file(launch["init_weights"])
    losses = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in l]
    first_losses = [json.loads(l) for l in open(os.path.join(os.path.dirname(os.path.dirname(out["checkpoint"])),
                                                             "metrics.jsonl")) if '"loss"' in l]
    # a warm start begins near where the champion ended, far below a fresh model's first loss
    assert losses[0]["loss"] < first_losses[0]["loss"] - 0.5, (losses[0], first_losses[0])
    assert again["model"]["version"] != out["model"]["version"]
