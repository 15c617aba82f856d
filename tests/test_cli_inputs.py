"""Inputs are checked before any stage starts (issue 24): a pattern that matches nothing, an unreadable file or a
URL that cannot be listed is one line naming `collect.inputs[i]`, exit code 2, before Prefect is imported (a
missing pattern used to fail after 1 min 39 s, under two tracebacks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import lifecycle.preflight as preflight
from lifecycle.cli import main
from tests.conftest import ROOT


def _jsonl(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"text": "a document"}) + "\n")
    return path


CASES = {"empty glob": ("{t}/none/*.jsonl", "matches no file"), "empty ** glob": ("{t}/**/*.jsonl", "matches no file"),
         "unknown protocol": ("nosuchproto://bucket/*.jsonl", "cannot list 'nosuchproto://bucket/*.jsonl'"),
         "unknown type": ("{t}/d/a.csv", "unsupported input type")}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_inputs_are_one_line_and_exit_2(tmp_path, case, capsys):
    _jsonl(tmp_path / "d" / "a.csv")
    pattern, expect = CASES[case][0].format(t=tmp_path), CASES[case][1]
    capsys.readouterr()
    rc = main(["run", "--set", f"workdir={tmp_path}/w", "--set", f"collect.inputs={json.dumps([pattern])}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("lifecycle run: error: collect.inputs[0]: "), err
    assert expect in err[0] and not (tmp_path / "w" / "datasets").exists()


@pytest.mark.parametrize("case", ["empty glob", "unknown protocol"])
def test_bad_inputs_fail_in_seconds_before_prefect(tmp_path, case):
    pattern, expect = CASES[case][0].format(t=tmp_path), CASES[case][1]
    probe = ("import sys; from lifecycle.cli import main; rc = main(sys.argv[1:]); "
             "print('prefect imported' if 'prefect' in sys.modules else 'prefect not imported'); sys.exit(rc)")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", probe, "run", "--set", f"workdir={tmp_path}/w", "--set",
                           f"collect.inputs={json.dumps([pattern])}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    elapsed = time.monotonic() - t0
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.strip() == "prefect not imported"
    assert len(err) == 1 and err[0].startswith("lifecycle run: error: collect.inputs[0]: ") and expect in err[0], err
    assert "Traceback" not in proc.stderr and not (tmp_path / "w" / "datasets").exists()
    assert elapsed < 60, f"{elapsed:.1f} s"  # seconds of imports on a loaded machine, not a flow run


def test_an_unreadable_file_is_named(tmp_path, monkeypatch, capsys):
    good, bad = _jsonl(tmp_path / "in" / "a.jsonl"), _jsonl(tmp_path / "in" / "b.jsonl")
    bad.chmod(0)
    if os.geteuid() == 0:  # root reads a 0-mode file: make its open fail as it does for everyone else
        real = open

        def guarded(path, *a, **kw):
            if str(path) == str(bad):
                raise PermissionError(13, "Permission denied", str(bad))
            return real(path, *a, **kw)

        monkeypatch.setattr(preflight, "open", guarded, raising=False)  # the module that opens the inputs
    capsys.readouterr()
    rc = main(["run", "--set", f"workdir={tmp_path}/w", "--set", f'collect.inputs=["{tmp_path}/in/*.jsonl"]'])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"lifecycle run: error: collect.inputs[0]: cannot read {bad}: permission denied"]
    assert good.exists() and not (tmp_path / "w" / "datasets").exists()
