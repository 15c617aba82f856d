"""A small GPT decoder you can read top to bottom (after karpathy/nanoGPT `model.py`).

Pre-norm residual blocks: x + attn(norm(x)), then x + mlp(norm(x)). The default is the Llama recipe
(RMSNorm, SwiGLU, rotary position embeddings, no biases); the GPT-2 recipe (LayerNorm, GELU, learned
positions) is one config away, so ablations stay a config change.

Grouped-query attention (`n_kv_head`), a q/k/v bias, a given SwiGLU width and Llama 3's RoPE scaling are
config fields too, so a Llama 2/3, Mistral, Qwen2 or SmolLM checkpoint loads exactly
(lifecycle.tasks.train.hf_import); their defaults give the model and the state dict keys of before.

Document-aware attention (`ModelConfig.attention: document`, set up by the trainer with the end-of-text id the
tokenizer puts after every document, `GPT.doc_sep`): inside a packed window each token attends only to the
earlier tokens of its own document (a block-causal boolean mask for SDPA) and its rotary or learned position
restarts at 0 where its document starts (`documents`, over the whole window's ids: `GPT.window_ids`, which
sequence parallelism gathers; a pipeline passes the ids from stage to stage, lifecycle.tasks.train.parallel.pp). A window without an end-of-text token takes the plain
causal kernel. Left unset (`doc_sep` None, as when the model is rebuilt for generation) attention is causal over
the whole input, the same for a single document.

Input and output embeddings are tied by default (`tie_embeddings=True`): at demo scale (vocab 4096,
width 128) the token table is a large share of all parameters, and sharing it with the output head
(Press & Wolf 2017; GPT-2 does the same) saves that much again. Set `tie_embeddings=False` to untie.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# The config lives in lifecycle.tasks.train.launch so that importing the configs (CLI, flow) does not import torch.
from lifecycle.tasks.train.config import ModelConfig

__all__ = ["GPT", "ModelConfig"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight)

    def normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even when the model runs in bf16: the mean of squares loses precision otherwise.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * weight


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.n_embd, cfg.norm_eps)
    if cfg.norm == "none":  # T-Fixup's model (ModelConfig.init: tfixup)
        return nn.Identity()
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=False)


def rope_tables(cfg: ModelConfig, T: int, device: torch.device, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (T, head_dim/2) for positions start..start+T-1, computed in fp32 on every call.

    Computing them per forward (cheap next to the matmuls) instead of keeping buffers means a bf16 cast of
    the module cannot round the angles, and the state dict holds only learned weights.
    """
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    if cfg.rope_scaling is not None:
        inv_freq = llama3_scaled(inv_freq, cfg.rope_scaling)
    angles = torch.outer(torch.arange(start, start + T, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rope_tables_at(cfg: ModelConfig, positions: torch.Tensor, length: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (B, 1, T, head_dim/2) for per-token `positions` (B, T) (document-aware packing:
    positions restart at each document), all below `length` (default T; a sequence-parallel slice's positions
    run up to the whole window's); they broadcast over the heads in `apply_rope`."""
    cos, sin = rope_tables(cfg, length or positions.size(1), positions.device)
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def documents(idx: torch.Tensor, sep: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where the documents of each window of `idx` (B, T) lie, given the end-of-text id `sep` that ends each one
    (the token after it starts the next): (positions (B, T) counted from each document's first token, the
    block-causal mask (B, 1, T, T), True where a query may attend a key: same document, not later). None when no
    window holds a boundary (then positions are 0..T-1 and the mask is the causal one)."""
    starts = torch.zeros_like(idx, dtype=torch.bool)
    starts[:, 1:] = idx[:, :-1] == sep
    if not bool(starts.any()):
        return None
    T = idx.size(1)
    ar = torch.arange(T, device=idx.device)
    first = torch.where(starts, ar, torch.zeros_like(ar)).cummax(dim=1).values  # start of each token's document
    doc = starts.cumsum(dim=1)
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
    return ar - first, mask.unsqueeze(1)


def llama3_scaled(inv_freq: torch.Tensor, sc) -> torch.Tensor:
    """Llama 3's frequency scaling, as transformers' `_compute_llama3_parameters` computes it: long wavelengths
    divided by `factor`, short ones kept, the band between interpolated."""
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's channels; x is (B, H, T, D)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal scaled-dot-product attention of q (B, H, T, D) over k, v (B, H_kv, T, D); H_kv may divide H (GQA).
    `mask` (B, 1, T, T) bool: the block-causal mask of `documents` instead of the causal one (SDPA's fused
    memory-efficient kernel on a GPU takes it; the flash kernel takes only the causal flag)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                              enable_gqa=k.size(1) != q.size(1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          enable_gqa=k.size(1) != q.size(1))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # q, k, v fused in one matmul: rows [q (n_head·hd), k (n_kv_head·hd), v (n_kv_head·hd)]
        self.kv_dim = cfg.kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.n_embd, cfg.n_embd + 2 * self.kv_dim, bias=cfg.qkv_bias)
        self.qkv.fused = 3  # three matrices in one: their fan-out is ~n_embd each (ds_init)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.proj.residual_out = True  # scaled at init under gpt2_scaled
        self.resid_drop = nn.Dropout(cfg.dropout)
        # (q, k, v, dropout_p) -> y, all (B, heads, T, head_dim); sequence parallelism swaps in its all-to-all
        # wrapper (lifecycle.tasks.train.parallel.sp)
        self.attention = causal_attention

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split([C, self.kv_dim, self.kv_dim], dim=2)
        hd, kvh = self.cfg.head_dim, self.cfg.kv_heads
        q = q.view(B, T, self.cfg.n_head, hd).transpose(1, 2)
        k, v = (t.view(B, T, kvh, hd).transpose(1, 2) for t in (k, v))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        drop = self.cfg.dropout if self.training else 0.0
        y = self.attention(q, k, v, drop) if mask is None else self.attention(q, k, v, drop, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.mlp
        hidden = cfg.mlp_hidden
        # SwiGLU: down(silu(gate(x)) * up(x)); the gate and up projections are fused into one matmul.
        self.up = nn.Linear(cfg.n_embd, 2 * hidden if cfg.mlp == "swiglu" else hidden, bias=False)
        self.up.fused = 2 if cfg.mlp == "swiglu" else 1
        self.down = nn.Linear(hidden, cfg.n_embd, bias=False)
        self.down.residual_out = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.drop(self.down(h))


def ds_init_(weight: torch.Tensor, depth: int, fused: int = 1, alpha: float = 1.0) -> None:
    """DS-Init (Zhang et al. 2019, eq. 7): U(-γ, γ), γ = α·sqrt(6 / (d_in + d_out)) / sqrt(depth).
    `fused` matrices stacked along the output dimension each count their own d_out."""
    d_out, d_in = weight.shape[0] // fused, weight.shape[1]
    gamma = alpha * math.sqrt(6.0 / (d_in + d_out)) / math.sqrt(depth)
    nn.init.uniform_(weight, -gamma, gamma)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = make_norm(cfg)
        if cfg.moe is not None and cfg.moe.is_moe_block(index):  # mixture of experts (parallel/moe.py)
            from lifecycle.tasks.train.parallel.moe import MoEMLP

            self.mlp = MoEMLP(cfg, lambda: MLP(cfg))
        else:
            self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, mask)
        return x + self.mlp(self.norm2(x))


def numel(p: torch.Tensor) -> int:
    """Elements of a parameter, also when ZeRO-3 (`deepspeed.zero.Init`) has partitioned it away."""
    return getattr(p, "ds_numel", p.numel())


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
_ATTENTION = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)}


def selective_context():
    """Per-op selective recomputation of one block (torchtitan's policy, torch's selective checkpoint API): the
    attention kernel's outputs and the odd-numbered matmuls of the block's forward are kept, everything else is
    recomputed in backward. Counting restarts with each block (one context per checkpointed call), and the
    recomputation counts apart from the forward, so both number the same matmuls alike."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    seen = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        if op in _ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if op in _MATMULS:
            phase = "recompute" if ctx.is_recompute else "forward"
            seen[phase] += 1
            if seen[phase] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def recompute_fn(mode):
    """The checkpoint function of `train.engine.activation_checkpointing`: whole blocks (true) or per-op
    (`selective`); (fn, *inputs) -> outputs, as DeepSpeed's pipeline engine calls it too."""
    if mode == "selective":
        return partial(checkpoint, use_reentrant=False, context_fn=selective_context)
    return partial(checkpoint, use_reentrant=False)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size is null: fill it from the tokenizer before building the model")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Recompute each block's activations in backward instead of keeping them (set by the train loop from
        # `train.engine.activation_checkpointing`; not a ModelConfig field, since the weights do not depend on it).
        self.activation_checkpointing = False
        # Under sequence parallelism this rank holds slice `seq_shard` of each sequence: its T tokens sit at
        # positions seq_shard·T .. seq_shard·T + T - 1 (lifecycle.tasks.train.parallel.sp); 0 otherwise.
        self.seq_shard = 0
        # End-of-text id for document-aware attention (`cfg.attention: document`): set by the trainer from the
        # token shards; None = causal attention over the whole input (module docstring).
        self.doc_sep: int | None = None
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        if cfg.init == "ds_init":
            for depth, block in enumerate(self.blocks, start=1):
                for m in block.modules():
                    if isinstance(m, nn.Linear):
                        ds_init_(m.weight, depth, getattr(m, "fused", 1))
        elif cfg.init == "tfixup":
            from lifecycle.tasks.train.initialise import tfixup_

            tfixup_(self)

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            std = 0.02
            if self.cfg.init == "gpt2_scaled" and getattr(m, "residual_out", False):
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied matrix counts once). exclude_embeddings drops the token and position
        tables (but keeps an untied output head, which is a real matmul)."""
        n = sum(numel(p) for p in self.parameters())
        if exclude_embeddings:
            n -= numel(self.wte.weight)
            if self.wpe is not None:
                n -= numel(self.wpe.weight)
            if self.cfg.tie_embeddings:
                n += numel(self.lm_head.weight)  # the tied table still does the output matmul
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token: 6·N for the matmuls with N the non-embedding
        parameters plus the output head, and 12·L·d·T for attention scores (PaLM paper, appendix B). In a
        mixture of experts N counts the top_k experts a token goes through, not all of them."""
        T = seq_len or self.cfg.seq_len
        n = self.num_params(exclude_embeddings=True) - sum(m.inactive_params() for m in self.modules()
                                                           if hasattr(m, "inactive_params"))
        return 6 * n + 12 * self.cfg.n_layer * self.cfg.n_embd * T

    def enter_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream as the blocks take it (Megatron sequence parallelism: this rank's slice)."""
        return x

    def leave_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream as the final norm and head take it (whole again)."""
        return x

    def window_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """The token ids of the whole windows `idx` (B, T) belongs to, where `documents` finds the documents: idx
        itself, or under sequence parallelism the sp group's slices gathered (lifecycle.tasks.train.parallel.sp)."""
        return idx

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) int64 with T <= seq_len. Returns (logits (B, T, vocab), mean loss or None).
        Targets equal to -1 are ignored in the loss."""
        B, T = idx.shape
        start = self.seq_shard * T
        if start + T > self.cfg.seq_len:
            raise ValueError(f"sequence length {start + T} exceeds the model's seq_len {self.cfg.seq_len}")
        x = self.wte(idx)
        docs = documents(self.window_ids(idx), self.doc_sep) if self.doc_sep is not None else None
        mask, pos = (None, None) if docs is None else (docs[1], docs[0][:, start:start + T])  # this slice's
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start, start + T, device=idx.device) if pos is None else pos)
        elif pos is None:
            rope = rope_tables(self.cfg, T, idx.device, start)
        else:
            rope = rope_tables_at(self.cfg, pos, docs[0].size(1))
        x = self.enter_blocks(self.drop(x))
        for block in self.blocks:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                # Non-reentrant: works with ZeRO-3's parameter hooks and with inputs that need no grad; the
                # RNG state is stashed and restored, so a recomputed dropout mask equals the first one.
                x = recompute_fn(self.activation_checkpointing)(block, x, rope, mask)
            else:
                x = block(x, rope, mask)
        logits = self.lm_head(self.norm_f(self.leave_blocks(x)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def export_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """fp32 CPU copies of the learned weights, one entry per unique parameter (a tied head is not repeated,
        which is what safetensors wants: it refuses shared tensors). copy=False returns the fp32 parameters
        themselves where they already are fp32 CPU tensors (for a caller that copies them anyway)."""
        state = {name: p.detach().float().cpu() for name, p in self.named_parameters()}
        return {name: t.clone() for name, t in state.items()} if copy else state

    def load_export(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of `export_state`; every parameter must be present (strict), a tied head is re-linked."""
        missing, unexpected = self.load_state_dict(state, strict=False)
        allowed_missing = {"lm_head.weight"} if self.cfg.tie_embeddings else set()
        if unexpected or set(missing) - allowed_missing:
            raise ValueError(f"weights do not match the model: missing={missing} unexpected={unexpected}")

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None):
        """Sample continuations of idx (B, T); the context is cropped to the last seq_len tokens."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.seq_len :])
            logits = logits[:, -1, :] / max(temperature, 1e-6)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx
