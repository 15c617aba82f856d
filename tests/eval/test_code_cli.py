"""`lifecycle eval code`: pass@k and a verdict per sample; bad input is one line naming the file and line, exit 2."""

import json

import pytest

from lifecycle.cli import main
from lifecycle.tasks.eval.code.problems import load_problems
from tests.conftest import lifecycle_in_process
from tests.eval.test_export_hf import committed, tokenizer_file  # noqa: F401 (a fixture)

PROBLEMS = dict(list(load_problems().items())[:2])


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_scores_a_samples_file(tmp_path, capsys):
    rows = [{"task_id": t, "completion": p["canonical_solution"]} for t, p in PROBLEMS.items()]
    rows += [{"task_id": t, "completion": "    while True:\n        pass\n"} for t in PROBLEMS]
    samples = write_jsonl(tmp_path / "samples.jsonl", rows)
    rc, out = lifecycle_in_process(capsys, "eval", "code", "--samples", str(samples), "--k", "1,2,10",
                                   "--timeout", "4")
    assert rc == 0 and out["status"] == "ok"
    assert out["pass_at_k"] == {"pass@1": 0.5, "pass@2": 1.0} and out["skipped_k"] == [10]
    assert [r["passed"] for r in out["results"]] == [True, True, False, False]
    assert out["results"][2]["reason"].startswith("timeout") and out["results"][2]["completion_id"] == 1
    assert out["containment"]["network"].startswith("new network namespace")

    assert main(["eval", "code", "--samples", str(samples), "--k", "1", "--timeout", "4"]) == 0
    text = capsys.readouterr().out
    assert "HumanEval/0 #0: passed" in text and "HumanEval/0 #1: failed: timeout" in text
    assert "pass@1: 0.5000" in text


def test_a_problems_file_of_the_same_format(tmp_path, capsys):
    problems = write_jsonl(tmp_path / "mine.jsonl", [
        {"task_id": "t/add", "prompt": "def add(a, b):\n", "entry_point": "add",
         "test": "def check(f):\n    assert f(2, 3) == 5\n"}])
    samples = write_jsonl(tmp_path / "s.jsonl", [{"task_id": "t/add", "completion": "    return a + b\n"},
                                                 {"task_id": "t/add", "completion": "    return a - b\n"}])
    rc, out = lifecycle_in_process(capsys, "eval", "code", "--samples", str(samples), "--problems", str(problems),
                                   "--k", "1")
    assert rc == 0 and out["pass_at_k"] == {"pass@1": 0.5}
    assert out["results"][1]["reason"] == "exception: AssertionError"


@pytest.mark.parametrize("lines,expected", [
    (['{"task_id": "HumanEval/0", "completion": "x"}', '{"task_id": '], ":2: not a JSON line"),
    (['{"task_id": "HumanEval/999", "completion": "x"}'], ":1: unknown task_id 'HumanEval/999'"),
    (['{"task_id": "HumanEval/0"}'], ":1: a sample needs string fields task_id and completion"),
    (["[1, 2]"], ":1: expected a JSON object, found list"),
])
def test_bad_samples_name_the_file_and_line(tmp_path, capsys, lines, expected):
    samples = write_jsonl(tmp_path / "bad.jsonl", lines)
    assert main(["eval", "code", "--samples", str(samples)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lifecycle eval code: error: {samples}{expected}") and "\n" not in err, err


def test_missing_files_and_bad_arguments(tmp_path, capsys):
    assert main(["eval", "code", "--samples", str(tmp_path / "none.jsonl")]) == 2
    assert f"{tmp_path / 'none.jsonl'}: no such file" in capsys.readouterr().err
    samples = write_jsonl(tmp_path / "s.jsonl", [{"task_id": "HumanEval/0", "completion": "x"}])
    assert main(["eval", "code", "--samples", str(samples), "--k", "0,1"]) == 2
    assert "--k '0,1': expected comma-separated positive integers" in capsys.readouterr().err
    assert main(["eval", "code", "--samples", str(samples), "--problems", str(tmp_path / "p.jsonl")]) == 2
    assert "p.jsonl: no such file" in capsys.readouterr().err
    assert main(["eval", "code", "--samples", str(samples), "--workers", "0"]) == 2
    assert "--workers 0: between 1 and 64" in capsys.readouterr().err
    assert main(["eval", "code"]) == 2
    assert "give exactly one of --samples" in capsys.readouterr().err
    assert main(["eval", "code", "--model", str(tmp_path)]) == 2
    assert "no model_config.json" in capsys.readouterr().err


def test_samples_from_a_checkpoint(tmp_path, tokenizer_file, capsys):
    """--model: the same path samples completions from a committed checkpoint (a random model: pass@k 0)."""
    tag, _ = committed(tmp_path)
    rc, out = lifecycle_in_process(capsys, "eval", "code", "--model", str(tag), "--tokenizer", str(tokenizer_file),
                                   "--max-problems", "2", "--num-samples", "2", "--k", "1,2", "--max-new-tokens", "8")
    assert rc == 0, out
    assert out["pass_at_k"] == {"pass@1": 0.0, "pass@2": 0.0}
    assert [r["task_id"] for r in out["results"]] == ["HumanEval/0"] * 2 + ["HumanEval/1"] * 2
    assert all(isinstance(r["completion"], str) and not r["passed"] for r in out["results"])
    assert main(["eval", "code", "--model", str(tag), "--tokenizer", str(tokenizer_file), "--num-samples", "2",
                 "--k", "1,10"]) == 2
    assert "pass@10 needs at least 10 samples per problem" in capsys.readouterr().err
