"""Exact resume after SIGKILL for one launched layout: the harness the pipeline, 3D and MoE × pipeline tests share.

`resumes_exactly` runs `run_train` in a child process (a config function of a test module, the tokens of
`make_tokens(…, docs)`, checkpoints saved synchronously), SIGKILLs the supervisor and every rank once step `at` is
committed, reruns the same call, and asserts the rerun resumed from `at` and gave the uninterrupted run's loss
at every step and its final consolidated weights, bit for bit. Synchronous saves write the same files and
numerics as the asynchronous ones; at ~0.1 s a step an async commit of step 10 can land after step 20, leaving
no window to kill in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.faults import ROOT, kill_all, records

CHILD = r"""
import importlib, json, sys
sys.path.insert(0, {root!r})
from tests.train.test_train import make_tokens
from lifecycle.tasks.train.launch import run_train
make = getattr(importlib.import_module({module!r}), {name!r})
r = run_train(make_tokens({tokdir!r}, {docs!r}), make(**{kwargs!r}), {workdir!r})
print(json.dumps({{"checkpoint": r.checkpoint_dir, "metrics": r.metrics_path, "resumed_from": r.resumed_from}}))
"""


def _kill_run(proc: subprocess.Popen, workdir: Path) -> list[int]:
    """SIGKILL the supervisor and its ranks (tests.faults.kill_all, by the supervisor's pid in their environment),
    then any process still running a config under `workdir` (by its command line); returns those second ones."""
    kill_all(proc)
    mark, missed = str(workdir).encode(), []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and mark in (d / "cmdline").read_bytes():
                os.kill(int(d.name), signal.SIGKILL)
                missed.append(int(d.name))
        except (OSError, ProcessLookupError):
            continue
    return missed


def _train_losses(metrics_path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, open(metrics_path)) if r["kind"] == "train"]


def resumes_exactly(tmp_path: Path, config: str, kwargs: dict, reference, at: int = 10, docs: int = 600,
                    timeout: float = 1200) -> dict:
    """Kill the run of `config` ("tests.module:function", called with `kwargs`) on `make_tokens`' first `docs`
    documents after its step-`at` commit, rerun it, and compare with `reference` (the uninterrupted run's
    RunResult, on the same tokens). Returns the rerun's {checkpoint, metrics, resumed_from}."""
    from lifecycle.core import fs
    from lifecycle.tasks.train import commit as ckpt

    module, name = config.split(":")
    tokdir, workdir = tmp_path / "tok", tmp_path / "w"
    code = CHILD.format(root=str(ROOT), module=module, name=name, tokdir=str(tokdir), workdir=str(workdir),
                        docs=docs, kwargs={"checkpoint.async_save": False, **kwargs})
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    # the run to kill at low priority, so that on a loaded machine this poll still sees the commit before the next
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env, preexec_fn=lambda: os.nice(10))
    deadline = time.monotonic() + timeout

    def committed() -> list[int]:
        return [s for run in (workdir / "train").glob("*") for s, _ in ckpt.list_committed(run / "checkpoints")]

    try:
        while at not in committed():
            assert proc.poll() is None and time.monotonic() < deadline, f"the run ended before the step-{at} commit"
            time.sleep(0.05)
    finally:
        missed = _kill_run(proc, workdir)
    time.sleep(1)  # a rank that outlived the kill would commit on
    ref = _train_losses(reference.metrics_path)
    assert max(committed()) == at, f"commits {committed()} after the kill, not step {at}'s (outlived it: {missed})"
    assert max(r["step"] for r in records(str(workdir), "train")) < ref[-1][0], "killed after the last step"
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    assert again.returncode == 0, again.stderr[-3000:]
    out = json.loads(again.stdout.strip().splitlines()[-1])
    log = [line for run in (workdir / "train").glob("*") for line in (run / "train.log").read_text().splitlines()
           if line.startswith(("===", "committed", "resumed")) or "gone" in line]
    assert out["resumed_from"] == at, (out, log)
    assert _train_losses(out["metrics"]) == ref
    assert fs.sha256_file(Path(out["checkpoint"]) / "model.safetensors") == \
        fs.sha256_file(Path(reference.checkpoint_dir) / "model.safetensors")
    return out
