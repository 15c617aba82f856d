"""Perplexity under the champion in real `lifecycle run`s (data stages only, `--until tokenize`):
- no champion registered: perplexity and the select on its column are skipped with the reason, the run
  completes and tokenize reads the scrub output;
- a champion registered (a tiny GPT trained here on the first run's tokens, registered through `lineage.registry`
  in the run's own MLflow store): the documents are scored, select keeps the lowest perplexities, and the score
  reaches the token side table and `lineage doc`;
- a new selection rule recomputes neither score (same perplexity dataset); a new champion rescores."""

import json
from pathlib import Path

import pytest

from lifecycle.config import load_config
from lifecycle.core.dataset import DatasetRef
from lifecycle.lineage.registry import Registry
from lifecycle.lineage.tracking import Tracker
from tests.conftest import ROOT, corpus_records, last_json, lifecycle
from tests.eval.test_perplexity import train_package

CONFIG = ROOT / "deploy/configs/demo.yaml"
COLUMN = "quality_perplexity"


def sets(wd: Path, inputs: list[str], top: float) -> list[str]:
    out = []
    for s in (f"workdir={wd}", f"collect.inputs={json.dumps(inputs)}", "tokenize.vocab_size=300",
              "tokenize.val_fraction=0.2", "tokenize.min_val_docs=0", "tokenize.min_val_tokens=0",
              "perplexity.enabled=true", "perplexity.max_tokens=32", f"select.column={COLUMN}",
              "select.threshold=null", f"select.top_fraction={top}"):
        out += ["--set", s]
    return out


def register(wd: Path, tokens: DatasetRef, steps: int, seed: int) -> str:
    """Train and package a tiny model, register it in the run's store and promote it (alias champion)."""
    package = train_package(wd, tokens, steps=steps, seed=seed)
    cfg = load_config(CONFIG, [f"workdir={wd}"])
    t = Tracker(cfg.tracking, cfg.workdir, cfg.name)
    t.start(f"register-{seed}", cfg.model_copy(update={"name": f"register-{seed}"}), {"prefect.flow_run_id": "test"})
    reg = Registry(t)
    name, version = reg.register_model(package.dir, {"lifecycle.model_package_manifest": str(package.manifest_path)})
    reg.client.set_registered_model_alias(name, "champion", version)
    t.end("FINISHED")
    return version


def test_scoring_model_or_the_reason(tmp_path):
    from lifecycle.flows.pipeline import _scoring_model

    assert _scoring_model(None) == (None, "no champion registered yet: nothing to score perplexity with")
    model, why = _scoring_model(("3", tmp_path / "gone"))
    assert model is None and why == f"the champion's package {tmp_path / 'gone'} (version 3) is gone"
    (tmp_path / "broken").mkdir()
    model, why = _scoring_model(("4", tmp_path / "broken"))
    assert model is None and "(version 4) is damaged" in why and "_manifest.json" in why


@pytest.mark.e2e
@pytest.mark.slow  # four `lifecycle run`s and two tiny trainings: minutes
def test_perplexity_skips_without_champion_then_scores_with_it(tmp_path):
    src = tmp_path / "in" / "docs.jsonl"
    src.parent.mkdir()
    src.write_text("".join(json.dumps(r) + "\n" for r in corpus_records(40)))
    wd = tmp_path / "wd"
    inputs = [str(src)]

    first = last_json(lifecycle("run", CONFIG, "--json", "--until", "tokenize", *sets(wd, inputs, 0.5)).stdout)
    assert first["status"] == "completed"
    assert first["skipped"]["perplexity"].startswith("no champion registered yet")
    assert "select.column is quality_perplexity, which was not scored" in first["skipped"]["select"]
    assert "perplexity" not in first["stages"] and "select" not in first["stages"]
    tokens = DatasetRef.from_dir(Path(first["datasets"]["tokenize"]).parent)
    assert tokens.manifest()["parents"][0]["manifest"] == first["datasets"]["scrub"]

    v1 = register(wd, tokens, steps=60, seed=0)
    second = last_json(lifecycle("run", CONFIG, "--json", "--until", "tokenize", *sets(wd, inputs, 0.5)).stdout)
    assert second["stages"]["perplexity"] == "computed" and second["skipped"] == {}
    scored = json.loads(Path(second["datasets"]["perplexity"]).read_text())
    assert scored["scoring_model"]["version"] == v1 and scored["config"]["champion_version"] == v1
    selected = json.loads(Path(second["datasets"]["select"]).read_text())
    n = selected["stats"]["rows_in"]
    assert selected["stats"]["rows_kept"] == round(n / 2) and selected["stats"]["rejected_by_reason"] == {
        "low_quality": n - round(n / 2)}
    tok = DatasetRef.from_dir(Path(second["datasets"]["tokenize"]).parent)
    side = tok.read()
    assert COLUMN in side.column_names and all(s is not None for s in side.column(COLUMN).to_pylist())
    doc = side.column("doc_id")[0].as_py()
    report = last_json(lifecycle("lineage", "doc", doc, "--workdir", wd, "--json").stdout)
    assert any(e["outcome"] == "tokenized" and COLUMN in e for e in report["events"])

    # another selection: select and tokenize recompute, the scores are the committed ones
    third = last_json(lifecycle("run", CONFIG, "--json", "--until", "tokenize", *sets(wd, inputs, 0.75)).stdout)
    assert third["stages"]["perplexity"] == "reused"
    assert third["datasets"]["perplexity"] == second["datasets"]["perplexity"]
    assert third["stages"]["select"] == "computed" and third["datasets"]["select"] != second["datasets"]["select"]

    # a new champion: the documents are scored again, under its version
    v2 = register(wd, tokens, steps=20, seed=1)
    fourth = last_json(lifecycle("run", CONFIG, "--json", "--until", "tokenize", *sets(wd, inputs, 0.75)).stdout)
    assert v2 != v1 and fourth["stages"]["perplexity"] == "computed"
    assert json.loads(Path(fourth["datasets"]["perplexity"]).read_text())["scoring_model"]["version"] == v2
