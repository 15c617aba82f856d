"""Config: every shipped file validates; bad values fail before any work, naming the field."""

from pathlib import Path

import pytest

from lifecycle.config import ConfigError, load_config, parse_override
from tests.conftest import ROOT, last_json, lifecycle, load_shipped

CONFIGS = sorted((ROOT / "deploy" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path, tmp_path):
    cfg = load_shipped(path, tmp_path)
    assert cfg.collect.inputs or cfg.image_collect.inputs  # each path reads its own inputs


def test_overrides_by_dotted_path_parse_yaml(tmp_path):
    cfg = load_config(ROOT / "deploy/configs/demo.yaml", [
        f"workdir={tmp_path}", 'collect.inputs=["/data/*.jsonl", "/more/*.parquet"]', "train.max_steps=50",
        "train.model.norm=layernorm", "dedup.minhash.verify_jaccard=0.8", "filter.gopher_quality.min_doc_words=null"])
    assert cfg.workdir == str(tmp_path)
    assert cfg.collect.inputs == ["/data/*.jsonl", "/more/*.parquet"]
    assert cfg.train.max_steps == 50 and cfg.train.model.norm == "layernorm"
    assert cfg.dedup.minhash.verify_jaccard == 0.8 and cfg.filter.gopher_quality.min_doc_words is None


@pytest.mark.parametrize("override, field", [
    ("train.max_steps=-3", "train.max_steps"),
    ("train.engine.zero_stage=7", "train.engine.zero_stage"),
    ("train.model.norm=batchnorm", "train.model.norm"),
    ("dedup.minhash.bands=0", "dedup.minhash.bands"),
    ("collect.inputs=[]", "collect.inputs"),
    ("filter.no_such_rule=1", "filter.no_such_rule"),
    ("tokenize.vocab_size=abc", "tokenize.vocab_size"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "deploy/configs/demo.yaml", [override])
    assert f"`{field}`" in str(e.value)


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("train.max_steps")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("collect: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_cli_rejects_bad_config_before_any_work(tmp_path):
    args = ["run", str(ROOT / "deploy/configs/demo.yaml"), "--json",
            "--set", f"workdir={tmp_path / 'w'}", "--set", "train.max_steps=-3"]
    proc = lifecycle(*args, rc=2, timeout=120)
    assert "train.max_steps" in proc.stderr
    assert last_json(proc.stdout)["status"] == "invalid_config"
    assert not Path(tmp_path / "w").exists()
