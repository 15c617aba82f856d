"""Memory and layout planner: `lifecycle plan memory`, `lifecycle plan layout` and `train.layout: auto`.

Per-rank memory of a training layout, from two papers:

- model states (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", section 3.1 and figure 1): mixed-precision Adam keeps 2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit
  gradients and KΨ = 12Ψ of optimizer state (fp32 master weights, momentum, variance) for Ψ parameters.
  ZeRO-1 partitions the optimizer state over the Nd data-parallel ranks, ZeRO-2 the gradients too, ZeRO-3 the
  parameters too: (2+2+12)Ψ, (2+2)Ψ + 12Ψ/Nd, 2Ψ + 14Ψ/Nd, 16Ψ/Nd; fp32 4+4+12 (8 at stage 0). That is what
  the pinned DeepSpeed holds at the end of backward; lifecycle.tasks.train.zero_memory has the terms, where
  they live in DeepSpeed and its buffers (measured by `python -m bench.zero_states`).
- activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  section 4): a transformer layer keeps s·b·h·(34 + 5·a·s/h) bytes for sequence s, micro-batch b, width h and
  a heads (16-bit activations, 1-byte dropout masks); with tensor parallelism t and sequence parallelism
  s·b·h/t·(34 + 5·a·s/h), without sequence parallelism s·b·h·(10 + 24/t + 5·a·s/(h·t)); selective
  recomputation drops the 5·a·s/h term; full recomputation keeps 2·s·b·h per layer (its input). With 1F1B
  pipeline parallelism the first stage holds p micro-batches of L/p layers: L layers' worth.
  `activation_per_layer` is that accounting term by term, so that it also covers what the paper's GPT is
  not: fp32 activations (4 bytes), no dropout (no masks), SwiGLU's wider gated MLP, RoPE (rotated q and k kept
  beside the projection output) and fused attention (no a·s² score matrix; its output is kept instead).

On top: buffers (`temp_bytes`), at the larger of two moments: forward/backward (with the activations) and the
optimizer step (without them). DeepSpeed's (zero_memory.engine_buffers): the gradient bucket (stage 0's
flattened all-reduce copies; stages 1-2 reduce_bucket_size elements from the first gradient to the end of
backward, two with overlap_comm; stage 3 one for good), the gradient autograd has made for a parameter before
its hook copies it into the bucket (stages 2-3: the largest tensor's), and in the step the gradients in fp32
(4Ψ/Nd under ZeRO, 4Ψ at stage 0 in 16 bits) while stage 1 has released the gradients outside its partition.
On a GPU the caching allocator hands out a whole buffer (1 GB in bf16 even for a small model); on the CPU only
the pages gradients touch count, min(Ψ, bucket) (`device`). Under ZeRO-3 the gathered parameters: DeepSpeed's
defaults keep a gathered parameter for its reuse in backward up to stage3_max_live_parameters = 1e9 elements:
the whole model below that; and beside them the flat all-gather buffer of one prefetch bucket
(stage3_prefetch_bucket_size, 5e7 elements), held until the bucket's last parameter is used. The backward of the
output layer (fp32 log-probabilities and their gradient, 2 x 4·s·b·V bytes). In the step (fp32 only) torch
AdamW's per-tensor loop on CPU, which makes two fp32 temporaries the size of the largest tensor it updates (a
fused GPU Adam makes none).

Step time (`step_time`) is a simple compute + communication model with the constants of `Hardware`, no
overlap of communication with compute (an upper bound). Torch-free.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from lifecycle.core.errors import UsageError
from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.parallel.mesh import RECOMPUTE, Layout
from lifecycle.tasks.train.sizing import largest_tensor, muon_numels, outer_tensors, param_count
from lifecycle.tasks.train.zero_memory import (  # noqa: F401  (Precision, PRECISIONS, GRAD_BUCKET: the planner's API)
    GRAD_BUCKET, PRECISIONS, Precision, engine_buffers, model_states, muon_buffers,
)

GiB = 2**30

# Presets (Llama recipe: RMSNorm, SwiGLU, RoPE, untied head; GPT-3's 350m with the GPT-2 recipe).
PRESETS: dict[str, dict] = {
    "demo": dict(n_layer=4, n_embd=128, n_head=4, seq_len=128, vocab_size=4096),
    "350m": dict(n_layer=24, n_embd=1024, n_head=16, seq_len=2048, vocab_size=50304, norm="layernorm",
                 mlp="gelu", pos="learned", tie_embeddings=True),
    "1b": dict(n_layer=24, n_embd=2048, n_head=16, seq_len=2048, vocab_size=32000, tie_embeddings=False),
    "7b": dict(n_layer=32, n_embd=4096, n_head=32, seq_len=4096, vocab_size=32000, tie_embeddings=False),
    "13b": dict(n_layer=40, n_embd=5120, n_head=40, seq_len=4096, vocab_size=32000, tie_embeddings=False),
    # published models, from their config.json (tests/train/test_param_count.py checks them against it)
    "llama2-7b": dict(n_layer=32, n_embd=4096, n_head=32, seq_len=4096, vocab_size=32000, mlp_hidden_dim=11008,
                      tie_embeddings=False),
    "llama3.1-8b": dict(n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, seq_len=8192, vocab_size=128256,
                        mlp_hidden_dim=14336, rope_theta=500000.0, tie_embeddings=False),
    "llama3.1-70b": dict(n_layer=80, n_embd=8192, n_head=64, n_kv_head=8, seq_len=8192, vocab_size=128256,
                         mlp_hidden_dim=28672, rope_theta=500000.0, tie_embeddings=False),
    "llama3.1-405b": dict(n_layer=126, n_embd=16384, n_head=128, n_kv_head=8, seq_len=8192, vocab_size=128256,
                          mlp_hidden_dim=53248, rope_theta=500000.0, tie_embeddings=False),
    "mistral-7b": dict(n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, seq_len=4096, vocab_size=32000,
                       mlp_hidden_dim=14336, tie_embeddings=False),
    "qwen2-7b": dict(n_layer=28, n_embd=3584, n_head=28, n_kv_head=4, seq_len=4096, vocab_size=152064,
                     mlp_hidden_dim=18944, qkv_bias=True, rope_theta=1000000.0, tie_embeddings=False),
}
HF_SEQ_LEN = 4096  # the context `--model hf:DIR` plans for unless seq_len=... or --seq-len says otherwise
ALIASES = {"vocab": "vocab_size", "layers": "n_layer", "width": "n_embd", "heads": "n_head", "seq": "seq_len",
           "tie": "tie_embeddings"}


def hf_fields(part: str, spec: str) -> dict:
    """ModelConfig fields of `hf:DIR`, a Hugging Face checkpoint directory's config.json (lifecycle.tasks.train.
    hf_config: Llama, Mistral, Qwen2), at a context of HF_SEQ_LEN."""
    from lifecycle.tasks.train.hf_config import HFImportError, base_dir, model_fields

    try:
        return {**model_fields(base_dir(part), seq_len=2), "seq_len": HF_SEQ_LEN}  # 2: no sliding-window refusal
    except HFImportError as e:
        raise UsageError(f"--model {spec}: {e}") from e


def parse_model(spec: str) -> ModelConfig:
    """A preset name (`7b`, `llama3.1-8b`), `key=value,...` over ModelConfig fields
    (`n_layer=32,n_embd=4096,n_head=32,vocab=32000`), `hf:DIR` (a checkpoint's config.json), or a preset or
    `hf:DIR` with overrides (`7b,seq_len=2048`)."""
    fields: dict = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part.startswith("hf:"):
            fields.update(hf_fields(part, spec))
            continue
        if "=" not in part:
            if part.lower() not in PRESETS:
                raise UsageError(f"--model {spec}: unknown preset {part!r} (known: {', '.join(PRESETS)}; or "
                                 "key=value pairs over n_layer, n_embd, n_head, seq_len, vocab, mlp, norm, pos, tie)")
            fields.update(PRESETS[part.lower()])
            continue
        key, value = (s.strip() for s in part.split("=", 1))
        key = ALIASES.get(key, key)
        if key not in ModelConfig.model_fields:
            raise UsageError(f"--model {spec}: {key!r} is not a model field ({', '.join(ModelConfig.model_fields)})")
        fields[key] = value
    fields.setdefault("vocab_size", 32000)
    try:
        return ModelConfig.model_validate(fields, strict=False)
    except ValueError as e:
        raise UsageError(f"--model {spec}: {e}") from e


def total_params(m: ModelConfig) -> int:
    """Unique parameters Ψ (what `GPT.num_params()` counts, exactly: lifecycle.tasks.train.sizing.param_count)."""
    return param_count(m).total


# --------------------------------------------------------------------------------------------------
# memory


ZERO3_MAX_LIVE = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters and stage3_max_reuse_distance, elements
ZERO3_PREFETCH = 50_000_000  # DeepSpeed's stage3_prefetch_bucket_size (runtime/zero/config.py:222), elements


@dataclass(frozen=True)
class ActivationModel:
    """What one transformer layer keeps for backward, term by term after Korthikanti et al. 2022, section 4.1.
    The defaults are the paper's GPT: 16-bit activations, dropout (1-byte masks), GELU MLP of 4h, materialized
    attention scores, no RoPE; `for_model` fills them in for a ModelConfig."""

    act_bytes: int = 2
    dropout: bool = True
    mlp_ratio: float = 4.0
    """MLP hidden width over h."""
    gated: bool = False
    """SwiGLU: the up projection is 2x wide and the gate's activation and the product are kept."""
    rope: bool = False
    fused_attention: bool = False
    """Flash/SDPA attention: no a·s·s score matrix is kept, the attention output is."""
    kv_ratio: float = 1.0
    """Key/value heads over query heads (grouped-query attention: 8/32 for Llama 3 8B)."""
    fused_projections: bool = True
    """q/k/v one matmul and SwiGLU's gate|up one (this trainer's GPT); False: separate ones (Llama's wq, wk,
    wv, w1, w3, as torchtitan runs them). Per-op selective recomputation keeps every other matmul's output, so
    which outputs those are depends on it."""

    @classmethod
    def for_model(cls, m: ModelConfig, act_bytes: int, fused_attention: bool = True,
                  fused_projections: bool = True) -> "ActivationModel":
        return cls(act_bytes=act_bytes, dropout=m.dropout > 0, mlp_ratio=m.mlp_hidden / m.n_embd,
                   gated=m.mlp == "swiglu", rope=m.pos == "rope", fused_attention=fused_attention,
                   kv_ratio=m.kv_heads / m.n_head, fused_projections=fused_projections)

    def matmul_outputs(self) -> list[float]:
        """Output widths, over h, of a block's matmuls in forward order."""
        kv, hid = self.kv_ratio, self.mlp_ratio
        if self.fused_projections:
            return [1 + 2 * kv, 1, hid * (2 if self.gated else 1), 1]
        return [1, kv, kv, 1, *([hid, hid] if self.gated else [hid]), 1]

    def per_op_selective(self) -> tuple[float, float]:
        """(replicated, split) bytes per s·b·h a block keeps under per-op selective recomputation (torchtitan's
        policy, lifecycle.tasks.train.model.selective_context): its input, the attention kernel's output and
        the outputs of the odd-numbered matmuls; the attention's log-sum-exp (fp32 per head) is left out."""
        e = self.act_bytes
        kept = sum(w for i, w in enumerate(self.matmul_outputs()) if i % 2 == 0)
        return e, (1 + kept) * e

    def recomputed_matmuls(self) -> float:
        """Matmul parameters per h² that per-op selective recomputation runs again in backward: the even-numbered
        ones before the last (nothing needs the last one's output: torch stops recomputing there)."""
        widths = self.matmul_outputs()
        ins: list[float] = [1.0] * len(widths)  # every projection reads h wide (or its output width for down/proj: see below)
        if self.fused_projections:
            ins = [1, 1, 1, self.mlp_ratio]
        return sum(w * i for k, (w, i) in enumerate(zip(widths, ins)) if k % 2 == 1 and k < len(widths) - 1)

    def coefficients(self) -> tuple[float, float, float]:
        """(replicated, split, scores): bytes per s·b·h kept outside tp's split without sequence parallelism,
        bytes per s·b·h split over t, and bytes per a·s·s·b of attention scores."""
        e, mask = self.act_bytes, (1 if self.dropout else 0)
        # two norms' inputs, the QKV and first-MLP matmul inputs, the two residual dropout masks: 10 in the paper
        replicated = 2 * e + e + e + 2 * mask
        attn = 2 * e + e + e  # Q and K for QK^T, V, the output projection's input: 8
        if self.rope:
            attn += 2 * e  # rotation's inputs (the projection output) and outputs both stay
        if self.fused_attention:
            attn += e  # the kernel keeps its output for its backward
        hidden = self.mlp_ratio
        mlp = (4 * hidden * e) if self.gated else (2 * hidden * e)  # GELU input + fc2 input: 16
        scores = 0.0 if self.fused_attention else e + (mask + e if self.dropout else 0)  # softmax, mask, dropout: 5
        return replicated, attn + mlp, scores


def activation_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = True,
                         recompute: str = "none", am: ActivationModel = ActivationModel()) -> float:
    """Bytes one layer keeps for backward on one tensor-parallel rank. With the default `am` this is the
    paper's s·b·h·(34 + 5as/h) (t=1), s·b·h/t·(34 + 5as/h) (sequence parallel), s·b·h·(10 + 24/t + 5as/(ht))
    (tp alone), s·b·h·34/t (selective, sequence parallel) and 2·s·b·h (full, t=1)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    replicated, split, scores = am.coefficients()
    sbh = s * b * h
    if recompute == "full":
        return am.act_bytes * sbh / (t if sequence_parallel else 1)
    if recompute == "selective" and am.fused_attention:  # no score matrix to drop: per-op selective instead
        replicated, split = am.per_op_selective()
        return (replicated / t if sequence_parallel else replicated) * sbh + split * sbh / t
    kept = (replicated / t if sequence_parallel else replicated) * sbh + split * sbh / t
    if recompute == "none":
        kept += scores * a * s * s * b / t
    return kept


def paper_activation_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = True,
                               recompute: str = "none") -> float:
    """Korthikanti et al.'s closed forms (table 2), for checking `activation_per_layer`."""
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    score = 5 * a * s / h if recompute == "none" else 0.0
    if sequence_parallel:
        return s * b * h / t * (34 + score)
    return s * b * h * (10 + 24 / t + score / t)


def params_per_rank(m: ModelConfig, lay: Layout, psi: float | None = None) -> float:
    """Parameters the heaviest rank holds: ceil(L/pp) blocks, each split over tp (its norms counted split too,
    a few h), and whole on every tp rank the token table (with learned positions) on the first stage and the head
    with the final norm on the last (a tied head: a copy of the table there, DeepSpeed's TiedLayerSpec). `psi`: a
    total given instead of a shape, split uniformly over tp × pp."""
    if psi is not None:
        return psi / (lay.tp * lay.pp)
    outer = outer_tensors(m)
    per_block = (total_params(m) - sum(outer.values())) / m.n_layer
    blocks = -(-m.n_layer // lay.pp) * per_block / lay.tp
    first = outer["wte.weight"] + outer.get("wpe.weight", 0)
    head = outer.get("lm_head.weight", 0 if lay.pp == 1 else outer["wte.weight"]) + outer.get("norm_f.weight", 0)
    return blocks + (first + head if lay.pp == 1 else max(first, head))


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    model_states_bytes: float
    activation_bytes: float
    temp_bytes: float
    breakdown: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return self.model_states_bytes + self.activation_bytes + self.temp_bytes

    def as_dict(self) -> dict:
        return {"layout": asdict(self.layout), "model_states_bytes": round(self.model_states_bytes),
                "activation_bytes": round(self.activation_bytes), "temp_bytes": round(self.temp_bytes),
                "total_bytes": round(self.total_bytes), "breakdown": {k: round(v) for k, v in self.breakdown.items()}}


def _activations(m: ModelConfig, lay: Layout, s_rank: float, micro_batches: int, am: ActivationModel,
                 act_bytes: int) -> tuple[float, float, float]:
    """(one layer's, the output layer's, the heaviest stage's) activation bytes on one rank. Ulysses: s/sp tokens
    per rank outside attention; inside it, the full s for a/sp heads, which is what a·sp heads over s/sp tokens
    give in the a·s·s·b score term. 1F1B keeps min(micro-batches, pp) in flight on the first stage."""
    b, h, a, L, v, t = lay.micro_batch, m.n_embd, m.n_head, m.n_layer, m.vocab_size, lay.tp
    layer = activation_per_layer(s_rank, b, h, a * lay.sp, t, lay.tp_sequence_parallel, lay.recompute, am)
    per_stage = -(-L // lay.pp)  # the heaviest stage: ceil(L/pp) blocks
    layers_first = per_stage * min(micro_batches, lay.pp)
    out_layer = act_bytes * s_rank * b * h / t * 2 + 4 * s_rank * b * v / t  # final norm and head inputs, log-probs
    extra = 0.0
    if lay.recompute == "full":  # inputs of every layer, plus one layer recomputed in backward
        extra = activation_per_layer(s_rank, b, h, a * lay.sp, t, lay.tp_sequence_parallel, "none", am)
    first = layers_first * layer + extra
    last = per_stage * layer + extra + out_layer
    return layer, out_layer, (max(first, last) if lay.pp > 1 else first + out_layer)


def memory(m: ModelConfig, lay: Layout, precision: str = "bf16", seq_len: int | None = None,
           micro_batches: int | None = None, fused_attention: bool = True, am: ActivationModel | None = None,
           params: float | None = None, device: str = "cuda", reduce_bucket: float = GRAD_BUCKET,
           overlap_comm: bool | None = None, prefetch_bucket: float = ZERO3_PREFETCH,
           max_live: float = ZERO3_MAX_LIVE, optimizer: str = "adamw") -> Estimate:
    """Per-rank bytes of `lay` for model `m`. `micro_batches` per step per pipeline (default: pp, so that 1F1B's
    first stage is full); `params` overrides Ψ (then `m` only shapes the activations). `device` "cuda": a
    reserved buffer counts whole; "cpu": only the pages written count (the resident set). `reduce_bucket`,
    `overlap_comm` (default: on at stage 3 only), `prefetch_bucket` (stage3_prefetch_bucket_size) and `max_live`
    (stage3_max_live_parameters) as in DeepSpeed's zero_optimization. `optimizer` "muon": DeepSpeed's Muon on the
    blocks' matrices (zero_memory.muon_states), AdamW on the rest."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, not {device!r}")
    prec = PRECISIONS[precision]
    s, b, v = seq_len or m.seq_len, lay.micro_batch, m.vocab_size
    psi_rank = params_per_rank(m, lay, params)
    nd = lay.dp * lay.sp  # Ulysses ranks hold replicas: ZeRO shards over dp x sp
    numels = muon_numels(m) if optimizer == "muon" else []  # the matrices Muon steps (none: AdamW)
    muon = psi_rank * sum(numels) / param_count(m).total if numels else 0.0
    ms = model_states(psi_rank, lay.zero, nd, prec, lay.offload, muon)
    mu = muon_buffers(numels, lay.zero, nd, prec, psi_rank, muon, lay.tp)
    am = am or ActivationModel.for_model(m, prec.act, fused_attention)
    s_rank = s / lay.sp
    t = lay.tp
    layer, out_layer, acts = _activations(m, lay, s_rank, micro_batches or lay.pp, am, prec.act)
    # DeepSpeed's buffers beside the model states (lifecycle.tasks.train.zero_memory)
    big = largest_tensor(m) / t
    buf = engine_buffers(psi_rank, lay.zero, nd, prec, big, lay.offload, device, reduce_bucket, overlap_comm)
    bucket = buf["grad_bucket"]
    # ZeRO-3 keeps a gathered parameter until its next use when that is within stage3_max_reuse_distance (1e9
    # elements), up to stage3_max_live_parameters (1e9): below 1e9 parameters every parameter gathered in forward
    # stays gathered until backward has used it (measured: forward holds the whole model, bench.planner_memory)
    gathered = min(psi_rank, max_live) * prec.param if lay.zero == 3 else 0.0
    # ... and beside those copies the flat buffer of one prefetch bucket. The coordinator prefetches up to
    # stage3_prefetch_bucket_size elements in one coalesced all-gather (partitioned_param_coordinator.py:452-484)
    # into one flat tensor (partition_parameters.py:1343, `_all_gather_dtype`) whose handle it registers for every
    # parameter of the bucket (coordinator:613). The first wait copies every parameter out of it (`torch.cat`,
    # partition_parameters.py:795) but the handle keeps `partitions`, views of the flat tensor, until the
    # bucket's last parameter is fetched and popped from the registry (coordinator:406): the bucket is held twice.
    prefetch = min(psi_rank, prefetch_bucket) * prec.param if lay.zero == 3 else 0.0
    loss_bwd = 2 * 4 * s_rank * b * v / t  # fp32 gradient of the log-probs, and of the logits
    # fp32 is this project's CPU training: torch AdamW's per-tensor loop (torch/optim/adam.py:544) computes
    # `(exp_avg_sq.sqrt() / bias_correction2_sqrt)`, two fp32 temporaries the size of the tensor it updates (the
    # flat partition under ZeRO-1/2/3) alive at once. 16-bit on GPU: a fused Adam, no temporary.
    largest = max(big, psi_rank / nd if lay.zero else 0)
    opt_step = 2 * 4 * largest if precision == "fp32" and not lay.offload else 0.0
    # Two moments bound the peak. Forward and backward: the activations, the gradient bucket and the gradient
    # waiting for it, ZeRO-3's gathered parameters and prefetch buffer, the loss's backward. The optimizer step:
    # the activations are gone, stages 1-2 have released their bucket at the end of backward (stage_1_and_2.py
    # `_release_ipg_buffers` in the ipg epilogue), stage 1 its gradients outside the partition; the step makes the
    # fp32 gradients; stage 3 holds its bucket for good (stage3.py:782).
    backward = bucket + buf["pending_grad"] + gathered + prefetch + loss_bwd + mu["gather_cache"]
    step = opt_step + buf["step_fp32_grads"] - buf["step_grads_released"] + (bucket if lay.zero == 3 else 0.0)
    step = max(step - mu["step_grads_not_made"], mu["whole_grads"]) + mu["gather_cache"]  # zero_memory.muon_buffers
    step += mu["tp_gather"]  # tp under Muon: one whole matrix's gradient and momentum (zero_memory.muon_tp_gather)
    temp = max(backward, step - acts)  # total = states + max(activations + backward, step)
    return Estimate(lay, sum(ms.values()), acts, temp,
                    {**{f"{k}_bytes": x for k, x in ms.items()}, "activation_per_layer_bytes": layer,
                     "output_layer_bytes": out_layer, "grad_bucket_bytes": bucket, "zero3_gathered_bytes": gathered,
                     "zero3_prefetch_bytes": prefetch, "loss_backward_bytes": loss_bwd,
                     "pending_grad_bytes": buf["pending_grad"], "optimizer_step_temp_bytes": opt_step,
                     "step_fp32_grad_bytes": buf["step_fp32_grads"],
                     "step_grads_released_bytes": buf["step_grads_released"],
                     "muon_gather_cache_bytes": mu["gather_cache"], "muon_whole_grads_bytes": mu["whole_grads"],
                     "muon_tp_gather_bytes": mu["tp_gather"],
                     "backward_buffers_bytes": backward, "step_buffers_bytes": step})


# --------------------------------------------------------------------------------------------------
# units


def parse_bytes(text: str) -> float:
    """`80GiB`, `80GB`, `512MiB`, `1.5e10` -> bytes."""
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
             "tib": 2**40}
    mt = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not mt or mt.group(2).lower() not in units:
        raise UsageError(f"not a size: {text!r} (e.g. 80GiB, 80GB, 512MiB)")
    value = float(mt.group(1)) * units[mt.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"not a positive size: {text!r}")
    return value


def parse_count(text: str) -> float:
    """`7e9`, `7B`, `350M`, `1.3b` -> a count."""
    mt = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMbBtT]?)\s*", str(text))
    if not mt:
        raise UsageError(f"not a parameter count: {text!r} (e.g. 7e9, 7B, 350M)")
    return float(mt.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[mt.group(2).lower()]


def gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"
