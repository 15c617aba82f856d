"""T-Fixup (Huang et al. 2020, "Improving Transformer Optimization Through Better Initialization", sec. 3.3): the
initialisation that lets a Transformer train without layer normalisation and without learning-rate warmup.

Its decoder rule, applied to our decoder-only model (`ModelConfig.init: tfixup`, with `norm: none`):
1. every matrix Xavier-uniform; the fused ones (q, k, v in `attn.qkv`; SwiGLU's gate and up in `mlp.up`) each
   part apart, as the paper's separate matrices; biases zero;
2. the input embeddings (and learned positions) N(0, d^-1/2), d = n_embd;
3. the value projection, the attention output projection, every MLP matrix and the embeddings scaled by
   (9·N)^-1/4, N = n_layer (queries and keys keep their Xavier scale).
A tied output head is the embedding table, so it carries the embedding's scale.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from lifecycle.tasks.train.model_config import ModelConfig


def _xavier_parts_(weight: torch.Tensor, sizes: list[int]) -> None:
    """Xavier-uniform over each block of rows of `weight` (a fused matrix), each with its own fan-out."""
    for part in weight.split(sizes, dim=0):
        nn.init.xavier_uniform_(part)


@torch.no_grad()
def tfixup_(model: nn.Module) -> None:
    """Initialise a GPT (lifecycle.tasks.train.model.GPT) in place by T-Fixup's decoder rule (module docstring)."""
    cfg = cast(ModelConfig, model.cfg)
    scale = tfixup_scale(cfg.n_layer)
    for table in (model.wte, model.wpe):
        if table is not None:
            nn.init.normal_(table.weight, mean=0.0, std=cfg.n_embd ** -0.5)
            table.weight.mul_(scale)
    kv = cfg.kv_heads * cfg.head_dim
    for block in model.blocks:
        qkv = block.attn.qkv
        _xavier_parts_(qkv.weight, [cfg.n_embd, kv, kv])
        qkv.weight[cfg.n_embd + kv:].mul_(scale)  # the values
        nn.init.xavier_uniform_(block.attn.proj.weight)
        block.attn.proj.weight.mul_(scale)
        for name, linear in block.mlp.named_modules():
            if not isinstance(linear, nn.Linear) or name == "gate":  # an MoE block's router keeps its own init
                continue
            fused = getattr(linear, "fused", 1)
            _xavier_parts_(linear.weight, [linear.weight.shape[0] // fused] * fused)
            linear.weight.mul_(scale)
        for m in block.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
    if not cfg.tie_embeddings:
        nn.init.xavier_uniform_(model.lm_head.weight)


def tfixup_scale(n_layer: int) -> float:
    """(9·N)^-1/4: T-Fixup's factor for a decoder of N blocks."""
    return math.pow(9 * n_layer, -0.25)
