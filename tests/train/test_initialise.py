"""T-Fixup (ModelConfig.init: tfixup with norm: none; lifecycle.tasks.train.initialise)."""

import math

import pytest
import torch

from lifecycle.tasks.train import sizing
from lifecycle.tasks.train.initialise import tfixup_scale
from lifecycle.tasks.train.model import GPT
from lifecycle.tasks.train.model_config import ModelConfig


def tfixup(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=300, n_layer=4, n_embd=64, n_head=4, seq_len=32, init="tfixup", norm="none", **kw)


@pytest.mark.parametrize("kw", [{}, {"mlp": "gelu", "pos": "learned", "tie_embeddings": False}, {"n_kv_head": 2}])
def test_no_norm_parameters_and_exact_count(kw):
    cfg = tfixup(**kw)
    model = GPT(cfg)
    names = {n: p.numel() for n, p in model.named_parameters()}
    assert not [n for n in names if "norm" in n]
    assert names == sizing.tensors(cfg)


def test_scales_values_output_mlp_and_embeddings_not_queries_or_keys():
    torch.manual_seed(0)
    cfg = tfixup()
    model, d, s = GPT(cfg), cfg.n_embd, tfixup_scale(cfg.n_layer)
    xavier = math.sqrt(6 / (d + d))  # the bound of a d x d Xavier-uniform matrix
    qkv = model.blocks[0].attn.qkv.weight
    q, k, v = qkv[:d], qkv[d:2 * d], qkv[2 * d:]
    for part, bound in ((q, xavier), (k, xavier), (v, xavier * s), (model.blocks[0].attn.proj.weight, xavier * s)):
        assert part.abs().max() <= bound
        assert part.abs().max() > 0.95 * bound  # drawn over the whole range, not a smaller one
    assert model.wte.weight.std().item() == pytest.approx(d ** -0.5 * s, rel=0.05)
    up = model.blocks[0].mlp.up.weight  # SwiGLU's gate and up, each d_out = hidden
    hidden = cfg.mlp_hidden
    assert up.abs().max() <= math.sqrt(6 / (d + hidden)) * s


@pytest.mark.parametrize("kw", [{"init": "tfixup"}, {"norm": "none"}])
def test_tfixup_and_no_norm_go_together(kw):
    with pytest.raises(ValueError, match="T-Fixup"):
        ModelConfig(vocab_size=300, **kw)


def test_trains_without_warmup_or_norms():
    """Full learning rate from the first step, no norm anywhere: the loss on a fixed batch falls steadily."""
    torch.manual_seed(0)
    model = GPT(tfixup())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 300, (4, 32))
    losses = []
    for _ in range(30):
        loss = model(x[:, :-1], x[:, 1:])[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.7 * losses[0]


def test_no_norms_under_megatron_sequence_parallelism_is_refused():
    from lifecycle.tasks.train.config import TrainConfig

    model = {"init": "tfixup", "norm": "none"}
    with pytest.raises(ValueError, match="norm=none with train.parallel.tp_sequence_parallel"):
        TrainConfig.model_validate({"model": model, "batch": {"num_ranks": 2},
                                    "parallel": {"tp": 2, "tp_sequence_parallel": True}})
    assert TrainConfig.model_validate({"model": model, "batch": {"num_ranks": 2}, "parallel": {"tp": 2}})
