"""A tracking server that dies (or hangs) in the middle of a run fails the run within seconds, with one error naming
its URI, instead of minutes of urllib3 `Retrying` warnings and then `ObjectNotFound: None` (issue 21, item 6).

A real `mlflow server` is started on a free port, a run logs into it, the server is killed (SIGKILL) or stopped
(SIGSTOP: it keeps its socket and never answers), and the next logging call must fail within the bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from pydantic import BaseModel

from lifecycle.core.procs import free_port
from lifecycle.flows.startup.servers import commands
from lifecycle.lineage.tracking import Tracker, TrackingConfig, TrackingStoreError, bound_http_requests
from tests.conftest import ROOT


class Cfg(BaseModel):
    workdir: str


def start_server(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv, env, _ = commands(tmp_path, 0, port, runner=False)["mlflow"]  # `lifecycle up`'s server, env included
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd=tmp_path)
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        assert proc.poll() is None, "mlflow server exited during start-up"
        assert time.monotonic() < deadline, "mlflow server did not start"
        time.sleep(0.5)


@pytest.fixture
def server(tmp_path):
    proc, url = start_server(tmp_path)
    yield proc, url
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    proc.wait()


@pytest.fixture(autouse=True)
def own_env(monkeypatch):
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("fault,cfg,bound_s", [
    ("SIGKILL", TrackingConfig(model_name="m"), 30),  # the defaults: connection refused, ~3 s
    pytest.param("SIGSTOP", TrackingConfig(model_name="m", http_timeout_s=2, http_retries=1), 20,  # hung: 2 x 2 s + 2 s
                 marks=pytest.mark.slow),
])
def test_server_dying_mid_run_fails_within_seconds_naming_the_uri(server, tmp_path, fault, cfg, bound_s):
    proc, url = server
    t = Tracker(cfg.model_copy(update={"tracking_uri": url}), str(tmp_path / "wd"), "exp")
    t.start("run", Cfg(workdir=str(tmp_path)), {"prefect.flow_run_id": "fr"})
    t.log_metrics("collect", {"rows_in": 10})  # the run logs through the server
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == str(cfg.http_retries)
    os.killpg(proc.pid, getattr(signal, fault))
    if fault == "SIGKILL":
        proc.wait()
    t0 = time.monotonic()
    with pytest.raises(TrackingStoreError) as e:
        t.log_metrics("filter", {"rows_in": 10})
    took = time.monotonic() - t0
    print(f"{fault}: failed after {took:.1f} s")
    assert took < bound_s, took
    msg = str(e.value)
    assert f"MLflow tracking server {url} stopped answering during the run" in msg and "\n" not in msg
    t1 = time.monotonic()  # once known down, every further call fails at once, and ending the run does not hang
    with pytest.raises(TrackingStoreError, match="stopped answering"):
        t.log_metrics("dedup", {"rows_in": 1})
    t.end("FAILED")
    assert time.monotonic() - t1 < 1


def test_the_users_own_mlflow_http_settings_are_kept(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")
    bound_http_requests(TrackingConfig(http_retries=1, http_timeout_s=3))
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"  # set by the user: kept
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "3" and os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "1"
    bound_http_requests(TrackingConfig(http_timeout_s=4))  # ours: a later tracker's config replaces them
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "4" and os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"


@pytest.mark.slow
def test_lifecycle_run_fails_within_seconds_when_its_tracking_server_dies(server, tmp_path):
    """The whole command: `lifecycle run` logging to a server that is killed once collect has been logged."""
    proc, url = server
    src = tmp_path / "in.jsonl"
    src.write_text("".join('{"id": "d%d", "text": "%s"}\n' % (i, f"document number {i} " * 40) for i in range(20)))
    run = subprocess.Popen([sys.executable, "-m", "lifecycle.cli", "run", "--until", "dedup", "--set",
                            f"workdir={tmp_path / 'wd'}", "--set", f'collect.inputs=["{src}"]', "--set",
                            f"tracking.tracking_uri={url}"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    from mlflow import MlflowClient

    client = MlflowClient(url)
    deadline = time.monotonic() + 300
    while not any(r.data.tags.get("lifecycle.stage") == "collect" for r in client.search_runs(
            [e.experiment_id for e in client.search_experiments()])):
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    out, err = run.communicate(timeout=120)
    print(f"lifecycle run failed {time.monotonic() - t0:.1f} s after the kill")
    assert run.returncode == 1 and time.monotonic() - t0 < 60, err[-3000:]
    [line] = [ln for ln in err.splitlines() if "run failed" in ln]  # one line says why, naming the server
    assert f"TrackingStoreError: MLflow tracking server {url} stopped answering" in line
    assert "Traceback" not in err, err[-3000:]


def test_a_server_that_answers_with_errors_is_told_apart_from_one_that_is_gone():
    """The object store behind MLflow's artifact proxy down: the server answers every retry with a 5xx, and
    requests ends in a RetryError. The message names the store behind the server that failed (the artifact store
    for an upload, the backend database otherwise), not that the server stopped
    answering (issue 46: it blamed the server and `lifecycle up`)."""
    import requests

    from lifecycle.lineage.tracking import GuardedClient

    class Client:
        def log_artifact(self, *a):
            raise requests.exceptions.RetryError("Max retries exceeded (too many 500 error responses)")

        log_text = log_artifact

        def log_param(self, *a):
            raise requests.exceptions.RetryError("Max retries exceeded (too many 500 error responses)")

        def log_metric(self, *a):
            raise requests.exceptions.ConnectionError("Connection refused")

    with pytest.raises(TrackingStoreError, match="answered log_artifact with server errors .* the server is up, "
                                                 "the artifact store it proxies uploads to is not"):
        GuardedClient(Client(), "http://x").log_artifact("f")
    with pytest.raises(TrackingStoreError, match="answered log_text .* the artifact store it proxies uploads to"):
        GuardedClient(Client(), "http://x").log_text("t", "f.txt")
    with pytest.raises(TrackingStoreError, match="answered log_param with server errors .* the server is up, its "
                                                 "backend store is not .the database"):
        GuardedClient(Client(), "http://x").log_param("p", 1)
    with pytest.raises(TrackingStoreError, match="stopped answering during the run .log_metric"):
        GuardedClient(Client(), "http://x").log_metric("m", 1)
