"""A contaminated run fails at the contamination gate: `lifecycle run` as users start it (ephemeral Prefect
server, MLflow on SQLite, 2 DeepSpeed CPU ranks) on documents that all end with the same 16-word licence line,
so every held-out document shares a 13-gram with training. The run exits 1 with the gate's one-line error, the
Prefect flow run is Failed, nothing is packaged or registered, and MLflow holds the contamination rate on the
evaluate run (and the runs are FAILED). The fast unit-level twin is tests/eval/test_gate.py.

    LIFECYCLE_SLOW=1 .venv/bin/python -m pytest -m slow tests/flows/test_contamination_gate.py
"""

import json
import os
import sqlite3

import pytest
from mlflow import MlflowClient

from tests.conftest import ROOT, corpus_records, last_json, lifecycle
from tests.eval.test_gate import BOILERPLATE
from tests.flows.test_flow_e2e import TINY

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # trains before it can evaluate: about 2 minutes here


def test_contaminated_run_fails_at_the_gate_with_the_rate_in_mlflow(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({**r, "text": f"{r['text']} {BOILERPLATE}"}) + "\n" for r in corpus_records(80)))
    wd = tmp_path / "wd"
    args = ["run", ROOT / "deploy/configs/demo.yaml", "--json", "--set", f"workdir={wd}",
            "--set", f"collect.inputs={json.dumps([str(src)])}"]
    for s in [*TINY, "train.max_steps=4", "train.checkpoint.every=4", "train.logging.eval_every=4",
              "evaluate.max_contamination=0.5"]:
        args += ["--set", s]
    # the ephemeral Prefect server gets 90 s to start (flows/servers.py); on a 2-core machine shared with other
    # test runs that was not always enough, and this test is about the gate, not the server's start
    env = {**os.environ, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}
    proc = lifecycle(*args, rc=1, env=env, timeout=1200)
    out = last_json(proc.stdout)
    assert out["status"] == "failed" and out["error"].startswith("ContaminationError: "), proc.stderr[-3000:]
    assert "share a 13-gram with the training documents, above evaluate.max_contamination=0.5" in out["error"]
    assert "lifecycle run: run failed: ContaminationError" in proc.stderr + proc.stdout
    assert not (wd / "checkpoint").exists()  # stopped before packaging: nothing to register

    with sqlite3.connect(wd / ".prefect" / "prefect.db") as db:
        assert [r[0] for r in db.execute("SELECT state_type FROM flow_run")] == ["FAILED"]
    uri = f"sqlite:///{wd / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    [evaluate] = [r for r in runs if r.data.tags.get("lifecycle.stage") == "evaluate"]
    rate = evaluate.data.metrics["contamination_doc_rate"]
    assert rate > 0.5 and evaluate.data.metrics["contamination_dirty_docs"] >= 1
    assert f"({rate:.1%})" in out["error"]
    assert evaluate.data.tags["lifecycle.scale.gen_bleu"] == "0-100, sacrebleu corpus BLEU"
    m = evaluate.data.metrics  # the other new evaluate metrics are logged beside it
    assert {"gen_meteor", "robust_typo_bpb_increase", "robust_case_gen_bleu_drop", "tox_flagged_share",
            "bias_gender_gap"} <= set(m)
    assert m["tox_samples"] == m["gen_prompts"] + m["bias_gender_completions"]
    [parent] = [r for r in runs if "lifecycle.stage" not in r.data.tags]
    assert parent.info.status == "FAILED"
    assert client.search_registered_models() == []
