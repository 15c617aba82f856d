"""The production layout in deploy/: structure checks of the Dockerfile, the compose file, prefect.yaml and every
shipped pipeline config (deploy/configs/*.yaml)."""

import re

import pytest
import yaml
from prefect.client.schemas.schedules import CronSchedule

from lifecycle.flows.pipeline import lifecycle_flow
from lifecycle.config import validate_config
from lifecycle.tasks.stages import NAMES as STAGES
from lifecycle.core.fs import is_remote
from tests.conftest import ROOT, load_shipped

DEPLOY = ROOT / "deploy"
CONFIGS = sorted((DEPLOY / "configs").glob("*.yaml"))


def test_shipped_configs_are_found():
    assert {"demo.yaml", "fineweb.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates_and_its_inputs_exist(path, tmp_path):
    cfg = load_shipped(path, tmp_path)  # raises ConfigError naming the file and the field if any value is invalid
    assert cfg.filter.rules, f"{path.name}: no filter rule listed"
    for pattern in cfg.collect.inputs:  # each config runs as shipped, from the repository root
        assert is_remote(pattern) or list(ROOT.glob(pattern)), f"{path.name}: collect.inputs {pattern!r} matches nothing"


def test_compose_services_postgres_for_both_and_loopback_ports():
    c = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = c["services"]
    assert {"postgres", "prefect-server", "mlflow", "worker"} <= set(services)
    assert "postgresql+asyncpg://" in services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert any(a.startswith("postgresql://") for a in services["mlflow"]["command"])
    init = (DEPLOY / "postgres-init.sql").read_text()
    assert "CREATE DATABASE prefect" in init and "CREATE DATABASE mlflow" in init
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    worker_env = services["worker"]["environment"]
    assert worker_env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert worker_env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"


def test_compose_holds_no_literal_secret():
    text = (DEPLOY / "compose.yaml").read_text()
    for url in re.findall(r"postgres(?:ql)?(?:\+\w+)?://[^\s\"']+", text):
        user_pass = url.split("://", 1)[1].split("@", 1)[0]
        assert user_pass.split(":", 1)[1].startswith("${"), f"literal password in {url}"
    assert "${POSTGRES_PASSWORD:?" in text  # compose refuses to start without it


def test_dockerfile_installs_the_pinned_cpu_environment():
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.startswith("#") and re.search(r"^FROM python:3\.11", text, re.M)
    assert "-c constraints.txt" in text and "download.pytorch.org/whl/cpu" in text
    assert re.search(r"^USER (?!root)", text, re.M)
    for path in ("lifecycle", "flows", "tasks", "lineage"):
        assert f"COPY {path} " in text


@pytest.mark.parametrize("dep", yaml.safe_load((DEPLOY / "prefect.yaml").read_text())["deployments"],
                         ids=lambda d: d["name"])
def test_prefect_deployments_resolve_validate_and_schedule(dep):
    path, fn = dep["entrypoint"].split(":")
    assert (ROOT / path).exists() and fn == lifecycle_flow.fn.__name__
    params = dep["parameters"]
    validate_config(params["config"])  # raises, naming the field, if the deployment's config is invalid
    assert params.get("until") in (None, *STAGES)
    assert set(params) <= set(lifecycle_flow.parameters.properties)
    for s in dep["schedules"]:
        CronSchedule(cron=s["cron"], timezone=s.get("timezone", "UTC"))
    assert dep["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
