"""Secrets come from the environment, never from the pipeline config. That environment secrets never reach MLflow
or Prefect is checked on the canary run (tests/flows/test_canary.py)."""

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
