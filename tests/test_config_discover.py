"""Config you can discover (issue 24): `lifecycle config show` lists every field with its value, default and doc;
`lifecycle config schema` validates every shipped config; an unknown key names the closest field."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from lifecycle.cli import main
from lifecycle.config import ConfigError, PipelineConfig, _sections, json_schema, load_config
from lifecycle.tasks.data.scrub.stage import PII_TYPES
from tests.conftest import ROOT, load_shipped

CONFIGS = sorted((ROOT / "deploy/configs").glob("*.yaml"))


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_show_lists_every_field_with_value_default_and_doc(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc, out, _ = run(capsys, "config", "show", "--set", "train.max_steps=50", "--json")
    fields = {f["field"]: f for f in json.loads(out)["fields"]}
    assert rc == 0 and len(fields) > 100
    assert fields["train.max_steps"]["value"] == 50
    assert fields["train.max_steps"]["default"] == PipelineConfig.model_fields["train"].default.max_steps
    assert fields["dedup.minhash.bands"]["value"] == 14 and fields["collect.inputs"]["required"]
    assert all(f["doc"] for f in fields.values()), [k for k, f in fields.items() if not f["doc"]]
    rc, text, _ = run(capsys, "config", "show", "--set", "train.max_steps=50")
    line = next(ln for ln in text.splitlines() if " train.max_steps:" in ln)
    assert line.startswith("* train.max_steps: 50   (default ") and "optimizer step" in text.lower()


def test_show_defaults_needs_no_config(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = run(capsys, "config", "show", "--defaults", "--json")
    fields = {f["field"]: f for f in json.loads(out)["fields"]}
    assert rc == 0 and fields["workdir"]["value"] == "runs/demo" and fields["collect.inputs"]["value"] is None


def test_every_field_and_section_has_a_description():
    seen, missing = set(), []

    def walk(cls, prefix):
        if cls in seen:
            return
        seen.add(cls)
        for name, f in cls.model_fields.items():
            if not (f.description or "").strip():
                missing.append(prefix + name)
            for sub in _sections(f.annotation):
                walk(sub, f"{prefix}{name}.")

    walk(PipelineConfig, "")
    assert len(seen) > 10 and missing == []


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates_against_the_schema(path, capsys, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")  # pinned (constraints.txt); pydantic below either way
    rc, out, _ = run(capsys, "config", "schema")
    schema = json.loads(out)
    assert rc == 0 and schema == json.loads(json.dumps(json_schema()))
    validator = jsonschema.Draft202012Validator(schema)
    data = yaml.safe_load(path.read_text())
    assert [e.message for e in validator.iter_errors(data)] == []
    assert [e.message for e in validator.iter_errors({**data, "train": {"max_step": 3}})] != []
    load_shipped(path, tmp_path)  # and pydantic agrees (a base-model config gets the tiny model it names)


def test_schema_writes_a_file(tmp_path, capsys):
    rc, _, err = run(capsys, "config", "schema", "-o", tmp_path / "s.json")
    assert rc == 0 and json.loads((tmp_path / "s.json").read_text())["title"] == "lifecycle pipeline config"
    assert "yaml-language-server" in err


def test_an_unknown_key_names_the_closest_field(tmp_path, capsys):
    demo = ROOT / "deploy/configs/demo.yaml"
    with pytest.raises(ConfigError, match=r"field `train.max_step`: Extra inputs are not permitted .*did you mean "
                                          r"`train.max_steps`\?"):
        load_config(demo, ["train.max_step=10"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**yaml.safe_load(demo.read_text()), "traim": {},
                                   "dedup": {"minhash": {"bandz": 14}}, "train": {"model": {"n_layers": 2}}}))
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    msg = str(e.value)
    for wrong, right in (("traim", "train"), ("dedup.minhash.bandz", "dedup.minhash.bands"), ("train.model.n_layers",
                                                                               "train.model.n_layer")):
        assert re.search(rf"field `{re.escape(wrong)}`: Extra inputs are not permitted( \(got \d+\))?; did you mean "
                         rf"`{re.escape(right)}`\?", msg), msg
    with pytest.raises(ConfigError) as e:  # nothing close: no guess
        load_config(demo, ["train.zzzzzz=1"])
    assert "did you mean" not in str(e.value)
    rc, _, err = run(capsys, "config", "show", "--set", "train.max_step=10")
    assert rc == 2 and "did you mean `train.max_steps`?" in err and len(err.strip().splitlines()) == 1


def test_the_demo_comment_counts_the_pii_types_that_are_on():
    demo = (ROOT / "deploy/configs/demo.yaml").read_text()
    said = re.search(r"^scrub:.*# all (\d+) PII types on", demo, re.M)
    cfg = load_config(ROOT / "deploy/configs/demo.yaml").scrub
    assert said and int(said.group(1)) == sum(bool(getattr(cfg, t)) for t in PII_TYPES) == 11
