"""One way to name a run in every command that reads one (issue 24): CONFIG and --set as `run` takes them, else
--workdir, else $LIFECYCLE_WORKDIR, else the default config's work dir, said on stderr in one line."""

from __future__ import annotations

import json

import pytest

from lifecycle.cli import build_parser, main, resolve_workdir
from lifecycle.console import print_summary
from tests.conftest import ROOT, docs_table, make_collect


def _leaf(parser, *path):
    for name in path:
        parser = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)
                      ).choices[name]
    return parser


@pytest.fixture()
def runs(tmp_path, monkeypatch):
    """Two work dirs, each with one committed dataset of a different size, and a config naming the first."""
    monkeypatch.delenv("LIFECYCLE_WORKDIR", raising=False)
    a, b = tmp_path / "a", tmp_path / "b"
    make_collect(a, [docs_table(["one"])])
    make_collect(b, [docs_table(["one", "two", "three"])])
    cfg = tmp_path / "a.yaml"
    cfg.write_text(f"workdir: {a}\ncollect: {{inputs: ['{tmp_path}/*.jsonl']}}\n")
    return a, b, cfg


def rows(capsys, *argv) -> tuple[int, list, str]:
    capsys.readouterr()
    rc = main(["sql", "SELECT sum(num_rows) AS n FROM datasets", "--json", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, json.loads(out.strip().splitlines()[-1]), err


def test_config_then_set_then_workdir_then_environment(runs, capsys, monkeypatch):
    a, b, cfg = runs
    assert rows(capsys, "--workdir", b)[1] == [{"n": 3}]
    assert rows(capsys, "-c", cfg)[1] == [{"n": 1}]
    assert rows(capsys, "-c", cfg, "--workdir", b)[1] == [{"n": 1}]  # CONFIG first
    assert rows(capsys, "-c", cfg, "--set", f"workdir={b}")[1] == [{"n": 3}]  # --set overrides the config's value
    monkeypatch.setenv("LIFECYCLE_WORKDIR", str(b))
    rc, got, err = rows(capsys)
    assert rc == 0 and got == [{"n": 3}] and err == ""  # named by the environment: nothing to say
    assert rows(capsys, "--workdir", a)[1] == [{"n": 1}]  # --workdir before the environment


def test_a_command_falling_back_to_the_default_says_which_work_dir(runs, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no deploy/configs/demo.yaml here: the built-in default runs/demo
    capsys.readouterr()
    rc = main(["verify", "--json"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err[1] == f"lifecycle verify: error: work dir {tmp_path / 'runs/demo'} (the built-in default): no such directory"
    assert err[0] == (f"lifecycle verify: work dir {tmp_path / 'runs/demo'}, from the built-in default (name a run "
                      "with CONFIG, --set workdir=..., --workdir or $LIFECYCLE_WORKDIR)")
    monkeypatch.chdir(ROOT)
    args = build_parser([]).parse_args(["lineage", "doc", "x"])
    wd, named_by, note = resolve_workdir(args)
    assert wd == str(ROOT / "runs/demo") and named_by == "the default config deploy/configs/demo.yaml"
    assert note.startswith(f"work dir {wd}, from the default config deploy/configs/demo.yaml")


def test_a_path_inside_a_work_dir_names_that_work_dir(runs, monkeypatch, tmp_path):
    a, b, cfg = runs
    (b / "latest").mkdir()
    (b / "train" / "r1" / "checkpoints" / "step_4").mkdir(parents=True)
    (b / "latest" / "train").symlink_to("../train/r1/checkpoints/step_4")
    monkeypatch.chdir(tmp_path)
    args = build_parser([]).parse_args(["export", "hf", str(b / "latest" / "train"), str(tmp_path / "out")])
    assert resolve_workdir(args) == (str(b), f"CHECKPOINT {b / 'latest' / 'train'}", None)  # not the default
    args = build_parser([]).parse_args(["export", "hf", str(tmp_path / "elsewhere"), str(tmp_path / "out")])
    assert resolve_workdir(args)[2] is not None  # not inside one: the default, said on stderr
    args = build_parser([]).parse_args(["export", "hf", str(b / "latest" / "train"), "o", "--workdir", str(a)])
    assert resolve_workdir(args)[0] == str(a)  # named: the path does not override it


def test_verify_takes_config_positionally(runs, capsys):
    a, b, cfg = runs
    capsys.readouterr()
    assert main(["verify", str(cfg), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["workdir"] == str(a)


@pytest.mark.parametrize("command", [("verify",), ("sql",), ("lineage", "model"), ("lineage", "doc"),
                                     ("lineage", "forget"), ("export", "hf"), ("up",), ("down",), ("status",)])
def test_every_command_that_reads_a_run_names_it_the_same_way(command):
    leaf = _leaf(build_parser([]), *command)
    dests = {a.dest: a for a in leaf._actions}
    assert {"config", "set", "workdir"} <= set(dests), command
    assert leaf.get_default("names_run") and leaf.get_default("config") is None and dests["workdir"].default is None


def test_no_command_defaults_its_workdir_to_the_demo():
    sources = [ROOT / p for p in ("lifecycle/cli.py", "lineage/cli.py", "tasks/eval/export.py", "flows/startup/commands.py")]
    assert not [str(p) for p in sources if 'default="runs/demo"' in p.read_text()]


def test_the_run_summary_says_where_the_charts_and_model_card_are(capsys):
    uri = "file:///w/mlartifacts/1/abc/artifacts"
    print_summary({"status": "completed", "elapsed_s": 1.0, "workdir": "/w", "stages": {}, "datasets": {},
                   "metrics": {}, "mlflow_run_id": "abc", "mlflow_tracking_uri": "sqlite:////w/mlflow.db",
                   "artifacts": {"funnel": f"{uri}/funnel.png", "loss_curves": f"{uri}/loss_curves.png",
                                 "model_card": f"{uri}/model_card.md"}})
    out = capsys.readouterr().out
    assert "  funnel chart:    /w/mlartifacts/1/abc/artifacts/funnel.png" in out
    assert "  loss curves:     /w/mlartifacts/1/abc/artifacts/loss_curves.png" in out
    assert "  model card:      /w/mlartifacts/1/abc/artifacts/model_card.md" in out


def test_a_no_op_run_summary_says_nothing_was_done_instead_of_mlflow_none(capsys):
    print_summary({"status": "no_new_inputs", "elapsed_s": 0.4, "workdir": "/w", "stages": {}, "datasets": {},
                   "metrics": {}, "mlflow_run_id": None, "mlflow_tracking_uri": None, "checkpoint": None})
    out = capsys.readouterr().out
    assert "nothing to do" in out and "None" not in out and "mlflow ui" not in out


def test_the_run_summary_shows_the_figures_a_user_decides_on_and_what_stays_up(capsys):
    """Issue 41 §4: the demo printed one line of 16 robustness figures and 40 metrics in all."""
    metrics = {"train_loss": 5.036, "train_steps": 200, "val_loss": 5.219, "val_bpb": 2.015, "gen_bleu": 0.618,
               **{f"robust_case_{i}": 1.0 for i in range(16)}, **{f"bias_x_{i}": 0.0 for i in range(5)}}
    stages = dict.fromkeys(["collect", "filter", "dedup", "scrub", "tokenize", "train", "evaluate"], "computed")
    print_summary({"status": "completed", "elapsed_s": 177.7, "workdir": "/w", "stages": {**stages, "checkpoint": "reused"},
                   "datasets": {}, "metrics": metrics, "mlflow_run_id": "abc", "model": {"name": "m", "version": "1"},
                   "promotion": {"decision": "promoted"}, "mlflow_tracking_uri": "sqlite:////w/mlflow.db",
                   "left_running": "this work dir's Prefect server"})
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "lifecycle run completed in 177.7 s: 8 stages (7 computed, 1 reused)"
    assert "  model:           m version 1; champion: promoted" in out
    assert "  val:             loss 5.219, bpb 2.015" in out and not any("robust" in ln for ln in out)
    assert "  MLflow run:      abc (21 more metrics there, in the model card and under --json)" in out
    assert "  left running:    this work dir's Prefect server" in out
    assert len(out) <= 14, out
