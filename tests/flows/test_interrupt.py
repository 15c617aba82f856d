"""SIGTERM to a `lifecycle run` during training, sent to its whole process group as `timeout` and a terminal's ^C
do: the run ends within 30 s with exit 143 and a clear line, no rank is left, the flow run is Cancelled (MLflow:
KILLED), and the rerun resumes and completes.
Two full runs of the tiny pipeline: slow-marked.

    LIFECYCLE_SLOW=1 .venv/bin/python -m pytest -m slow tests/flows/test_interrupt.py
"""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, corpus_records, last_json
from tests.faults import descendants_of_supervisor
from tests.flows.test_flow_e2e import TINY


@pytest.mark.slow
def test_sigterm_during_training_ends_the_run_cleanly_and_the_rerun_completes(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in corpus_records(120)))
    wd = tmp_path / "wd"
    args = [sys.executable, "-m", "lifecycle.cli", "run", str(ROOT / "deploy/configs/demo.yaml"), "--json",
            "--set", f"workdir={wd}", "--set", f"collect.inputs={json.dumps([str(src)])}"]
    for s in [*TINY, "train.max_steps=60", "train.optimizer.decay_steps=60"]:
        args += ["--set", s]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not list(wd.glob("train/*/heartbeat/rank1")):
            assert proc.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)  # the CLI, its Dask workers; not the ranks (their own group)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    assert took < 30, took
    assert "lifecycle: interrupted by SIGTERM" in err and "ConnectError" not in err
    assert last_json(out) == {"status": "interrupted", "signal": "SIGTERM"}
    assert descendants_of_supervisor(proc.pid) == []  # no rank left
    [run_dir] = wd.glob("train/*")
    assert not (run_dir / "checkpoints" / "step_00000060").exists()  # nothing committed half-way (or at all yet)
    with sqlite3.connect(wd / ".prefect" / "prefect.db") as db:  # stopped on purpose: Cancelled, not Crashed
        assert [r[0] for r in db.execute("SELECT state_type FROM flow_run")] == ["CANCELLED"]
    with sqlite3.connect(wd / "mlflow.db") as db:  # the parent run and the stage that was running: KILLED
        statuses = {r[0] for r in db.execute("SELECT status FROM runs")}
    assert "KILLED" in statuses and "RUNNING" not in statuses, statuses

    rerun = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = last_json(rerun.stdout)
    assert summary["status"] == "completed" and summary["stages"]["train"] != "reused"
    assert (run_dir / "checkpoints" / "step_00000060" / "COMMITTED.json").exists()
