"""The adversarial pass at the level of `lifecycle run`: 64 flipped bytes in a committed collect part and a
committed scrub part, then a rerun; a damaged `mlflow.db`, then a rerun."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.core.test_integrity import flip
from tests.core.test_shards import write_inputs
from tests.lineage.test_tracking_store import flip_middle

ROOT = Path(__file__).resolve().parents[2]


def run(workdir: Path, inputs: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lifecycle.cli", "run", str(ROOT / "deploy/configs/demo.yaml"), "--json",
         "--until", "scrub", "--set", f"workdir={workdir}", "--set", f"collect.inputs={json.dumps(inputs)}",
         "--set", "orchestration.dask_workers=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_rerun_rebuilds_flipped_parts_and_refuses_a_damaged_mlflow_store(tmp_path):
    inputs = write_inputs(tmp_path / "in", files=2, per_file=30)
    wd = tmp_path / "w"
    first = run(wd, inputs)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    parts = {}
    for stage in ("collect", "scrub"):
        manifest = Path(summary["datasets"][stage])
        part = manifest.parent / json.loads(manifest.read_text())["files"][0]["path"]
        flip(part)
        parts[stage] = part

    second = run(wd, inputs)
    assert second.returncode == 0, second.stderr[-3000:]
    again = json.loads(second.stdout.strip().splitlines()[-1])
    assert again["stages"] == {"collect": "computed", "filter": "reused", "dedup": "reused", "scrub": "computed"}
    assert again["datasets"] == summary["datasets"]  # the same bytes, rebuilt where they were
    for stage, part in parts.items():
        assert f"{part}: sha256" in second.stderr and "moved it aside" in second.stderr
        assert len(list((wd / "damaged" / stage).iterdir())) == 1
    backups = sorted((wd / "backups").glob("mlflow-*.db"))
    assert len(backups) == 2  # one per completed run

    flip_middle(wd / "mlflow.db")
    t0 = time.monotonic()
    third = run(wd, inputs)
    assert third.returncode == 1
    assert f"MLflow store {wd / 'mlflow.db'} is damaged" in third.stderr and f"cp {backups[-1]}" in third.stderr
    assert json.loads(third.stdout.strip().splitlines()[-1])["status"] == "failed"
    assert time.monotonic() - t0 < 120
