"""The decoder's shape, torch-free: `ModelConfig` (with Llama 3's `RopeScaling` and the experts' `MoEArch`), read
by the model (lifecycle.tasks.train.model), the sizing planner and `TrainConfig.model`."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator


class RopeScaling(BaseModel):
    """Llama 3's RoPE frequency scaling (`rope_type: llama3` in a Hugging Face config): wavelengths longer than
    `original_max_position_embeddings / low_freq_factor` are divided by `factor`, those shorter than
    `... / high_freq_factor` are kept, and the band between is interpolated smoothly."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    type: Literal["llama3"] = "llama3"
    """The only scaling computed here; any other `rope_type` is refused at import."""
    factor: float = Field(gt=0)
    """Divisor of the low frequencies."""
    low_freq_factor: float = Field(gt=0)
    """original_max_position_embeddings / low_freq_factor: wavelength above which frequencies are divided."""
    high_freq_factor: float = Field(gt=0)
    """original_max_position_embeddings / high_freq_factor: wavelength below which frequencies are kept."""
    original_max_position_embeddings: int = Field(ge=1)
    """Context length of the model before scaling."""

    @model_validator(mode="after")
    def _check(self) -> "RopeScaling":
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                             f"({self.low_freq_factor})")
        return self


class MoEArch(BaseModel):
    """The mixture-of-experts part of an architecture (`ModelConfig.moe`): what a checkpoint's model_config.json
    needs to rebuild the model. The trainer fills it from `train.moe` (lifecycle.tasks.train.parallel.moe)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    num_experts: int = Field(ge=1)
    """Experts per MoE layer."""
    top_k: int = Field(1, ge=1)
    """Experts each token goes to. top_k=1 scales the expert's output by its router probability (Switch);
    top_k >= 2 by the probabilities renormalised over the chosen k (GShard, Mixtral)."""
    every: int = Field(1, ge=1)
    """Block i (0-based) has an MoE MLP when (i + 1) % every == 0."""

    @model_validator(mode="after")
    def _check(self) -> "MoEArch":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})")
        return self

    def is_moe_block(self, i: int) -> bool:
        return (i + 1) % self.every == 0


class ModelConfig(BaseModel):
    """Architecture of the decoder in lifecycle.tasks.train.model (kept here, torch-free). Every field is in the run fingerprint."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    vocab_size: int | None = Field(None, ge=2)
    """Vocabulary size. Left null in a training config: the train task fills it from the tokenizer."""
    n_layer: int = Field(4, ge=1)
    """Number of transformer blocks."""
    n_head: int = Field(4, ge=1)
    """Attention heads per block; must divide `n_embd`."""
    n_embd: int = Field(128, ge=8)
    """Residual stream width."""
    seq_len: int = Field(128, ge=2)
    """Context length in tokens (the longest sequence `forward` accepts)."""
    norm: Literal["rmsnorm", "layernorm", "none"] = "rmsnorm"
    """Normalisation before each sublayer and before the output head; `none` (no norm at all) only with
    `init: tfixup`, which makes it trainable."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """Feed-forward type. SwiGLU uses a hidden width of 8/3·n_embd (rounded up to 32) to match GELU's 4·n_embd in parameters."""
    pos: Literal["rope", "learned"] = "rope"
    """Position encoding: rotary (applied to q and k in attention) or a learned absolute table."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on attention weights and residual branches (0 for short pretraining runs)."""
    init: Literal["normal", "gpt2_scaled", "ds_init", "tfixup"] = "gpt2_scaled"
    """normal: N(0, 0.02) everywhere; gpt2_scaled: residual output projections get 0.02/sqrt(2·n_layer) (GPT-2);
    ds_init: depth-scaled init for deep stacks (Zhang, Titov & Sennrich 2019, "Improving Deep Transformer with
    Depth-Scaled Initialization and Merged Attention", eq. 7): every matrix of block l (1-based) is drawn from
    U(-γ, γ) with γ = α·sqrt(6 / (d_in + d_out)) / sqrt(l), α = 1, so deeper blocks start with smaller
    residual updates; embeddings stay N(0, 0.02). tfixup: T-Fixup (Huang et al. 2020, "Improving Transformer
    Optimization Through Better Initialization", sec. 3.3, decoder rule) for a model without norms (`norm: none`)
    and trained without warmup: Xavier-uniform matrices (q, k, v and SwiGLU's gate and up each apart), embeddings
    N(0, n_embd^-1/2), then the values, the attention output, every MLP matrix and the embeddings scaled by
    (9·n_layer)^-1/4 (lifecycle.tasks.train.initialise)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head (see module docstring)."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""
    attention: Literal["document", "packed"] = "document"
    """How a packed training window (documents end to end, each followed by the tokenizer's end-of-text id) is
    attended. `document`: each token attends only to its own document's earlier tokens and its position restarts
    at 0 where the document starts (Llama 3's document mask; lifecycle.tasks.train.model.documents). `packed`: one
    causal sequence over the whole window, positions 0..seq_len-1 across documents (the behaviour before this
    field existed: a run whose config.json lacks it resumes as `packed`). Only training and in-training
    validation windows are affected: generation sees one document. Works under every layout: a pipeline passes
    the window's ids from stage to stage with the activations, sequence parallelism gathers the slices' ids
    (lifecycle.tasks.train.parallel.pp, sp). Default `document` (issue 47: over 120 steps at 3 seeds it ended below
    `packed` on the demo's model, docs/benchmarks.md "Recipe"); `packed` keeps the packing of before."""
    norm_eps: float = Field(1e-5, gt=0)
    """Epsilon of the norm layers."""
    n_kv_head: int | None = Field(None, ge=1)
    """Key/value heads (grouped-query attention, Ainslie et al. 2023): each serves n_head / n_kv_head query
    heads. Must divide n_head. Null = n_head (plain multi-head attention, the default)."""
    qkv_bias: bool = False
    """Bias on the q, k and v projections (Qwen2); the output projection never has one."""
    mlp_hidden_dim: int | None = Field(None, ge=1)
    """SwiGLU hidden width (a Hugging Face config's `intermediate_size`). Null = 8/3·n_embd rounded up to 32."""
    rope_scaling: RopeScaling | None = None
    """RoPE frequency scaling (Llama 3.1+); null = plain RoPE at `rope_theta`."""
    moe: MoEArch | None = None
    """Mixture-of-experts MLPs; null = dense. Set by the trainer from `train.moe` (a training config sets
    `train.moe`, not this); left out of the dump when null, so a dense model's config and fingerprint are
    those of before."""

    @model_serializer(mode="wrap")
    def _drop_null_moe(self, handler):
        out = handler(self)
        if self.moe is None and isinstance(out, dict):
            out.pop("moe", None)
        return out

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if self.pos != "rope" and self.rope_scaling is not None:
            raise ValueError(f"rope_scaling needs pos='rope', got pos={self.pos!r}")
        if self.mlp != "swiglu" and self.mlp_hidden_dim is not None:
            raise ValueError(f"mlp_hidden_dim applies to mlp='swiglu' only, got mlp={self.mlp!r}")
        if (self.init == "tfixup") != (self.norm == "none"):
            raise ValueError(f"init={self.init!r} with norm={self.norm!r}: T-Fixup is the initialisation of a model "
                             "without norms, and a model without norms needs it; set both init=tfixup and norm=none, "
                             "or neither")
        if self.pos == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"pos='rope' needs an even head dim, got n_embd/n_head = {self.n_embd // self.n_head}")
        return self

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def mlp_hidden(self) -> int:
        if self.mlp == "gelu":
            return 4 * self.n_embd
        return self.mlp_hidden_dim or 32 * math.ceil(8 * self.n_embd / 3 / 32)
