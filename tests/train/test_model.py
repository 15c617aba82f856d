import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lifecycle.tasks.train.model import GPT, ModelConfig

V = 97


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": V, "n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 16, **kw})


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_forward_shapes_loss_and_causality(norm, mlp, pos):
    torch.manual_seed(0)
    model = GPT(tiny(norm=norm, mlp=mlp, pos=pos, tie_embeddings=False)).eval()
    idx = torch.randint(0, V, (3, 16))
    logits, loss = model(idx, idx.roll(-1, dims=1))
    assert logits.shape == (3, 16, V)
    assert abs(loss.item() - math.log(V)) < 0.3  # near-uniform predictions at init
    assert model(idx)[1] is None
    # causal: changing the last token leaves every earlier position's logits unchanged
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % V
    logits2, _ = model(idx2)
    torch.testing.assert_close(logits[:, :-1], logits2[:, :-1])
    assert not torch.allclose(logits[:, -1], logits2[:, -1])


def test_position_information_is_used():
    # With position information, the same token at two positions gets different outputs (after attention).
    for pos in ("rope", "learned"):
        torch.manual_seed(0)
        model = GPT(tiny(pos=pos)).eval()
        logits, _ = model(torch.tensor([[5, 7, 5, 7]]))
        assert not torch.allclose(logits[0, 1], logits[0, 3])


def test_loss_ignores_minus_one_and_rejects_long_input():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, V, (2, 8))
    tgt = torch.randint(0, V, (2, 8))
    masked = tgt.clone()
    masked[:, 4:] = -1
    logits, loss = model(idx, masked)
    expected = torch.nn.functional.cross_entropy(logits[:, :4].reshape(-1, V), tgt[:, :4].reshape(-1))
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_params_tying_and_flops():
    tied, untied = GPT(tiny()), GPT(tiny(tie_embeddings=False))
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.num_params() - tied.num_params() == V * 32
    assert tied.num_params(exclude_embeddings=True) == untied.num_params(exclude_embeddings=True)
    learned = GPT(tiny(pos="learned"))
    assert learned.num_params() - tied.num_params() == 16 * 32  # the position table
    n = tied.num_params(exclude_embeddings=True)
    assert tied.flops_per_token() == 6 * n + 12 * 2 * 32 * 16
    # SwiGLU hidden width keeps the MLP close to GELU's 4x parameter count
    swi, gelu = GPT(tiny(n_embd=96, n_head=2)), GPT(tiny(n_embd=96, n_head=2, mlp="gelu"))
    ratio = sum(p.numel() for p in swi.blocks[0].mlp.parameters()) / sum(p.numel() for p in gelu.blocks[0].mlp.parameters())
    assert 0.95 < ratio < 1.1


def test_init_schemes():
    torch.manual_seed(0)
    scaled = GPT(tiny(n_layer=8, n_embd=128))
    torch.manual_seed(0)
    normal = GPT(tiny(n_layer=8, n_embd=128, init="normal"))
    assert abs(normal.blocks[0].attn.proj.weight.std().item() - 0.02) < 0.002
    assert abs(scaled.blocks[0].attn.proj.weight.std().item() - 0.02 / math.sqrt(16)) < 0.001
    assert abs(scaled.blocks[0].attn.qkv.weight.std().item() - 0.02) < 0.002


def test_export_round_trip_and_training_step():
    torch.manual_seed(0)
    model = GPT(tiny(dropout=0.1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, V, (4, 16))
    losses = []
    for _ in range(20):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # it can fit a fixed batch
    state = model.export_state()
    assert "lm_head.weight" not in state and all(t.dtype == torch.float32 for t in state.values())
    clone = GPT(model.cfg)
    clone.load_export(state)
    model.eval(), clone.eval()
    torch.testing.assert_close(model(idx)[0], clone(idx)[0])
    with pytest.raises(ValueError, match="missing"):
        GPT(model.cfg).load_export({k: v for k, v in state.items() if k != "norm_f.weight"})


def test_generate_extends_and_crops_context():
    torch.manual_seed(0)
    out = GPT(tiny()).eval().generate(torch.zeros(2, 10, dtype=torch.long), max_new_tokens=12, top_k=5)
    assert out.shape == (2, 22) and int(out.max()) < V


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="even head dim"):
        ModelConfig(n_embd=12, n_head=4)
    assert ModelConfig(n_embd=12, n_head=4, pos="learned").head_dim == 3
    with pytest.raises(ValueError, match="vocab_size is null"):
        GPT(ModelConfig())
    with pytest.raises(ValueError):
        ModelConfig(mlp="relu")


def test_configs_import_without_torch():
    code = "import sys, lifecycle.tasks.train.launch, lifecycle.tasks.eval.evaluate.stage, lifecycle.tasks.data.tokenize.stage, lifecycle.tasks.train.commit; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "False"


def test_ds_init_scales_each_block_by_its_depth():
    torch.manual_seed(0)
    d, layers = 128, 8
    model = GPT(tiny(n_layer=layers, n_embd=d, n_head=4, init="ds_init"))
    hidden = model.cfg.mlp_hidden
    for depth, block in enumerate(model.blocks, start=1):
        # U(-γ, γ) has std γ/sqrt(3); γ = sqrt(6/(d_in+d_out))/sqrt(depth)
        for w, d_in, d_out in ((block.attn.qkv.weight, d, d), (block.attn.proj.weight, d, d),
                               (block.mlp.up.weight, d, hidden), (block.mlp.down.weight, hidden, d)):
            gamma = math.sqrt(6 / (d_in + d_out)) / math.sqrt(depth)
            assert w.abs().max().item() <= gamma
            assert abs(w.std().item() - gamma / math.sqrt(3)) < 0.05 * gamma
    assert abs(model.wte.weight.std().item() - 0.02) < 0.002  # embeddings keep N(0, 0.02)
    # deeper blocks start smaller: the scheme's point
    assert model.blocks[-1].mlp.down.weight.std() < 0.5 * model.blocks[0].mlp.down.weight.std()


def test_plan_param_count_matches_the_model():
    from lifecycle.tasks.train.sizing import flops_per_token, non_embedding_params

    for kw in ({}, {"mlp": "gelu", "norm": "layernorm", "pos": "learned"}, {"tie_embeddings": False}):
        cfg = tiny(**kw)
        model = GPT(cfg)
        assert non_embedding_params(cfg) == model.num_params(exclude_embeddings=True)
        assert flops_per_token(cfg) == model.flops_per_token()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_recomputes_blocks_with_the_same_gradients(dropout):
    """fp32: the gradients with per-block recomputation equal those without (dropout masks replay too),
    and the blocks really run twice (forward, then again in backward)."""
    idx = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(1))
    grads, calls = [], []
    for on in (False, True):
        torch.manual_seed(0)
        model = GPT(tiny(n_layer=3, dropout=dropout))
        model.activation_checkpointing = on
        n = [0]
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))  # recompute stops early: no post-hook
        torch.manual_seed(5)  # same dropout stream for both
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        calls.append(n[0])
    assert calls == [3, 6]
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-5, atol=1e-7, msg=k)
    assert any(g.abs().sum() > 0 for g in grads[1].values())
    # eval / no_grad forward does not recompute anything
    with torch.no_grad():
        model(idx)
    assert n[0] == 6 + 3
