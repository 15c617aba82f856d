"""Completions sampled from our model for HumanEval-format problems, scored by the same path as given samples.

The model continues each problem's prompt (signature + docstring) `num_samples` times at `temperature` with top-p
(argmax at temperature 0), context cropped to its `seq_len` as in the evaluate stage's `greedy_continue`. A completion ends at the end-of-text token or at HumanEval's stop sequences. torch
is imported lazily (this module's config is read by the CLI).
"""

from __future__ import annotations


from lifecycle.tasks.eval.code.config import STOP_SEQUENCES, CodeEvalConfig
from lifecycle.tasks.eval.code.problems import load_problems
from lifecycle.tasks.eval.code.score import score_samples

EOT = "<|endoftext|>"


def truncate(text: str, stops=STOP_SEQUENCES) -> str:
    """The completion up to the first stop sequence."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def sample_continue(model, prompt, n: int, n_new: int, temperature: float, top_p: float, generator,
                    eot: int | None = None):
    """n continuations (n, <= n_new) of one prompt (1, P): argmax at temperature 0 (as the evaluate stage's
    greedy generation), else temperature + top-p sampling; stops early once every row has produced `eot`."""
    import torch

    idx = prompt.expand(n, -1)
    done = torch.zeros(n, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(n_new):
            if eot is not None and bool(done.all()):
                break
            logits, _ = model(idx[:, -model.cfg.seq_len:])
            last = logits[:, -1, :].float()
            if temperature == 0:
                nxt = last.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(last / temperature, dim=-1)
                sorted_p, order = probs.sort(dim=-1, descending=True)
                drop = sorted_p.cumsum(-1) - sorted_p > top_p  # tokens after the nucleus is full
                nxt = order.gather(-1, torch.multinomial(sorted_p.masked_fill(drop, 0.0), 1, generator=generator))
            idx = torch.cat([idx, nxt], dim=1)
            done |= nxt[:, 0] == (eot if eot is not None else -1)
    return idx[:, prompt.shape[1]:]


def sample_completions(model, tokenizer, problems: dict[str, dict], cfg: CodeEvalConfig) -> list[dict]:
    """[{task_id, completion}] with cfg.num_samples completions per problem, in problem order."""
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    eot = tokenizer.token_to_id(EOT)
    samples = []
    for task_id, problem in problems.items():
        ids = tokenizer.encode(problem["prompt"]).ids
        out = sample_continue(model, torch.tensor([ids], dtype=torch.long), cfg.num_samples, cfg.max_new_tokens,
                              cfg.temperature, cfg.top_p, gen, eot)
        for row in out.tolist():
            if eot is not None and eot in row:
                row = row[: row.index(eot)]
            samples.append({"task_id": task_id, "completion": truncate(tokenizer.decode(row))})
    return samples


def selected_problems(cfg: CodeEvalConfig) -> dict[str, dict]:
    problems = load_problems(cfg.problems)
    return dict(list(problems.items())[: cfg.max_problems]) if cfg.max_problems else problems


def evaluate_model(model, tokenizer, cfg: CodeEvalConfig) -> dict:
    """Sample, run and score: the report of `score.score_samples` plus the samples themselves."""
    problems = selected_problems(cfg)
    samples = sample_completions(model, tokenizer, problems, cfg)
    report = score_samples(samples, problems, sorted(cfg.k), cfg.sandbox, cfg.workers)
    return report | {"samples_scored": samples}


def code_metrics(model, tokenizer, cfg: CodeEvalConfig) -> dict[str, float]:
    """The evaluate stage's hook: `code_pass_at_<k>` (MLflow metric names allow no `@`), with the counts and
    `code_sandbox_full` (1 when every sandbox layer held on this machine)."""
    report = evaluate_model(model, tokenizer, cfg)
    out = {f"code_pass_at_{name.split('@')[1]}": v for name, v in report["pass_at_k"].items()}
    full = all(not v.startswith("NOT") for v in report["containment"].values())
    return out | {"code_problems": report["problems"], "code_samples": report["samples"],
                  "code_passed": report["passed"], "code_samples_per_s": report["samples_per_s"],
                  "code_sandbox_full": float(full)}  # 0: a layer did not hold here (see `lifecycle eval code`)

