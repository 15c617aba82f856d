"""A leaked split fails before training: `lifecycle run` as users start it (ephemeral Prefect server, MLflow on
SQLite) on real pages where every val page is also copied, whole, into a longer train page (a containment that
dedup's MinHash keeps: the two differ by the host page's text). tokenize's data check stops the run: it exits 1
with the check's one-line error naming the closest copy and the overlap report, the Prefect flow run is Failed, no
training ran, nothing is evaluated, packaged or registered. The fast unit-level twin is
tests/data/test_split_overlap.py.

    LIFECYCLE_SLOW=1 .venv/bin/python -m pytest -m slow tests/flows/test_contamination_gate.py
"""

import json
import os
import sqlite3

import pytest
from mlflow import MlflowClient

from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, split_of
from tests.conftest import ROOT, corpus_records, last_json, lifecycle
from tests.flows.test_flow_e2e import TINY

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a whole `lifecycle run` up to tokenize: about a minute here

# the split is val_fraction alone (no floor), so the test knows which sections are val: a page (url) is a group
SPLIT = ["tokenize.min_val_docs=0", "tokenize.min_val_tokens=0"]


def leaked_records() -> tuple[list[dict], list[str]]:
    """80 real sections (of 9 pages), then each val section of at least 150 words inserted into an unused section
    with its own url that hashes to train; and the overrides of a seed that puts 2 or 3 of the 9 pages in val."""
    recs = corpus_records(80)
    seed = next(s for s in range(1000) if 2 <= len({r["url"] for r in recs if split_of(
        f"url:{r['url']}", TokenizeConfig(val_fraction=0.2, seed=s)) == "val"}) <= 3)
    cfg = TokenizeConfig(val_fraction=0.2, seed=seed)  # TINY's val_fraction
    hosts = iter(r["text"] for r in corpus_records(400)[200:] if len(r["text"].split()) >= 300)
    val = [r for r in recs if split_of(f"url:{r['url']}", cfg) == "val" and len(r["text"].split()) >= 150]
    leaks = []
    for k, r in enumerate(val):
        url = next(u for j in range(100) if split_of(f"url:{(u := f'https://example.org/{k}-{j}')}", cfg) == "train")
        host = next(hosts)
        cut = len(host) // 2
        leaks.append({"id": f"leak-{k}", "text": f"{host[:cut]}\n\n{r['text']}\n\n{host[cut:]}", "url": url})
    return recs + leaks, [*SPLIT, f"tokenize.seed={seed}"] if len(leaks) >= 3 else []


def test_leaked_split_fails_before_training(tmp_path):
    records, split = leaked_records()
    assert split, "the seed puts fewer than 3 long sections in val"
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    wd = tmp_path / "wd"
    args = ["run", ROOT / "deploy/configs/demo.yaml", "--json", "--set", f"workdir={wd}",
            "--set", f"collect.inputs={json.dumps([str(src)])}"]
    for s in [*TINY, *split, "train.max_steps=4", "train.checkpoint.every=4"]:
        args += ["--set", s]
    # the ephemeral Prefect server gets 90 s to start (flows/startup/environment.py); on a 2-core machine shared with other
    # test runs that was not always enough, and this test is about the check, not the server's start
    env = {**os.environ, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}
    proc = lifecycle(*args, rc=1, env=env, timeout=1200)
    out = last_json(proc.stdout)
    assert out["status"] == "failed" and out["error"].startswith("ContaminationError: "), proc.stderr[-3000:]
    err = out["error"]
    assert "are near copies of training text" in err
    assert f"above tokenize.max_contamination={TokenizeConfig().max_contamination}" in err
    assert "the run stops before training" in err and "closest: val " in err
    report_path = err.rsplit("what overlaps: ", 1)[1].split(" ")[0]
    report = json.loads(open(report_path).read())
    near = [r for r in report["closest_val_docs"] if r["near_copy"]]
    assert near and all(r["train_source_id"].startswith("leak-") for r in near)
    assert near[0]["train_source_id"] in err and report_path.startswith(str(wd))
    assert "lifecycle run: run failed: ContaminationError" in proc.stderr + proc.stdout
    assert not list(wd.glob("**/checkpoints/step_*"))  # no training step was ever committed

    with sqlite3.connect(wd / ".prefect" / "prefect.db") as db:
        assert [r[0] for r in db.execute("SELECT state_type FROM flow_run")] == ["FAILED"]
    uri = f"sqlite:///{wd / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    stages = {r.data.tags.get("lifecycle.stage") for r in runs}
    assert "scrub" in stages and not stages & {"train", "evaluate"}
    [parent] = [r for r in runs if "lifecycle.stage" not in r.data.tags]
    assert parent.info.status == "FAILED"
    assert client.search_registered_models() == []
