"""`python -m bench.presets DIR` (the README's preset chooser) on any folder collect reads: kinds from the `kind`
field, else the top folder, else the extension; one line and exit 2 for a folder it cannot use."""

from __future__ import annotations

import gzip
import json

import pytest

from bench import presets

TEXT = ("The scheduler picks the next task to run on each processor, and the rules below decide how long it may run. "
        "Each tunable lives in a file under the proc directory, and writing a number to it changes the behaviour. "
        "A lower latency target makes interactive programs respond faster but costs throughput on busy machines. "
        "Set the value with echo as root, then read it back to confirm that the kernel accepted the new setting.")


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "admin-guide").mkdir()
    (tmp_path / "admin-guide" / "tuning.rst").write_text(f"Tuning\n======\n\n{TEXT}\n")
    (tmp_path / "notes.md.gz").write_bytes(gzip.compress(f"# Notes\n\n{TEXT}\n".encode()))
    (tmp_path / "pages.jsonl").write_text(json.dumps({"text": TEXT, "kind": "man"}) + "\n"
                                          + json.dumps({"text": TEXT}) + "\n")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))  # collect rejects it: unreadable
    (tmp_path / "figure.svg").write_text("<svg/>")  # not an input type: left out
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text(TEXT)
    return tmp_path


def test_kinds_come_from_the_field_then_the_folder_then_the_extension(folder):
    kinds = sorted(kind for kind, _ in presets.corpus(folder))
    assert kinds == ["admin-guide", "jsonl", "man", "md", "txt"]
    assert sorted(kind for kind, _ in presets.corpus(folder, "extension")) == ["jsonl", "jsonl", "md", "rst", "txt"]


def test_each_kind_is_measured_and_unreadable_records_are_counted(folder):
    result = presets.measure(list(presets.corpus(folder)), "deploy/configs/techdocs.yaml")
    assert result["kinds"]["admin-guide"] == {"documents": 1, "kept": 1, "dropped_by_rule": {},
                                              "dropped_by_reason": {}}
    assert result["kinds"]["txt"]["dropped_by_reason"] == {"unreadable": 1}
    assert all(result["kinds"][k]["kept"] == 1 for k in ("md", "man", "jsonl"))


@pytest.mark.parametrize("make, says", [
    (lambda d: (d / "only.pdf").write_bytes(b"%PDF"), "no file collect reads"),
    (lambda d: None, "no file collect reads"),
])
def test_a_folder_without_inputs_fails_in_one_line(tmp_path, capsys, make, says):
    make(tmp_path)
    with pytest.raises(SystemExit) as e:
        presets.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and says in err and str(tmp_path) in err


def test_a_missing_folder_fails_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        presets.main([str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"python -m bench.presets: {tmp_path / 'nope'}: not a folder\n"
