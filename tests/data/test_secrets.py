"""Secrets come from the environment, never from the pipeline config, and never reach MLflow or Prefect."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle.config import ConfigError, load_config
from tests.conftest import ROOT

CANARY_KEY = "canaryAWSsecret9f8e7d6c5b4a"
CANARY_PW = "canaryDBpassword0a1b2c3d"


@pytest.mark.parametrize("override", [
    f"tracking.tracking_uri=http://alice:{CANARY_PW}@mlflow.example.com",
    f'collect.inputs=["s3://key:{CANARY_KEY}@bucket/data/*.jsonl"]',
])
def test_credentials_in_the_config_are_refused_without_echoing_them(override):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "deploy/configs/demo.yaml", [override])
    assert "environment" in str(e.value)
    assert CANARY_PW not in str(e.value) and CANARY_KEY not in str(e.value)


def test_environment_secrets_never_reach_mlflow_or_prefect(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": f"an ordinary document number {i} " * 20}) + "\n"
                           for i in range(6)))
    wd = tmp_path / "w"
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": CANARY_KEY,
           "LIFECYCLE_DATABASE_URL": f"postgresql://lifecycle:{CANARY_PW}@db:5432/prefect"}
    proc = subprocess.run([sys.executable, "-m", "lifecycle.cli", "run", "--json", "--until", "tokenize",
                           "--set", f"workdir={wd}", "--set", f'collect.inputs=["{src}"]',
                           "--set", "tokenize.vocab_size=300", "--set", "tokenize.val_fraction=0.3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["status"] == "completed"
    # every byte the run left: the MLflow store and artifacts, Prefect's database and logs, datasets, results
    files = [p for p in Path(wd).rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files) and any(p.suffix == ".db" and "prefect" in p.name for p in files)
    for p in files:
        data = p.read_bytes()
        assert CANARY_KEY.encode() not in data and CANARY_PW.encode() not in data, f"secret leaked into {p}"
    assert CANARY_KEY not in proc.stdout + proc.stderr and CANARY_PW not in proc.stdout + proc.stderr
