"""`lifecycle run`'s console: one line per stage with the figures that matter, the libraries' chatter in a log file."""

import inspect
import io
import json
import re
import subprocess
import sys
import textwrap

import pytest

from lifecycle import console
from lifecycle.console import RunConsole, funnel, train_progress
from lifecycle.flows.reporting import Reporter
from tests.conftest import ROOT, corpus_records

STATS = {"rows_in": 2130, "rows_kept": 679, "rows_rejected": 1451,
         "rejected_by_reason": {"gopher_stop_words": 90, "gopher_short_doc": 1200, "lang": 61, "gopher_symbol_ratio": 100}}


def test_funnel_names_kept_rejected_rate_and_the_top_three_reasons():
    line = funnel(STATS, elapsed=2.0)
    assert line.startswith("2,130 in, 679 kept, 1,451 rejected (68.1%), 1,065 rows/s; top: ")
    assert line.endswith("top: gopher_short_doc 1,200, gopher_symbol_ratio 100, gopher_stop_words 90")
    assert "lang" not in line  # only the three largest
    assert "rows/s" not in funnel(STATS, elapsed=None)
    scrub = {"rows_in": 670, "rows_kept": 670, "rows_rejected": 0, "counters": {"docs_with_pii": 2, "pii_email": 2}}
    assert funnel(scrub, None) == "670 in, 670 kept, 0 rejected (0.0%); docs_with_pii 2, pii_email 2"


def test_train_progress_has_step_loss_throughput_and_eta():
    rec = {"kind": "train", "step": 120, "loss": 5.4321, "tokens_per_s": 12345.0, "step_time": 0.5}
    assert train_progress(rec, 200) == "step 120/200, loss 5.4321, 12.3k tok/s, ETA 0:40"


def test_summary_prints_one_line_per_metric_family():
    from lifecycle.console import metric_lines

    assert metric_lines({"train_loss": 5.1174, "train_steps": 200, "val_loss": 5.314, "val_bpb": 2.0634, "step": 200}) == [
        "  train:           loss 5.117, steps 200", "  val:             loss 5.314, bpb 2.063", "  step:            200"]


def test_console_implements_the_reporter_interface():
    for name, fn in inspect.getmembers(Reporter, inspect.isfunction):
        if not name.startswith("_"):
            assert inspect.signature(getattr(RunConsole, name)) == inspect.signature(fn), name


def plain_console(monkeypatch, max_steps: int | None = None) -> tuple[io.StringIO, RunConsole, list[float]]:
    """A console writing plain lines (as in CI) to a buffer, on a clock the test moves (`clock[0]`)."""
    out = io.StringIO()
    clock = [1000.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    return out, RunConsole(out, max_steps=max_steps, live=False), clock


def test_plain_output_is_one_line_per_stage_and_throttled_progress(monkeypatch):
    out, view, clock = plain_console(monkeypatch, max_steps=100)
    with view:
        view.stage_started("filter")
        clock[0] += 1
        view.shards_done("filter", 1, 2, STATS)  # within PLAIN_EVERY_S of the start: not printed
        clock[0] += 1
        view.stage_done("filter", "computed", STATS)
        view.stage_started("train")
        for step in range(1, 101):
            clock[0] += 1
            view.train_metrics({"kind": "train", "step": step, "loss": 9.0 - step / 50, "tokens_per_s": 1000.0,
                                "step_time": 1.0})
            view.train_metrics({"kind": "eval", "step": step, "val_loss": 7.0})
        view.stage_done("train", "computed", None, "step 100, loss 7.0000")
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["filter", "computed", "2,130", "in,", "679", "kept,", "1,451", "rejected", "(68.1%),",
                                "1,065", "rows/s;", "top:", "gopher_short_doc", "1,200,", "gopher_symbol_ratio",
                                "100,", "gopher_stop_words", "90", "[0:02]"]
    progress = [ln for ln in lines if "running" in ln]
    assert len(progress) == 100 // int(console.PLAIN_EVERY_S)  # one line a minute over 100 s of training
    assert progress[0].split()[:4] == ["train", "running", "step", "60/100,"] and "ETA 0:40" in progress[0]
    assert lines[-1].split()[:3] == ["train", "computed", "step"] and len(lines) == 3


def test_capture_sends_this_process_and_its_children_to_the_log(tmp_path):
    """Descriptors 1 and 2 go to the log (a child process's output too); `out` still reaches the real stdout."""
    script = textwrap.dedent(f"""
        import subprocess, sys
        from pathlib import Path
        from lifecycle.console import Capture
        cap = Capture(Path({str(tmp_path / 'logs' / 'run.log')!r}))
        print("chatter on stdout")
        print("chatter on stderr", file=sys.stderr)
        subprocess.run([sys.executable, "-c", "import warnings; warnings.warn('a child warns')"])
        print("for the user", file=cap.out)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "for the user\n" and proc.stderr == ""
    log = (tmp_path / "logs" / "run.log").read_text()
    assert "chatter on stdout" in log and "chatter on stderr" in log and "a child warns" in log
    assert "for the user" not in log


@pytest.mark.e2e
def test_run_prints_a_short_funnel_and_logs_the_chatter(tmp_path):
    """The real `lifecycle run --until filter` (ephemeral Prefect server, shard workers, MLflow on SQLite),
    stdout not a terminal, as in CI."""
    inputs = tmp_path / "docs.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in corpus_records(60)) + "{not json}\n")
    wd = tmp_path / "work"
    args = [sys.executable, "-m", "lifecycle.cli", "run", "--until", "filter", "--set", f"workdir={wd}",
            "--set", f"collect.inputs=[\"{inputs}\"]", "--set", "collect.shard_bytes=20000",
            "--set", "orchestration.dask_workers=2"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) <= 25, proc.stdout
    assert proc.stderr == ""
    manifest = json.loads((next((wd / "datasets" / "filter").glob("*/_manifest.json"))).read_text())
    stats = manifest["stats"]
    top_reason = max(stats["rejected_by_reason"].items(), key=lambda kv: kv[1])[0]
    filter_line = next(ln for ln in lines if ln.split()[:2] == ["filter", "computed"])
    assert f"{stats['rows_in']} in, {stats['rows_kept']} kept, {stats['rows_rejected']} rejected" in filter_line
    assert f"top: {top_reason} " in filter_line
    collect_line = next(ln for ln in lines if ln.split()[:2] == ["collect", "computed"])
    assert "invalid_json 1" in collect_line
    # the log file, named in the output, holds what stdout no longer shows
    log_path = re.search(r"\(log: (\S+)\)", lines[0]).group(1)
    assert log_path.startswith(str(wd / "logs" / "run-"))
    log = open(log_path).read()
    assert "Finished in state Completed" in log  # Prefect's chatter: in the log, not on the console
    for chatter in ("distributed.", "Finished in state", "MLflow database", "worker thread", "Traceback", "Warning"):
        assert chatter not in proc.stdout, chatter
    assert lines[-1].startswith("Why documents were dropped:  ") and "/lifecycle sql " in lines[-1]  # summary last
    assert f"  log:             {log_path}" in lines

    # --json: stdout is the one JSON line; the stage lines go to stderr
    again = subprocess.run([*args, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert len(again.stdout.splitlines()) == 1
    assert json.loads(again.stdout)["stages"] == {"collect": "reused", "filter": "reused"}
    assert any(ln.split()[:2] == ["filter", "reused"] for ln in again.stderr.splitlines()), again.stderr


def test_evaluate_shows_which_part_runs_and_for_how_long(monkeypatch):
    """Issue 41 §4: evaluate ran 4:26 with no progress line."""
    out, view, clock = plain_console(monkeypatch)
    with view:
        view.stage_started("evaluate")
        clock[0] += 5
        view.progress("evaluate", "part 1/4: validation loss")  # within PLAIN_EVERY_S: not printed
        clock[0] += console.PLAIN_EVERY_S
        view.progress("evaluate", "part 2/4: generation, 16 prompts")
        view.stage_done("evaluate", "computed", None, "val_loss=5.2")
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:2] == ["evaluate", "running"]
    assert lines[0].endswith(f"part 2/4: generation, 16 prompts [{console._duration(5 + console.PLAIN_EVERY_S)} so far]")
    assert len(lines) == 2 and lines[1].split()[:2] == ["evaluate", "computed"]


def test_the_training_eta_counts_evaluations_and_saves(monkeypatch):
    """Issue 41 §4: the ETA came from the last step's time alone and was 40% short (3:45 shown, 5:15 taken)."""
    _, view, clock = plain_console(monkeypatch, max_steps=100)
    with view:
        view.stage_started("train")
        for step in range(1, 51):  # 1 s a step, and every 10th step a 4 s evaluation: 1.4 s a step on average
            clock[0] += 1 + (4 if step % 10 == 0 else 0)
            view.train_metrics({"kind": "train", "step": step, "loss": 5.0, "tokens_per_s": 1000.0, "step_time": 1.0})
    assert view.lines["train"].text.endswith(f"ETA {console._duration(50 * 69 / 49)}")  # not 50 x 1.0 s
