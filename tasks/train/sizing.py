"""Compute-optimal sizing: `lifecycle plan --flops C` or `--tokens D`, and `train.model_size: auto`
(`lifecycle plan memory` and `plan layout` are in lifecycle.tasks.train.planner).

Two rules of thumb from the scaling-law literature:

- training compute C ≈ 6·N·D FLOPs for N parameters and D tokens (Kaplan et al. 2020, "Scaling Laws for
  Neural Language Models", section 2.1: 2 FLOPs per parameter per token forward, 4 backward);
- compute-optimal training uses D ≈ 20·N tokens (Hoffmann et al. 2022, "Training Compute-Optimal Large
  Language Models" (Chinchilla), table 3).

So from a budget C: N = sqrt(C / (6·20)), D = 20·N; from a token count D: N = D / 20, C = 6·N·D.

N here is what `lifecycle.tasks.train.model.GPT.num_params(exclude_embeddings=True)` counts and what the 6·N in
`flops_per_token` uses: every matmul weight, the output head included, the input embedding table
excluded (a lookup, not a matmul). `param_count` counts it tensor by tensor: grouped-query attention's narrower
k and v, Qwen2's q/k/v biases, the SwiGLU width, tied or untied embeddings, a mixture of experts' router and
experts (all of them in Ψ, the top_k a token goes through in the FLOPs). `model_for_params` then picks a Llama-style shape (head dim 64,
width/depth near 64) whose N is closest to the target.

Torch-free: the CLI and the train task import this without loading torch.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from lifecycle.core.errors import UsageError
from lifecycle.tasks.train.config import ModelConfig

TOKENS_PER_PARAM = 20.0
HEAD_DIM = 64
ASPECT = 64  # width / depth of the chosen shape (Kaplan et al. 2020 fig. 5: loss is flat over 20..200)


class ParamCount(BaseModel):
    """The parameters of one ModelConfig, counted tensor by tensor as `GPT` builds them (tested against
    `sum(p.numel())`, and against the published totals of Llama 2/3.1, Mistral and Qwen2)."""

    model_config = ConfigDict(frozen=True)
    total: int
    """Unique parameters Ψ (`GPT.num_params()`): a tied head counts once, every expert counts."""
    non_embedding: int
    """N of C = 6·N·D (`GPT.num_params(exclude_embeddings=True)`): every matmul weight and norm, the output head
    included (tied or not: it is a matmul), the token and learned-position tables excluded (lookups)."""
    active: int
    """N less the experts a token does not go through (num_experts - top_k per MoE block): the FLOPs' basis."""


def block_tensors(m: ModelConfig, i: int) -> dict[str, int]:
    """Elements of each parameter of block i: two norms (RMSNorm weight, or LayerNorm weight without bias); q, k
    and v fused (q d·d, k and v d·(n_kv_head·head_dim) each) with their biases under `qkv_bias` (Qwen2); the
    output projection d·d; SwiGLU's gate and up fused (2·d·ffn) and down (d·ffn), or GELU's up and down; an MoE
    block has a router (d·E, no bias) and E such MLPs."""
    d, kv, ffn = m.n_embd, m.kv_heads * m.head_dim, m.mlp_hidden
    b = f"blocks.{i}."
    norm = 0 if m.norm == "none" else d
    out = {b + "norm1.weight": norm, b + "attn.qkv.weight": d * (d + 2 * kv)}
    if m.qkv_bias:
        out[b + "attn.qkv.bias"] = d + 2 * kv
    out |= {b + "attn.proj.weight": d * d, b + "norm2.weight": norm}
    mlp = {"up.weight": (2 if m.mlp == "swiglu" else 1) * ffn * d, "down.weight": ffn * d}
    if m.moe is not None and m.moe.is_moe_block(i):
        out[b + "mlp.gate.weight"] = d * m.moe.num_experts
        for e in range(m.moe.num_experts):
            out |= {f"{b}mlp.experts.{e}.{k}": n for k, n in mlp.items()}
    else:
        out |= {b + "mlp." + k: n for k, n in mlp.items()}
    return {k: n for k, n in out.items() if n}  # no norms under norm: none


def outer_tensors(m: ModelConfig) -> dict[str, int]:
    """The parameters outside the blocks: token table, learned positions, final norm, an untied head."""
    if m.vocab_size is None:
        raise ValueError("ModelConfig.vocab_size is null: fill it from the tokenizer first")
    out = {"wte.weight": m.vocab_size * m.n_embd}
    if m.pos == "learned":
        out["wpe.weight"] = m.seq_len * m.n_embd
    out["norm_f.weight"] = 0 if m.norm == "none" else m.n_embd
    if not m.tie_embeddings:
        out["lm_head.weight"] = m.vocab_size * m.n_embd
    return {k: n for k, n in out.items() if n}


def tensors(m: ModelConfig) -> dict[str, int]:
    """Elements of every parameter `GPT(m)` holds, by its name in `named_parameters()` (a tied head is `wte`)."""
    out = outer_tensors(m)
    for i in range(m.n_layer):
        out |= block_tensors(m, i)
    return out


def largest_tensor(m: ModelConfig) -> int:
    """Elements of the largest parameter tensor (a fused one counts whole: q/k/v, SwiGLU's gate and up)."""
    firsts = {m.moe is not None and m.moe.is_moe_block(i): i for i in reversed(range(m.n_layer))}.values()
    return max([*outer_tensors(m).values(), *(max(block_tensors(m, i).values()) for i in firsts)])


def param_count(m: ModelConfig) -> ParamCount:
    """Exact counts of `m` (see ParamCount), summed from the same tensors as `tensors` (a dense and an MoE block
    computed once each). A token goes through k = top_k experts: experts k.. of each MoE block are inactive."""
    outer = outer_tensors(m)
    kinds: dict[bool, tuple[int, int]] = {}  # MoE block or not -> (all, inactive)
    total = inactive = 0
    for i in range(m.n_layer):
        moe = m.moe is not None and m.moe.is_moe_block(i)
        if moe not in kinds:
            t = block_tensors(m, i)
            kinds[moe] = (sum(t.values()), sum(n for name, n in t.items()
                                               if ".experts." in name and int(name.split(".")[4]) >= m.moe.top_k))
        total, inactive = total + kinds[moe][0], inactive + kinds[moe][1]
    total += sum(outer.values())
    non_embedding = total - outer.get("wpe.weight", 0) - (0 if m.tie_embeddings else outer["wte.weight"])
    return ParamCount(total=total, non_embedding=non_embedding, active=non_embedding - inactive)


def non_embedding_params(m: ModelConfig) -> int:
    """N (`ParamCount.non_embedding`): equals `GPT(m).num_params(exclude_embeddings=True)` (tested)."""
    return param_count(m).non_embedding


def flops_per_token(m: ModelConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token, 6·N + 12·L·d·T with N the active count (same as `GPT.flops_per_token`)."""
    return 6 * param_count(m).active + 12 * m.n_layer * m.n_embd * (seq_len or m.seq_len)


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True)
    flops: float
    """Training compute C = 6·N·D."""
    n_params: float
    """Compute-optimal parameter count N."""
    tokens: float
    """Compute-optimal token count D = tokens_per_param·N."""
    tokens_per_param: float


def compute_optimal(flops: float | None = None, tokens: float | None = None,
                    tokens_per_param: float = TOKENS_PER_PARAM) -> Plan:
    """Exactly one of `flops` (a budget C) or `tokens` (the data D) gives the compute-optimal N and D."""
    if (flops is None) == (tokens is None):
        raise ValueError("give exactly one of flops or tokens")
    if flops is not None:
        if flops <= 0:
            raise ValueError(f"flops must be positive, got {flops}")
        n = math.sqrt(flops / (6 * tokens_per_param))
        return Plan(flops=flops, n_params=n, tokens=tokens_per_param * n, tokens_per_param=tokens_per_param)
    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    n = tokens / tokens_per_param
    return Plan(flops=6 * n * tokens, n_params=n, tokens=tokens, tokens_per_param=tokens_per_param)


def model_for_params(n_params: float, base: ModelConfig) -> ModelConfig:
    """The shape (n_layer, n_embd multiple of 64, head dim 64) whose N is closest to `n_params`; among
    shapes within 10 % of it, the one whose width/depth is nearest ASPECT. Other fields come from `base`."""
    if base.vocab_size is None:
        raise ValueError("base.vocab_size is null: fill it from the tokenizer first")
    cands = []
    for layers in range(1, 97):
        for width in range(HEAD_DIM, 16384 + 1, HEAD_DIM):
            m = base.model_copy(update={"n_layer": layers, "n_embd": width, "n_head": width // HEAD_DIM})
            n = non_embedding_params(m)
            cands.append((abs(math.log(n / n_params)), abs(math.log(width / layers / ASPECT)), layers, width))
            if n > 2 * n_params:
                break
    close = [c for c in cands if c[0] <= math.log(1.1)]
    best = min(close, key=lambda c: (c[1], c[0])) if close else min(cands)
    return ModelConfig.model_validate({**base.model_dump(), "n_layer": best[2], "n_embd": best[3],
                                       "n_head": best[3] // HEAD_DIM})


def train_tokens_of(manifest: str | Path) -> int:
    """Training-split token count of a committed tokenize dataset (its `_manifest.json` or directory)."""
    p = Path(manifest)
    m = json.loads((p / "_manifest.json" if p.is_dir() else p).read_text())
    if m.get("stage") != "tokenize":
        raise ValueError(f"{p} is not a tokenize dataset manifest (stage={m.get('stage')!r})")
    return int(m["num_tokens"]["train"])


def describe(plan: Plan, m: ModelConfig) -> str:
    n = non_embedding_params(m)
    return "\n".join([
        f"compute C        {plan.flops:.4g} FLOPs  (C = 6·N·D)",
        f"optimal params N {plan.n_params:.4g}",
        f"optimal tokens D {plan.tokens:.4g}  ({plan.tokens_per_param:g} tokens per parameter)",
        f"model            n_layer={m.n_layer} n_embd={m.n_embd} n_head={m.n_head} seq_len={m.seq_len} "
        f"vocab_size={m.vocab_size}",
        f"  its N          {n:,} ({n / plan.n_params:.2f}x the optimum)",
        f"  FLOPs/token    {flops_per_token(m):,}",
        f"  sequences      {plan.tokens / m.seq_len:.4g} of {m.seq_len} tokens make D",
    ])


# --------------------------------------------------------------------------------------------------
# `lifecycle plan`


def cmd_plan(args: argparse.Namespace) -> int:
    if args.flops is None and args.tokens is None and args.dataset is None:
        args.plan_parser.error("one of the arguments --flops --tokens --dataset is required "
                               "(or a subcommand: memory, layout)")
    tokens = args.tokens
    for name in ("flops", "tokens"):
        if getattr(args, name) is not None and not math.isfinite(getattr(args, name)):
            raise UsageError(f"--{name} must be a finite number, got {getattr(args, name)}")
    try:
        if args.dataset:
            tokens = train_tokens_of(args.dataset)
        plan = compute_optimal(flops=args.flops, tokens=tokens, tokens_per_param=args.tokens_per_param)
    except KeyError as e:
        raise UsageError(f"--dataset {args.dataset}: its manifest has no {e} field") from e
    except ValueError as e:  # not a tokenize manifest, damaged JSON, a non-positive budget
        raise UsageError(f"--dataset {args.dataset}: {e}" if args.dataset else str(e)) from e
    base = ModelConfig(vocab_size=args.vocab_size, seq_len=args.seq_len)
    m = model_for_params(plan.n_params, base)
    if args.json:
        print(json.dumps({**plan.model_dump(), "model": m.model_dump(), "model_params": non_embedding_params(m),
                          "flops_per_token": flops_per_token(m)}))
    else:
        print(describe(plan, m))
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="Compute-optimal model size and token count (C = 6·N·D, D = 20·N); "
                                           "`plan memory` and `plan layout`: memory per rank and the layout search.")
    src = p.add_mutually_exclusive_group()  # one of them, unless a subcommand is given (checked in cmd_plan)
    src.add_argument("--flops", type=float, help="training compute budget C in FLOPs, e.g. 1e18")
    src.add_argument("--tokens", type=float, help="tokens available D, e.g. 2e9")
    src.add_argument("--dataset", help="a tokenize dataset (directory or _manifest.json): D = its train tokens")
    p.add_argument("--tokens-per-param", type=float, default=TOKENS_PER_PARAM, help="default 20 (Chinchilla)")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of the model to shape (default 4096)")
    p.add_argument("--seq-len", type=int, default=128, help="context length of the model to shape (default 128)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-v", "--verbose", action="store_true", help="on an error, show its traceback")
    p.set_defaults(func=cmd_plan, plan_parser=p)
    return p


def uses_muon(name: str, shape) -> bool:
    """Whether GPT parameter `name` trains with Muon: the blocks' 2-D weights (engine.muon_optimizer)."""
    return name.startswith("blocks.") and len(shape) >= 2


def muon_numels(m: ModelConfig) -> list[int]:
    """Elements of each matrix `train.optimizer.name: muon` steps with Muon: the blocks' matrices (every block
    parameter but the norms and biases; lifecycle.tasks.train.engine.muon_optimizer tags the same)."""
    return [n for i in range(m.n_layer) for name, n in block_tensors(m, i).items()
            if "norm" not in name and not name.endswith(".bias")]


def muon_params(m: ModelConfig) -> int:
    """The parameters Muon steps (`muon_numels`, summed)."""
    return sum(muon_numels(m))
