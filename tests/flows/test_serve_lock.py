"""Every flow run takes the work-dir lock, not only `lifecycle run`: a run that `lifecycle serve` starts on its
schedule refuses while a manual `lifecycle run` holds the work dir, naming the work dir and the holder; and
`lifecycle run`, which takes the lock before starting its flow, goes on under its own hold (re-entrant in-process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from lifecycle.config import load_config
from lifecycle.core.locking import WorkdirBusy, workdir_lock
from tests.conftest import ROOT

HOLD = textwrap.dedent("""
    import sys, time
    from lifecycle.core.locking import workdir_lock
    with workdir_lock(sys.argv[1], holder="lifecycle run"):
        print("held", flush=True)
        time.sleep(600)
""")

# what a served deployment's run does: Prefect calls the flow with the deployment's JSON parameters
SERVED = textwrap.dedent("""
    import json, sys
    from lifecycle.flows.startup.environment import prepare_environment
    params = json.loads(open(sys.argv[1]).read())
    prepare_environment(params["config"]["workdir"])
    from lifecycle.flows.pipeline import lifecycle_flow
    try:
        lifecycle_flow(**params)
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        sys.exit(1)
    print(json.dumps({"error": None}))
""")


@pytest.fixture
def held(tmp_path):
    """Another process (a manual `lifecycle run`) holds the work dir."""
    wd = tmp_path / "wd"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(wd)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield wd, proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_served_flow_run_refuses_a_work_dir_another_run_holds(held, tmp_path):
    wd, pid = held
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "d0", "text": "a document " * 40}) + "\n")
    cfg = load_config(ROOT / "deploy/configs/demo.yaml",
                      [f"workdir={wd}", f'collect.inputs=["{src}"]', "collect.incremental=true"])
    params = tmp_path / "params.json"
    params.write_text(json.dumps({"config": cfg.model_dump(mode="json"), "until": "collect"}))  # as `serve` passes
    proc = subprocess.run([sys.executable, "-c", SERVED, str(params)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    err = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert err.startswith("WorkdirBusy: ") and f"work dir {wd} is in use" in err
    assert f"pid {pid}, lifecycle run, since " in err  # the holder
    assert not (wd / "datasets").exists() and not (wd / "mlflow.db").exists()  # it did nothing


def test_the_lock_is_reentrant_only_when_asked(tmp_path):
    wd = tmp_path / "wd"
    with workdir_lock(wd, holder="lifecycle run"):
        with workdir_lock(wd, holder="flow run x", reentrant=True):  # `lifecycle run`'s own flow run
            pass
        with pytest.raises(WorkdirBusy, match=r"in use by another lifecycle run \(pid \d+, lifecycle run, since"):
            with workdir_lock(wd):
                pass
        with workdir_lock(wd, reentrant=True):  # the outer hold survived the inner ones
            pass
    with workdir_lock(wd, holder="flow run y"):  # released
        pass
    assert json.loads((wd / ".lifecycle.lock").read_text())["holder"] == "flow run y"
