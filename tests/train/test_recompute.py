"""Activation recomputation (`train.engine.activation_checkpointing`: false, true, selective): the same gradients
as keeping everything, and what each keeps for backward, counted through autograd's saved-tensor hooks."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lifecycle.tasks.train.config import ModelConfig, TrainConfig
from lifecycle.tasks.train.model import GPT
from lifecycle.tasks.train.parallel.mesh import Layout

CFG = ModelConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=64, seq_len=32, vocab_size=101, mlp="swiglu")


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def _run(mode):
    """(loss, gradients, matmuls run in backward) of one batch under `mode`."""
    torch.manual_seed(0)
    model = GPT(CFG)
    model.train()
    model.activation_checkpointing = mode
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(1))
    _, loss = model(x, x)
    with _CountMatmuls() as count:
        loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, count.n


def test_selective_and_full_recompute_give_the_gradients_of_keeping_everything():
    """Each block has four matmuls (q/k/v, output projection, MLP up, MLP down). Recomputation stops once every
    tensor backward needs is back (torch's non-reentrant checkpoint), and nothing needs the down projection's
    output (the residual add's backward does not), so full recomputation runs three of them again per block and
    selective, which kept q/k/v and up, only the output projection."""
    base_loss, base_grads, base_mm = _run(False)
    extra = {}
    for mode in ("selective", True):
        loss, grads, mm = _run(mode)
        extra[mode] = mm - base_mm
        assert loss == base_loss
        for name, g in grads.items():
            torch.testing.assert_close(g, base_grads[name], rtol=0, atol=1e-6, msg=name)
    assert extra == {"selective": 1 * CFG.n_layer, True: 3 * CFG.n_layer}


@pytest.mark.parametrize("value, recompute, line", [
    (False, "none", "false"), (True, "full", "true"), ("selective", "selective", "selective")])
def test_the_layout_names_the_recompute_mode_and_sets_it_back(value, recompute, line):
    cfg = TrainConfig.model_validate({"engine": {"activation_checkpointing": value}})
    lay = Layout.of(cfg)
    assert lay.recompute == recompute and Layout.from_dict(lay.as_dict()) == lay
    assert f"train.engine.activation_checkpointing={line}" in lay.set_lines()
