"""What a run needs besides compute is checked when it starts (issue 41 §1): METEOR's WordNet, a tokenizer file,
a hostfile, eval sets, reference inputs, the tracking server. A missing one is one line naming the field and exit 2
before any stage; `evaluate.meteor_synonyms: auto` runs without WordNet and says so at the start."""

from __future__ import annotations

import socket

import pytest

from lifecycle.config import load_config
from lifecycle.core.errors import UsageError
from lifecycle.preflight import preflight
from lifecycle.tasks.eval.evaluate import metrics_text
from tests.conftest import ROOT
from tests.test_cli_errors import DEMO, assert_one_line, run_cli


@pytest.fixture
def no_wordnet(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_text, "WORDNET_DIR", tmp_path / "no-wordnet")


def cfg(*sets: str):
    return load_config(DEMO, list(sets))


def test_auto_runs_meteor_without_synonyms_where_wordnet_is_missing_and_says_so(no_wordnet):
    assert cfg().evaluate.meteor_synonyms == "auto"  # the default
    checked = preflight(cfg())
    assert checked.config.evaluate.meteor_synonyms == "none"
    [note] = checked.notes
    assert "gen_meteor_nosyn" in note and "apt-get install wordnet-base" in note
    assert checked.config.train == cfg().train  # nothing else changed


def test_auto_uses_wordnet_where_it_is_installed(tmp_path, monkeypatch):
    for name in metrics_text.WORDNET_FILES:
        (tmp_path / name).write_text("")
    monkeypatch.setattr(metrics_text, "WORDNET_DIR", tmp_path)
    checked = preflight(cfg())
    assert checked.config.evaluate.meteor_synonyms == "wordnet" and checked.notes == []


def test_wordnet_asked_for_but_missing_stops_before_any_stage(no_wordnet):
    with pytest.raises(UsageError, match=r"^evaluate.meteor_synonyms: .*apt-get install wordnet-base"):
        preflight(cfg("evaluate.meteor_synonyms=wordnet"))
    # a run that stops before evaluate does not need it
    assert preflight(cfg("evaluate.meteor_synonyms=wordnet"), until="tokenize").notes == []


@pytest.mark.parametrize("field,until", [("tokenize.tokenizer_file", "tokenize"), ("train.launch.hostfile", "train"),
                                         ("evaluate.code.problems", None)])
def test_a_missing_file_is_named_by_its_field(tmp_path, field, until, no_wordnet):
    extra = ["evaluate.code.enabled=true"] if field.startswith("evaluate.code") else []
    missing = tmp_path / "nope.json"
    with pytest.raises(UsageError, match=f"^{field}: {missing} does not exist"):
        preflight(cfg(f"{field}={missing}", *extra), until=until)
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(UsageError, match="is not a file"):
        preflight(cfg(f"{field}={tmp_path / 'dir.json'}", *extra), until=until)


def test_eval_sets_and_reference_inputs_are_checked_when_their_step_runs(tmp_path, no_wordnet):
    with pytest.raises(UsageError, match="decontaminate.sets: .*neither a built-in"):
        preflight(cfg("decontaminate.enabled=true", f"decontaminate.sets=[{tmp_path / 'gone.jsonl'}]"))
    preflight(cfg("decontaminate.enabled=false", f"decontaminate.sets=[{tmp_path / 'gone.jsonl'}]"))  # off: unused
    with pytest.raises(UsageError, match=r"quality.reference_inputs\[0\]"):
        preflight(cfg("quality.enabled=true", f"quality.reference_inputs=[{tmp_path}/none-*.jsonl]"))


def test_a_tracking_server_that_refuses_connections_fails_at_the_start(no_wordnet, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UsageError, match=f"^tracking.tracking_uri: cannot connect to 127.0.0.1:{port}: "):
        preflight(cfg(f"tracking.tracking_uri=http://127.0.0.1:{port}"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:secret@127.0.0.1:{port}")
    with pytest.raises(UsageError, match="^MLFLOW_TRACKING_URI: cannot connect") as e:
        preflight(cfg())
    assert "secret" not in str(e.value)


def test_lifecycle_run_says_it_in_one_line_and_exits_2(capsys, tmp_path, no_wordnet):
    rc, out, err = run_cli(capsys, ["run", DEMO, "--set", f"workdir={tmp_path / 'wd'}",
                                    "--set", "evaluate.meteor_synonyms=wordnet"])
    assert_one_line(rc, err, "evaluate.meteor_synonyms", "wordnet-base")
    assert not (tmp_path / "wd" / "datasets").exists() and not (tmp_path / "wd" / "logs").exists()  # nothing ran
    assert (ROOT / "deploy/system-packages.sh").is_file()  # what `make install` runs to bring it
