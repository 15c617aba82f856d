"""Stage tasks on a real (temporary) Prefect server: retries with backoff for transient errors, no retry for errors
that cannot heal, and no Prefect cache: the dataset store is the only one (a deleted dataset is rebuilt)."""

import json
from pathlib import Path

import pytest
from prefect import flow
from prefect.testing.utilities import prefect_test_harness

from lifecycle.flows.retry import stage_task
from lifecycle.config import OrchestrationConfig
from lifecycle.tasks.data.collect.stage import CollectConfig, InputError, resolve_inputs, run_collect

ORCH = OrchestrationConfig(data_retries=2, retry_backoff_s=0.01, retry_jitter=0)
CALLS: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def prefect_server(tmp_path_factory):
    import os
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(tmp_path_factory.mktemp("results"))
    with prefect_test_harness(server_startup_timeout=120):
        yield


TIMES: dict[str, list[float]] = {}


def flaky(n_failures: int, key: str) -> str:
    import time
    CALLS.append(key)
    TIMES.setdefault(key, []).append(time.monotonic())
    if CALLS.count(key) <= n_failures:
        raise ConnectionError(f"transient failure {CALLS.count(key)}")
    return "ok"


def bad_input(key: str) -> str:
    CALLS.append(key)
    raise InputError("collect.inputs: pattern 'x' matches no file")


def test_transient_errors_are_retried_then_succeed():
    @flow
    def f():
        return stage_task(flaky, "flaky", ORCH, retries=ORCH.data_retries)(2, "t1")

    assert f() == "ok" and CALLS.count("t1") == 3


def test_retry_delays_back_off_exponentially():
    orch = OrchestrationConfig(data_retries=2, retry_backoff_s=0.6, retry_jitter=0)
    t = stage_task(flaky, "flaky", orch, retries=orch.data_retries)
    assert t.retry_delay_seconds == [0.6, 1.2]

    @flow
    def f():
        return t(2, "delays")

    assert f() == "ok"
    gaps = [b - a for a, b in zip(TIMES["delays"], TIMES["delays"][1:])]
    assert len(gaps) == 2 and gaps[0] >= 0.6 and gaps[1] >= 1.2 and gaps[1] > gaps[0], gaps


def slow(seconds: float) -> str:
    import time
    time.sleep(seconds)
    return "done"


def test_stage_timeout():
    orch = OrchestrationConfig(data_retries=0, stage_timeout_s=1)

    @flow
    def f():
        return stage_task(slow, "slow", orch, retries=0)(10)

    with pytest.raises(TimeoutError):
        f()


def test_retries_are_bounded():
    @flow
    def f():
        return stage_task(flaky, "flaky", ORCH, retries=ORCH.data_retries)(5, "t2")

    with pytest.raises(ConnectionError):
        f()
    assert CALLS.count("t2") == 3  # one try + two retries


def test_permanent_errors_are_not_retried():
    @flow
    def f():
        return stage_task(bad_input, "bad", ORCH, retries=ORCH.data_retries)("t3")

    with pytest.raises(InputError):
        f()
    assert CALLS.count("t3") == 1


def test_prefect_caches_nothing_the_dataset_store_answers(tmp_path):
    """A second flow run over the same content runs the task again (no Prefect cache), and the stage finds its
    own committed dataset; new content makes a new dataset."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "one document"}) + "\n")
    cfg = CollectConfig(inputs=[str(src)])

    @flow
    def f():
        t = stage_task(run_collect, "collect", ORCH, retries=0)
        state = t(cfg, str(tmp_path / "w"), inputs=resolve_inputs(cfg.inputs), return_state=True)
        return state.name, state.result()

    name1, ref1 = f()
    name2, ref2 = f()
    assert (name1, name2) == ("Completed", "Completed")
    assert (ref1.reused, ref2.reused) == (False, True) and ref2.path == ref1.path and ref2.sha256 == ref1.sha256
    src.write_text(json.dumps({"text": "changed content"}) + "\n")
    name3, ref3 = f()
    assert name3 == "Completed" and not ref3.reused and ref3.sha256 != ref1.sha256


def test_a_deleted_dataset_is_rebuilt_on_rerun(tmp_path):
    """The flow's stage runner over collect..tokenize; the scrub dataset is deleted; the rerun rebuilds exactly it
    (same fingerprint, same bytes), reuses the rest, and no stale result points at the deleted folder."""
    import shutil

    from lifecycle.config import load_config
    from lifecycle.flows.stage_runner import RunSummary, StageRunner
    from lifecycle.tasks.stages import COLLECT, DEDUP, FILTER, SCRUB, TOKENIZE
    from tests.conftest import corpus_records

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in corpus_records(40)))
    cfg = load_config(None, [f"workdir={tmp_path / 'w'}", f"collect.inputs=[\"{src}\"]", "tokenize.vocab_size=300",
                             "tokenize.val_fraction=0.2", "orchestration.dask_workers=0"])

    @flow
    def data_stages() -> dict:
        summary = RunSummary(workdir=cfg.workdir)
        run = StageRunner(cfg, summary, "tokenize", on_done=lambda *a: None)
        try:
            docs = run(COLLECT, inputs=resolve_inputs(cfg.collect.inputs))
            tokens = run(TOKENIZE, run(SCRUB, run(DEDUP, run(FILTER, docs))))
        finally:
            run.close()
        assert tokens is not None
        return summary.model_dump()

    first = data_stages()
    assert set(first["stages"].values()) == {"computed"}, first["stages"]
    scrub_dir = Path(first["datasets"]["scrub"]).parent
    manifest = (scrub_dir / "_manifest.json").read_text()
    shutil.rmtree(scrub_dir)
    again = data_stages()
    assert again["stages"] == {"collect": "reused", "filter": "reused", "dedup": "reused", "scrub": "computed",
                               "tokenize": "reused"}
    assert again["datasets"] == first["datasets"]
    rebuilt = json.loads((scrub_dir / "_manifest.json").read_text())
    assert rebuilt["sha256"] == json.loads(manifest)["sha256"] and rebuilt["fingerprint"] == json.loads(manifest)["fingerprint"]


def test_a_failing_tracking_store_does_not_hide_the_runs_own_error(tmp_path, monkeypatch):
    """A stage fails after the MLflow runs are open, and marking them FAILED fails too (as on a full disk, found by
    bench.chaos disk_full): the error the flow raises is the stage's own, and the work dir's lock is released.
    Without the guard in `_pipeline`, the OSError from the store replaced the stage's error."""
    from lifecycle.config import load_config
    from lifecycle.flows import pipeline
    from lifecycle.lineage.tracking import Tracker

    ends: list[str] = []
    real_end = Tracker.end

    def failing_end(self, status="FINISHED"):
        ends.append(status)
        if status != "FINISHED":
            raise OSError(28, "No space left on device")
        return real_end(self, status)

    class CollectFails(pipeline.StageRunner):
        def __call__(self, stage, *args, **kw):
            raise InputError("collect: corpus.jsonl: record 3: `text` is int")

    monkeypatch.setattr(Tracker, "end", failing_end)
    monkeypatch.setattr(pipeline, "StageRunner", CollectFails)
    src = tmp_path / "corpus.jsonl"
    src.write_text(json.dumps({"text": "one document"}) + "\n")
    cfg = load_config(None, [f"workdir={tmp_path / 'w'}", f"collect.inputs=[\"{src}\"]"])
    with pytest.raises(InputError, match="record 3"):
        pipeline.lifecycle_flow(cfg)
    assert ends == ["FAILED"]
    monkeypatch.setattr(Tracker, "end", real_end)
    with pytest.raises(InputError, match="record 3"):  # the lock was released: the rerun fails the same way
        pipeline.lifecycle_flow(cfg)
