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

import argparse
import itertools
import json
import math
import re
from dataclasses import asdict, dataclass, field, replace

from lifecycle.core.errors import UsageError
from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.parallel.mesh import RECOMPUTE, Layout
from lifecycle.tasks.train.sizing import flops_per_token, largest_tensor, param_count
from lifecycle.tasks.train.zero_memory import (  # noqa: F401  (Precision, PRECISIONS, GRAD_BUCKET: the planner's API)
    GRAD_BUCKET, PRECISIONS, Precision, engine_buffers, model_states,
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

    @classmethod
    def for_model(cls, m: ModelConfig, act_bytes: int, fused_attention: bool = True) -> "ActivationModel":
        return cls(act_bytes=act_bytes, dropout=m.dropout > 0, mlp_ratio=m.mlp_hidden / m.n_embd,
                   gated=m.mlp == "swiglu", rope=m.pos == "rope", fused_attention=fused_attention)

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


def memory(m: ModelConfig, lay: Layout, precision: str = "bf16", seq_len: int | None = None,
           micro_batches: int | None = None, fused_attention: bool = True, am: ActivationModel | None = None,
           params: float | None = None, device: str = "cuda", reduce_bucket: float = GRAD_BUCKET,
           overlap_comm: bool | None = None, prefetch_bucket: float = ZERO3_PREFETCH,
           max_live: float = ZERO3_MAX_LIVE) -> Estimate:
    """Per-rank bytes of `lay` for model `m`. `micro_batches` per step per pipeline (default: pp, so that 1F1B's
    first stage is full); `params` overrides Ψ (then `m` only shapes the activations). `device` "cuda": a
    reserved buffer counts whole; "cpu": only the pages written count (the resident set). `reduce_bucket`,
    `overlap_comm` (default: on at stage 3 only), `prefetch_bucket` (stage3_prefetch_bucket_size) and `max_live`
    (stage3_max_live_parameters) as in DeepSpeed's zero_optimization."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, not {device!r}")
    prec = PRECISIONS[precision]
    s, b, h, a, L, v = seq_len or m.seq_len, lay.micro_batch, m.n_embd, m.n_head, m.n_layer, m.vocab_size
    psi = params if params is not None else total_params(m)
    psi_rank = psi / (lay.tp * lay.pp)  # tensor and pipeline parallelism split the weights (uniformly here)
    nd = lay.dp * lay.sp  # Ulysses ranks hold replicas: ZeRO shards over dp x sp
    ms = model_states(psi_rank, lay.zero, nd, prec, lay.offload)
    am = am or ActivationModel.for_model(m, prec.act, fused_attention)
    s_rank = s / lay.sp
    # Ulysses: s/sp tokens per rank outside attention; inside it, the full s for a/sp heads, which is what
    # a·sp heads over s/sp tokens give in the a·s·s·b score term
    layer = activation_per_layer(s_rank, b, h, a * lay.sp, lay.tp, lay.tp_sequence_parallel, lay.recompute, am)
    mb = micro_batches or lay.pp
    inflight = min(mb, lay.pp)
    layers_first = L / lay.pp * inflight
    t = lay.tp
    sbh = s_rank * b * h
    out_layer = prec.act * sbh / t * 2 + 4 * s_rank * b * v / t  # final norm input, head input, fp32 log-probs
    if lay.recompute == "full":  # inputs of every layer, plus one layer recomputed in backward
        full_layer = activation_per_layer(s_rank, b, h, a * lay.sp, t, lay.tp_sequence_parallel, "none", am)
        first = layers_first * layer + full_layer
        last = L / lay.pp * layer + full_layer + out_layer
    else:
        first = layers_first * layer
        last = L / lay.pp * layer + out_layer
    acts = max(first, last) if lay.pp > 1 else first + out_layer
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
    backward = bucket + buf["pending_grad"] + gathered + prefetch + loss_bwd
    step = opt_step + buf["step_fp32_grads"] - buf["step_grads_released"] + (bucket if lay.zero == 3 else 0.0)
    temp = max(backward, step - acts)  # total = states + max(activations + backward, step)
    return Estimate(lay, sum(ms.values()), acts, temp,
                    {**{f"{k}_bytes": x for k, x in ms.items()}, "activation_per_layer_bytes": layer,
                     "output_layer_bytes": out_layer, "grad_bucket_bytes": bucket, "zero3_gathered_bytes": gathered,
                     "zero3_prefetch_bytes": prefetch, "loss_backward_bytes": loss_bwd,
                     "pending_grad_bytes": buf["pending_grad"], "optimizer_step_temp_bytes": opt_step,
                     "step_fp32_grad_bytes": buf["step_fp32_grads"],
                     "step_grads_released_bytes": buf["step_grads_released"],
                     "backward_buffers_bytes": backward, "step_buffers_bytes": step})


# --------------------------------------------------------------------------------------------------
# step time


@dataclass(frozen=True)
class Hardware:
    """Constants the step-time model assumes (override them on the command line). Defaults: an H100 SXM node."""

    peak_flops: float = 989e12
    """Dense bf16 FLOP/s of one GPU (H100 SXM datasheet)."""
    mfu: float = 0.45
    """Fraction of peak the matmuls reach (Megatron-LM/torchtitan report 40-55 % on H100 for 7-70B models)."""
    gpus_per_node: int = 8
    intra_node_bw: float = 360e9
    """Bytes/s one GPU moves in a ring inside a node (NVLink 4: 450 GB/s per direction, ~80 % achieved)."""
    inter_node_bw: float = 40e9
    """Bytes/s per GPU between nodes (one 400 Gb/s NDR InfiniBand NIC per GPU, ~80 % achieved)."""
    pcie_bw: float = 25e9
    """Bytes/s host<->device per GPU for ZeRO-Offload (PCIe 5 x16, about half its peak as measured in practice)."""
    cpu_adam_params_per_s: float = 1e9
    """Parameters per second the CPU Adam of ZeRO-Offload updates for one GPU (its share of the host's cores)."""
    reserve_bytes: float = 2 * GiB
    """Memory per GPU not available to training: CUDA context, NCCL buffers, allocator fragmentation."""


def step_time(m: ModelConfig, lay: Layout, global_batch: int, hw: Hardware, precision: str = "bf16",
              seq_len: int | None = None) -> dict:
    """Seconds per optimizer step of `global_batch` sequences, by part (no overlap assumed)."""
    prec = PRECISIONS[precision]
    s, h, L = seq_len or m.seq_len, m.n_embd, m.n_layer
    n_active = param_count(m).active  # the matmul parameters a token goes through (top_k experts of an MoE)
    m_micro = global_batch // (lay.dp * lay.micro_batch)  # micro-batches per step per pipeline
    tokens = global_batch * s
    per_token = flops_per_token(m, s)  # 6·N + 12·L·h·s, forward + backward (PaLM appendix B)
    recompute = {"none": 0, "selective": 4 * L * h * s, "full": 2 * n_active + 4 * L * h * s}[lay.recompute]
    flops = tokens * (per_token + recompute)
    compute = flops / (lay.ranks * hw.peak_flops * hw.mfu)
    bubble = compute * (lay.pp - 1) / m_micro
    psi_rank = total_params(m) / (lay.tp * lay.pp)
    within_node = lay.ranks <= hw.gpus_per_node
    dp_bw = hw.intra_node_bw if within_node else hw.inter_node_bw
    nd = lay.dp * lay.sp
    ring = (nd - 1) / nd if nd > 1 else 0.0
    # ZeRO-0/1: one all-reduce per step (2(n-1)/n Ψ); ZeRO-2: a reduce-scatter per micro-batch + an all-gather;
    # ZeRO-3: all-gather in forward and backward + reduce-scatter per micro-batch.
    volume = {0: 2, 1: 2, 2: m_micro + 1, 3: 3 * m_micro}[lay.zero]
    dp_comm = volume * ring * psi_rank * prec.grad / dp_bw
    act = s / lay.sp * lay.micro_batch * h * prec.act  # one activation tensor
    tp_ar = (4 + (2 if lay.recompute == "full" else 0)) * L / lay.pp * m_micro  # all-reduces (or AG + RS) per step
    tp_comm = tp_ar * 2 * (lay.tp - 1) / lay.tp * act / hw.intra_node_bw if lay.tp > 1 else 0.0
    sp_comm = (8 * L / lay.pp * m_micro * (lay.sp - 1) / lay.sp * act / lay.tp / hw.intra_node_bw
               if lay.sp > 1 else 0.0)  # 4 all-to-alls forward, 4 backward
    pp_bw = hw.intra_node_bw if lay.tp * lay.pp * lay.sp <= hw.gpus_per_node else hw.inter_node_bw
    pp_comm = 2 * m_micro * act / lay.tp / pp_bw if lay.pp > 1 else 0.0
    offload = 0.0
    if lay.offload:
        part = psi_rank / nd
        offload = part * (prec.grad + prec.param) / hw.pcie_bw + part / hw.cpu_adam_params_per_s
    parts = {"compute_s": compute, "bubble_s": bubble, "dp_comm_s": dp_comm, "tp_comm_s": tp_comm,
             "sp_comm_s": sp_comm, "pp_comm_s": pp_comm, "offload_s": offload}
    parts["step_s"] = sum(parts.values())
    parts["mfu"] = flops / (parts["step_s"] * lay.ranks * hw.peak_flops) if parts["step_s"] else 0.0
    return parts


# --------------------------------------------------------------------------------------------------
# search


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(m: ModelConfig, gpus: int, global_batch: int, hw: Hardware, *, tps=None, pps=None, sps=None,
               zeros=(0, 1, 2, 3), recomputes=RECOMPUTE, offloads=(False, True), micro_batches=None):
    """Every layout the search considers: tp within a node and dividing the heads, sp dividing the heads
    left, pp dividing the layers, dp the rest; ZeRO-2/3 not under pp (DeepSpeed's pipeline engine runs
    ZeRO-0/1 only); offload only with ZeRO >= 1; micro-batches dividing the per-replica batch."""
    for tp in tps or [d for d in divisors(min(hw.gpus_per_node, gpus)) if m.n_head % d == 0]:
        for sp in sps or [d for d in divisors(gpus // tp) if (m.n_head // tp) % d == 0 and d <= hw.gpus_per_node]:
            for pp in pps or [d for d in divisors(gpus // (tp * sp)) if m.n_layer % d == 0]:
                dp = gpus // (tp * sp * pp)
                if dp * tp * sp * pp != gpus or global_batch % dp:
                    continue
                for zero, rc, off in itertools.product(zeros, recomputes, offloads):
                    if (pp > 1 and zero >= 2) or (off and zero == 0):
                        continue
                    for b in micro_batches or [d for d in divisors(global_batch // dp) if d <= 64]:
                        yield Layout(dp=dp, tp=tp, pp=pp, sp=sp, zero=zero, micro_batch=b, accum=global_batch // (dp * b),
                                     recompute=rc, offload=off)


@dataclass(frozen=True)
class Option:
    layout: Layout
    memory: Estimate
    time: dict
    fits: bool

    def as_dict(self) -> dict:
        return {**self.memory.as_dict(), "fits": self.fits, "step_time": {k: round(x, 6) for k, x in self.time.items()}}


def search(m: ModelConfig, gpus: int, gpu_memory: float, global_batch: int, hw: Hardware = Hardware(),
           precision: str = "bf16", seq_len: int | None = None, device: str = "cuda", **space) -> list[Option]:
    """All candidate layouts, the fitting ones first, fastest first (ties: bigger micro-batch, lower ZeRO stage,
    no offload, less recomputation)."""
    out = []
    for lay in candidates(m, gpus, global_batch, hw, **space):
        mb = global_batch // (lay.dp * lay.micro_batch)
        est = memory(m, lay, precision, seq_len, micro_batches=mb, device=device)
        t = step_time(m, lay, global_batch, hw, precision, seq_len)
        out.append(Option(lay, est, t, est.total_bytes <= gpu_memory - hw.reserve_bytes))
    out.sort(key=lambda o: (not o.fits, round(o.time["step_s"], 9), -o.layout.micro_batch, o.layout.zero,
                            o.layout.offload, RECOMPUTE.index(o.layout.recompute), o.layout.tp, o.layout.pp))
    return out


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


def runners_up(options: list[Option], n: int) -> list[Option]:
    """The fastest fitting option of each distinct (tp, pp, sp, ZeRO stage, offload), fastest first."""
    seen, out = set(), []
    for o in options:
        key = (o.layout.tp, o.layout.pp, o.layout.sp, o.layout.zero, o.layout.offload)
        if o.fits and key not in seen:
            seen.add(key)
            out.append(o)
        if len(out) == n:
            break
    return out


# --------------------------------------------------------------------------------------------------
# `lifecycle plan memory` and `lifecycle plan layout`


def gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def model_from_args(args: argparse.Namespace) -> tuple[ModelConfig, float]:
    """(shape, Ψ): `--model SHAPE`, or `--params P` with a Llama-style shape of P parameters (sizing)."""
    from lifecycle.tasks.train.sizing import model_for_params

    if args.model:
        m = parse_model(args.model)
        if args.seq_len:
            m = m.model_copy(update={"seq_len": args.seq_len})
        return m, float(total_params(m))
    psi = parse_count(args.params)
    if psi <= 0:
        raise UsageError(f"--params must be positive, got {args.params}")
    base = ModelConfig(vocab_size=32000, seq_len=args.seq_len or 2048, tie_embeddings=False)
    return model_for_params(psi, base), psi


def shape_of(m: ModelConfig) -> dict:
    return {k: getattr(m, k) for k in ("n_layer", "n_embd", "n_head", "kv_heads", "mlp_hidden", "seq_len", "vocab_size",
                                       "mlp", "pos", "tie_embeddings", "qkv_bias")}


def cmd_memory(args: argparse.Namespace) -> int:
    m, psi = model_from_args(args)
    model_par = args.tp * args.pp * args.sp
    if args.ranks % model_par:
        raise UsageError(f"--ranks {args.ranks} is not a multiple of tp x pp x sp = {model_par}")
    if m.n_head % (args.tp * args.sp):
        raise UsageError(f"n_head {m.n_head} is not divisible by tp x sp = {args.tp * args.sp}")
    if args.offload and args.zero == 0:
        raise UsageError("--offload needs --zero 1, 2 or 3 (ZeRO-Offload moves the partitioned optimizer states)")
    lay = Layout(dp=args.ranks // model_par, tp=args.tp, pp=args.pp, sp=args.sp, zero=args.zero,
                 micro_batch=args.micro_batch, recompute=args.activation_checkpointing, offload=args.offload,
                 tp_sequence_parallel=not args.no_sequence_parallel)
    est = memory(m, lay, args.precision, micro_batches=args.micro_batches,
                 fused_attention=args.attention == "fused", params=psi, device=args.device,
                 reduce_bucket=args.reduce_bucket, prefetch_bucket=args.prefetch_bucket)
    out = {"model": shape_of(m), "params": psi, "precision": args.precision, "attention": args.attention,
           "ranks": args.ranks, **est.as_dict()}
    if args.json:
        print(json.dumps(out))
        return 0
    br = est.breakdown
    print(f"model     {' '.join(f'{k}={v}' for k, v in shape_of(m).items())}  Ψ = {psi:,.0f} parameters")
    print(f"layout    {lay.describe()} ({args.ranks} ranks, {args.precision}, {args.attention} attention)")
    print(f"per rank  model states {gib(est.model_states_bytes)} (params {gib(br['params_bytes'])}, grads "
          f"{gib(br['grads_bytes'])}, optimizer {gib(br['optimizer_bytes'])})")
    print(f"          activations  {gib(est.activation_bytes)} ({gib(br['activation_per_layer_bytes'])} per layer, "
          f"output layer {gib(br['output_layer_bytes'])})")
    states, acts = est.model_states_bytes, est.activation_bytes
    print(f"          buffers      backward {gib(br['backward_buffers_bytes'])} (gradient bucket "
          f"{gib(br['grad_bucket_bytes'])}, a gradient waiting for it {gib(br['pending_grad_bytes'])}, loss backward "
          f"{gib(br['loss_backward_bytes'])}, ZeRO-3 gathered {gib(br['zero3_gathered_bytes'])} and prefetch buffer "
          f"{gib(br['zero3_prefetch_bytes'])})")
    print(f"                       step {gib(br['step_buffers_bytes'] + br['step_grads_released_bytes'])} (fp32 "
          f"gradients {gib(br['step_fp32_grad_bytes'])}, optimizer step {gib(br['optimizer_step_temp_bytes'])}, ZeRO-3's "
          f"gradient bucket), and ZeRO-1 has released {gib(br['step_grads_released_bytes'])} of gradients")
    print(f"          peak of      backward {gib(states + acts + br['backward_buffers_bytes'])} (states + activations "
          f"+ buffers), step {gib(states + br['step_buffers_bytes'])} (states + buffers - released)")
    print(f"          total        {gib(est.total_bytes)}")
    return 0


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    hw = Hardware()
    over = {k: getattr(args, k) for k in ("peak_flops", "mfu", "gpus_per_node", "intra_node_bw", "inter_node_bw",
                                           "pcie_bw", "cpu_adam_params_per_s") if getattr(args, k) is not None}
    if args.reserve is not None:
        over["reserve_bytes"] = parse_bytes(args.reserve)
    return replace(hw, **over)


def describe_option(o: Option) -> str:
    t = o.time
    return (f"{o.layout.describe()}\n    memory {gib(o.memory.total_bytes)} per GPU (model states "
            f"{gib(o.memory.model_states_bytes)}, activations {gib(o.memory.activation_bytes)}, temporary "
            f"{gib(o.memory.temp_bytes)})\n    step {t['step_s']:.3f} s (compute {t['compute_s']:.3f}, bubble "
            f"{t['bubble_s']:.3f}, dp {t['dp_comm_s']:.3f}, tp {t['tp_comm_s']:.3f}, sp {t['sp_comm_s']:.3f}, "
            f"pp {t['pp_comm_s']:.3f}, offload {t['offload_s']:.3f}), MFU {t['mfu']:.1%}")


def cmd_layout(args: argparse.Namespace) -> int:
    m, _ = model_from_args(args)
    hw = hardware_from_args(args)
    mem = parse_bytes(args.gpu_memory)
    if args.gpus < 1 or args.global_batch < 1:
        raise UsageError("--gpus and --global-batch must be >= 1")
    opts = search(m, args.gpus, mem, args.global_batch, hw, args.precision)
    fitting = [o for o in opts if o.fits]
    best, rest = (fitting[0], runners_up(fitting[1:], args.top)) if fitting else (None, [])
    if args.json:
        print(json.dumps({"model": shape_of(m), "params": total_params(m), "gpus": args.gpus, "gpu_memory_bytes": mem,
                          "global_batch": args.global_batch, "precision": args.precision,
                          "constants": asdict(hw), "searched": len(opts), "fitting": len(fitting),
                          "best": best.as_dict() if best else None, "runners_up": [o.as_dict() for o in rest],
                          "smallest_if_none_fits": None if best else min(opts, key=lambda o: o.memory.total_bytes).as_dict()}))
        return 0 if best else 1
    print(f"model     {' '.join(f'{k}={v}' for k, v in shape_of(m).items())}  Ψ = {total_params(m):,} parameters")
    print(f"hardware  {args.gpus} GPUs x {gib(mem)}, {hw.gpus_per_node} per node; peak {hw.peak_flops:.3g} FLOP/s at "
          f"MFU {hw.mfu:.0%}; ring {hw.intra_node_bw / 1e9:g} GB/s in a node, {hw.inter_node_bw / 1e9:g} GB/s "
          f"across; PCIe {hw.pcie_bw / 1e9:g} GB/s; {gib(hw.reserve_bytes)} reserved per GPU")
    print(f"searched  {len(opts)} layouts for a global batch of {args.global_batch} x {m.seq_len} tokens "
          f"({args.precision}); {len(fitting)} fit")
    if not best:
        small = min(opts, key=lambda o: o.memory.total_bytes)
        print(f"none fits: the smallest needs {gib(small.memory.total_bytes)} per GPU: {small.layout.describe()}")
        return 1
    print(f"best      {describe_option(best)}")
    print("run it    lifecycle run CONFIG " + " ".join(f"--set {line}" for line in best.layout.set_lines()))
    for i, o in enumerate(rest, 1):
        print(f"{i}.        {describe_option(o)}")
    return 0


def register(subparsers) -> None:
    """`lifecycle plan` (lifecycle.tasks.train.sizing.register) with `memory` and `layout` under it."""
    from lifecycle.tasks.train.sizing import register as register_plan

    plan_parser = register_plan(subparsers)
    sub = plan_parser.add_subparsers(dest="plan_command", metavar="{memory,layout}")

    def model_args(p: argparse.ArgumentParser, params: bool) -> None:
        g = p.add_mutually_exclusive_group(required=True)
        g.add_argument("--model", help="a preset (" + ", ".join(PRESETS) + "), hf:DIR (a Hugging Face checkpoint's "
                                       "config.json: Llama, Mistral, Qwen2; seq_len 4096) or n_layer=32,n_embd=4096,"
                                       "n_head=32,vocab=32000[,seq_len=4096,n_kv_head=8,mlp=gelu,...]; presets and "
                                       "hf:DIR take overrides: 7b,seq_len=2048")
        if params:
            g.add_argument("--params", help="a parameter count (7e9, 7B, 350M): a Llama-style shape of that size")
        else:
            p.set_defaults(params=None)
        p.add_argument("--seq-len", type=int, help="sequence length (default: the model's)")
        p.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16",
                       help="bf16/fp16: mixed-precision Adam, 2+2+12 bytes per parameter (ZeRO paper); fp32: 4+4+8 "
                            "(+4 for DeepSpeed's ZeRO-1/2 master copy) as this project trains on CPU (default bf16)")
        p.add_argument("--json", action="store_true", help="print one JSON object")

    mem = sub.add_parser("memory", help="Per-rank bytes of one layout: model states (ZeRO paper), activations "
                                        "(Korthikanti et al. 2022) and temporary buffers.")
    model_args(mem, params=True)
    mem.add_argument("--ranks", type=int, default=1, help="total ranks (dp = ranks / (tp x pp x sp)); default 1")
    mem.add_argument("--zero", type=int, choices=range(4), default=0, help="ZeRO stage 0-3 (default 0)")
    for axis in ("tp", "pp", "sp"):
        mem.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} degree (default 1)")
    mem.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per forward (default 1)")
    mem.add_argument("--micro-batches", type=int, help="micro-batches per step under pp (default pp: 1F1B full)")
    mem.add_argument("--activation-checkpointing", choices=RECOMPUTE, default="none",
                     help="none, selective (recompute attention scores) or full (keep each layer's input)")
    mem.add_argument("--attention", choices=("fused", "materialized"), default="fused",
                     help="fused (SDPA/flash: no a·s·s scores kept; this project's model) or materialized "
                          "(Korthikanti's 5·a·s/h term)")
    mem.add_argument("--no-sequence-parallel", action="store_true",
                     help="tp without Megatron sequence parallelism (norm/dropout activations not split)")
    mem.add_argument("--offload", action="store_true", help="ZeRO-Offload: optimizer states on the CPU")
    mem.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                     help="cuda (default): a reserved buffer counts whole, as the caching allocator hands it out; "
                          "cpu: only the pages written count (the resident set of a CPU run)")
    mem.add_argument("--reduce-bucket", type=float, default=GRAD_BUCKET,
                     help="DeepSpeed's zero_optimization.reduce_bucket_size, elements (default 5e8)")
    mem.add_argument("--prefetch-bucket", type=float, default=ZERO3_PREFETCH,
                     help="DeepSpeed's zero_optimization.stage3_prefetch_bucket_size, elements (default 5e7)")
    mem.set_defaults(func=cmd_memory)

    lay = sub.add_parser("layout", help="Search dp/tp/pp/sp, ZeRO stage, micro-batch, recomputation and offload; "
                                        "print the fastest layout that fits and the runners-up.")
    model_args(lay, params=False)
    lay.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    lay.add_argument("--gpu-memory", default="80GiB", help="memory per GPU (default 80GiB)")
    lay.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    lay.add_argument("--top", type=int, default=4, help="runners-up to print (default 4)")
    for name, what in (("peak-flops", "dense FLOP/s per GPU"), ("mfu", "fraction of peak reached"),
                       ("intra-node-bw", "ring bytes/s per GPU in a node"),
                       ("inter-node-bw", "bytes/s per GPU across nodes"), ("pcie-bw", "host<->GPU bytes/s"),
                       ("cpu-adam-params-per-s", "CPU Adam parameters/s per GPU")):
        lay.add_argument(f"--{name}", type=float, help=f"{what} (default {getattr(Hardware(), name.replace('-', '_')):g})")
    lay.add_argument("--gpus-per-node", type=int, help=f"default {Hardware().gpus_per_node}")
    lay.add_argument("--reserve", help="memory per GPU kept out of the plan (default 2GiB)")
    lay.set_defaults(func=cmd_layout)


# --------------------------------------------------------------------------------------------------
# `train.layout: auto`


def rank_memory(cfg) -> tuple[float, str]:
    """(bytes per rank, where the figure comes from) for `train.layout: auto`."""
    import subprocess

    if cfg.layout_memory:
        return parse_bytes(cfg.layout_memory), "train.layout_memory"
    if cfg.engine.accelerator == "cuda":
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode or not out.stdout.strip():
            raise RuntimeError("train.layout=auto: nvidia-smi could not tell the GPU memory; set train.layout_memory")
        return float(out.stdout.split()[0]) * 2**20, "nvidia-smi memory.total"
    from lifecycle.core.procs import mem_available

    if (avail := mem_available()) is None:
        raise RuntimeError("train.layout=auto: /proc/meminfo gives no MemAvailable; set train.layout_memory")
    n = cfg.batch.num_ranks
    return avail / 2 / n, f"half of MemAvailable {avail / GiB:.1f} GiB over {n} ranks"


def resolve_layout(cfg, memory_bytes: float | None = None):
    """`train.layout: auto`: the TrainConfig with ZeRO stage, micro-batch, grad_accum and activation checkpointing
    chosen for its ranks and per-rank memory, and a sentence saying what was chosen and why. Only what the
    trainer runs today is searched: data parallelism over `num_ranks`, ZeRO 0-3, recomputation none or full
    (the trainer's checkpointing is per block; with SDPA there is no score matrix for selective to drop)."""
    if cfg.layout != "auto":
        return cfg, None
    source = "argument"
    if memory_bytes is None:
        memory_bytes, source = rank_memory(cfg)
    m, n, gb = cfg.model, cfg.batch.num_ranks, cfg.global_batch
    hw = Hardware(peak_flops=cfg.logging.peak_flops_per_rank or (989e12 if cfg.engine.accelerator == "cuda" else 1e11),
                  gpus_per_node=n if cfg.launch.hostfile is None else Hardware().gpus_per_node,
                  **({} if cfg.engine.accelerator == "cuda" else {"intra_node_bw": 5e9, "inter_node_bw": 1e9,
                                                                   "reserve_bytes": 0.0}))
    opts = search(m, n, memory_bytes, gb, hw, cfg.engine.precision, device="cuda" if cfg.engine.accelerator == "cuda"
                  else "cpu", tps=[1], pps=[1], sps=[1],
                  recomputes=("none", "full"), offloads=(False,),
                  micro_batches=divisors(gb // n))
    fitting = [o for o in opts if o.fits]
    if not fitting:
        small = min(opts, key=lambda o: o.memory.total_bytes)
        raise ValueError(f"train.layout=auto: no data-parallel layout of {n} ranks fits {gib(memory_bytes)} per rank "
                         f"({source}); the smallest, {small.layout.describe()}, needs {gib(small.memory.total_bytes)}")
    best = fitting[0]
    lay = best.layout
    new = cfg.model_copy(update={
        "batch": cfg.batch.model_copy(update={"micro_batch_size": lay.micro_batch,
                                              "grad_accum": gb // (n * lay.micro_batch)}),
        "engine": cfg.engine.model_copy(update={"zero_stage": lay.zero,
                                                "activation_checkpointing": lay.recompute == "full"})})
    nxt = next((o for o in fitting[1:] if (o.layout.zero, o.layout.recompute) != (lay.zero, lay.recompute)), None)
    why = (f"train.layout=auto: {n} ranks x {gib(memory_bytes)} ({source}), global batch {gb}: zero_stage={lay.zero} "
           f"micro_batch_size={lay.micro_batch} grad_accum={gb // (n * lay.micro_batch)} activation_checkpointing="
           f"{lay.recompute == 'full'}; predicted {gib(best.memory.total_bytes)} per rank (model states "
           f"{gib(best.memory.model_states_bytes)}, activations {gib(best.memory.activation_bytes)}) and "
           f"{best.time['step_s']:.3g} s per step, the fastest of {len(fitting)} of {len(opts)} layouts that fit"
           + (f"; next: {nxt.layout.describe()} at {nxt.time['step_s']:.3g} s" if nxt else ""))
    return new, why
