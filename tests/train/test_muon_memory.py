"""The planner's memory under Muon (train.optimizer.name: muon; zero_memory.muon_states / muon_buffers), against
the formulas and (slow) against what DeepSpeed's engine holds on 2 CPU ranks (bench.zero_states)."""

import pytest

from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.parallel.mesh import Layout
from lifecycle.tasks.train.planner import memory, parse_model
from lifecycle.tasks.train.sizing import muon_numels, muon_params, param_count
from lifecycle.tasks.train.zero_memory import (MUON_GATHER_CACHE, MUON_GATHER_ENTRY, PRECISIONS, muon_buffers,
                                               muon_gather_cache, muon_tp_gather, model_states)

BF16, FP32 = PRECISIONS["bf16"], PRECISIONS["fp32"]


@pytest.mark.parametrize("zero, per_muon_param", [(0, 4 + 4), (1, (4 + 2 * 2) / 8), (2, (4 + 2 * 2) / 8),
                                                   (3, (4 + 2) / 8)])
def test_muon_keeps_one_momentum_where_adamw_keeps_two_moments(zero, per_muon_param):
    psi, mu = 1e9, 6e8
    adamw = model_states(psi, zero, 8, BF16)["optimizer"]
    muon = model_states(psi, zero, 8, BF16, muon=mu)["optimizer"]
    assert muon == pytest.approx(adamw * (psi - mu) / psi + per_muon_param * mu)
    assert muon < adamw


def test_zero3_gather_cache_is_one_entry_per_matrix_size_and_capped():
    assert muon_gather_cache([100, 100, 300], 2) == (3 * 50 + 3 * 150) * 4
    assert muon_gather_cache([10**9], 8) == MUON_GATHER_ENTRY
    assert muon_gather_cache([10**9 + i for i in range(9)], 8) == MUON_GATHER_CACHE
    assert muon_buffers([100], 2, 2, BF16, 1000, 100) == {"gather_cache": 0.0, "whole_grads": 2 * 500,
                                                          "step_grads_not_made": 0.0, "tp_gather": 0.0}
    assert muon_buffers([100], 3, 2, BF16, 1000, 0)["gather_cache"] == 0  # no Muon, no buffers


def test_planner_counts_muon_for_the_blocks_matrices_only():
    m = ModelConfig(vocab_size=32000, n_layer=8, n_embd=1024, n_head=8, seq_len=512)
    lay = Layout(dp=8, zero=1, micro_batch=1)
    adamw, muon = memory(m, lay, "bf16"), memory(m, lay, "bf16", optimizer="muon")
    share = muon_params(m) / param_count(m).total
    saved = adamw.breakdown["optimizer_bytes"] - muon.breakdown["optimizer_bytes"]
    assert saved == pytest.approx(param_count(m).total * share * (12 - 8) / 8)
    assert muon.total_bytes < adamw.total_bytes


@pytest.mark.parametrize("zero, elem", [(1, 2), (2, 2), (0, 4)])
def test_tensor_parallel_muon_gathers_the_largest_matrix_gradient_and_momentum_in_the_step(zero, elem):
    """muon_tp all-gathers one whole matrix's gradient and momentum at a time, in the gradients' dtype at ZeRO-1/2
    and fp32 at ZeRO-0: the step's buffers grow by that, backward's and the states do not; no tp, nothing."""
    m = ModelConfig(vocab_size=32000, n_layer=8, n_embd=1024, n_head=8, seq_len=512)  # largest: the MLP's up (gate|up)
    largest = max(muon_numels(m))
    assert largest == 2 * m.mlp_hidden * m.n_embd if m.mlp == "swiglu" else m.mlp_hidden * m.n_embd
    assert muon_tp_gather(muon_numels(m), 2, zero, BF16) == 2 * largest * elem
    assert muon_tp_gather(muon_numels(m), 1, zero, BF16) == 0 == muon_tp_gather([], 2, zero, BF16)
    lay = Layout(dp=4, tp=2, pp=1 if zero else 2, zero=zero, micro_batch=1)
    adamw, muon = memory(m, lay, "bf16"), memory(m, lay, "bf16", optimizer="muon")
    assert muon.breakdown["muon_tp_gather_bytes"] == 2 * largest * elem
    assert adamw.breakdown["muon_tp_gather_bytes"] == 0
    one = memory(m, Layout(dp=8, zero=zero, micro_batch=1, pp=1 if zero else 2), "bf16", optimizer="muon")
    assert one.breakdown["muon_tp_gather_bytes"] == 0


def test_the_search_proposes_tensor_parallel_layouts_for_muon():
    """tp (ZeRO-1/2, and tp × pp at ZeRO-0/1) runs Muon (muon_tp), so the search considers it, at the cost of
    its gather; `lifecycle plan layout --model llama3.1-8b --gpus 16 --gpu-memory 80GiB --global-batch 64
    --optimizer muon` among its fitting options."""
    from lifecycle.tasks.train.layout_search import search

    opts = search(parse_model("llama3.1-8b"), 16, 80 * 2**30, 64, optimizer="muon")
    tp = [o for o in opts if o.fits and o.layout.tp > 1]
    assert tp and any(o.layout.pp > 1 for o in tp)
    assert all(o.memory.breakdown["muon_tp_gather_bytes"] > 0 for o in tp)


@pytest.mark.slow  # 2 ranks of DeepSpeed per layout: about half a minute each
@pytest.mark.parametrize("zero, prec", [(0, "fp32-muon"), (2, "fp32-muon"), (3, "bf16-muon"), (1, "bf16-muon")])
def test_muon_formulas_match_what_deepspeed_allocates(zero, prec):
    """Within 5 % below the peak over both ranks (the rank whose partition a Muon matrix straddles holds it
    whole, as DeepSpeed's muon_copy_ranks does: not counted). fp32 ZeRO-3 peaks at the end of backward with the
    parameters gathered for it, a term of the planner's own (zero3_gathered_bytes), not of these formulas."""
    from bench.zero_states import LAYOUTS, main

    (row,) = main(only=[LAYOUTS.index((zero, prec))])
    assert 0.95 <= row["new_ratio"] <= 1.01


def test_a_layout_change_under_muon_is_refused_before_any_conversion(tmp_path):
    """No converter carries Muon's momentum: resuming a sibling layout's commit is refused, naming it."""
    from lifecycle.tasks.train.config import TrainConfig
    from lifecycle.tasks.train.launch import _resume_other_layout
    from lifecycle.tasks.train.layout import Sibling

    cfg = TrainConfig.model_validate({"optimizer": {"name": "muon", "grad_clip": 0.0}, "batch": {"num_ranks": 1}})
    src = Sibling(tmp_path / "other", {"dp": 2, "zero": 2, "micro": 16, "accum": 1}, tmp_path / "other" / "step_00000020", 32)
    with pytest.raises(ValueError, match=r"optimizer.name=muon: .* committed step 20 .*resume_across_layouts"):
        _resume_other_layout([src], tmp_path / "ckpt", cfg, tmp_path / "run")
    assert not (tmp_path / "ckpt").exists()
