"""Muon's state across a layout change (lifecycle.tasks.train.muon_convert): the layout of DeepSpeed's Muon
state (fast), then launched resumes (slow: 2 CPU ranks, gloo): a Muon run committed at step 10 under data
parallelism at ZeRO 1-3, pipeline stages or Ulysses sequence parallelism resumes under another layout (one rank
or two data-parallel ranks at ZeRO 0-2) and follows the uninterrupted one-rank run over steps 11-20 within the
tolerance of the AdamW layout changes (test_layout_change.REL); with the momentum dropped in the conversion it
does not."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train import layout as lay
from lifecycle.tasks.train import muon_convert
from tests.train.test_layout_change import REL
from tests.train.test_parallel_pp import pp_config
from tests.train.test_train import make_tokens

MUON = {"optimizer.name": "muon", "optimizer.muon_lr": 0.02, "optimizer.grad_clip": 0.0}


def test_groups_follow_muon_optimizer_and_deepspeeds_sort():
    shapes = {"wte.weight": (10, 4), "blocks.0.attn.qkv.weight": (12, 4), "blocks.0.norm.weight": (4,),
              "blocks.0.mlp.up.weight": (16, 4), "blocks.1.attn.qkv.weight": (12, 4), "lm_head.weight": (10, 4)}
    assert muon_convert.group_names(list(shapes), shapes) == [
        ["blocks.0.mlp.up.weight", "blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"],  # largest first, stable
        ["wte.weight", "lm_head.weight"], ["blocks.0.norm.weight"]]
    assert muon_convert.group_names(["blocks.0.norm.weight"], shapes) == [["blocks.0.norm.weight"]]


def test_zero12_partition_lists_the_parameters_reaching_into_each_rank():
    """Flat group of 6 + 4 + 6 = 16 elements over 2 ranks (8 each): the 4-element parameter straddles the cut,
    so both ranks hold its whole momentum (stage_1_and_2.py get_partition_info)."""
    assert [muon_convert._zero12_partition(2, [6, 4, 6], [0, 0, 0], d) for d in (0, 1)] == [[0, 1], [1, 2]]
    # 5 + 5 = 10 padded to 12 over 2 ranks (6 each): the second parameter starts in rank 0's partition
    assert [muon_convert._zero12_partition(2, [5, 5], [0, 0], d) for d in (0, 1)] == [[0, 1], [1]]
    assert muon_convert._zero12_partition(1, [5, 5], [0, 0], 0) == [0, 1]


def test_muon_layout_changes_go_to_zero_0_to_2_and_the_rest_are_refused_naming_why():
    two = {"dp": 2, "zero": 1, "micro": 4, "accum": 1}
    one0, one3 = {"dp": 1, "zero": 0, "micro": 4, "accum": 2}, {"dp": 1, "zero": 3, "micro": 4, "accum": 2}
    for zero in (0, 1, 2):
        assert lay.refusal(two, {**one0, "zero": zero}, "muon") is None
        assert lay.refusal({"dp": 1, "zero": 1, "micro": 4, "accum": 2, "pp": 2}, {**two, "zero": zero}, "muon") is None
    why = lay.refusal(two, one3, "muon")
    assert "muon: writes ZeRO-0 (MuonWithAuxAdam's torch state dict) or ZeRO-1/2" in why and "pipeline-replicas" in why
    assert "deepspeed-universal" not in why  # Adam's converters are not tried: they would drop the momentum
    assert "sequence-parallel destination" in lay.refusal(two, {**one0, "dp": 1, "accum": 1, "sp": 2}, "muon")
    assert "global batch" in lay.refusal(two, {**one0, "accum": 1}, "muon")


def test_a_muon_layout_change_no_converter_takes_is_refused_before_any_sibling_is_touched(tmp_path):
    from lifecycle.tasks.train.config import TrainConfig
    from lifecycle.tasks.train.launch import _resume_other_layout

    cfg = TrainConfig.model_validate({"optimizer": {"name": "muon", "grad_clip": 0.0}, "batch": {"num_ranks": 1},
                                      "engine": {"zero_stage": 3}})
    src = lay.Sibling(tmp_path / "o", {"dp": 2, "zero": 2, "micro": 16, "accum": 1}, tmp_path / "o" / "step_00000020", 32)
    with pytest.raises(ValueError, match=r"no converter carries Muon's state to layout dp=1,zero=3.*muon: writes "
                                         r"ZeRO-0 .*resume_across_layouts: false"):
        _resume_other_layout([src], tmp_path / "ckpt", cfg, tmp_path / "run")
    assert not (tmp_path / "ckpt").exists()
    # with experts (even at ep=1, where the layouts look dense) the Muon converter is not tried
    moe = TrainConfig.model_validate({"optimizer": {"name": "muon", "grad_clip": 0.0}, "batch": {"num_ranks": 1},
                                      "engine": {"zero_stage": 0}, "moe": {"num_experts": 2}})
    with pytest.raises(ValueError, match=r"to layout dp=1,zero=0,micro=16,accum=1 .a run with experts: the Muon converter does not "
                                         r"carry the experts' state"):
        _resume_other_layout([src], tmp_path / "ckpt", moe, tmp_path / "run")
    assert not (tmp_path / "ckpt").exists()


# --------------------------------------------------------------------------------------------------
# slow: launched


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_tokens(tmp_path_factory.mktemp("tokens"), 600)


ONE = {"ranks": 1, "pp": 1, "zero": 0}  # the reference: one rank, ZeRO-0 (global batch 8 = micro 4 x accum 2)
DP2 = {"ranks": 2, "pp": 1, "batch.grad_accum": 1}
CASES = {"dp2-zero1->one-zero0": ({**DP2, "zero": 1}, ONE),
         "dp2-zero3->one-zero0": ({**DP2, "zero": 3}, ONE),
         "pp2-zero1->one-zero0": ({"ranks": 2, "pp": 2, "zero": 1}, ONE),
         "sp2-zero1->one-zero0": ({"ranks": 2, "pp": 1, "zero": 1, "parallel.sp": 2}, ONE),
         "dp2-zero2->one-zero1": ({**DP2, "zero": 2}, {**ONE, "zero": 1}),
         "dp2-zero3->one-zero2": ({**DP2, "zero": 3}, {**ONE, "zero": 2}),
         "pp2-zero1->dp2-zero2": ({"ranks": 2, "pp": 2, "zero": 1}, {**DP2, "zero": 2})}
"""(layout A, layout B): a run under A commits step 10, the same run goes on under B."""


def _losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(path)) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def one_rank(tokens, tmp_path_factory):
    """The uninterrupted 20 steps of layout B."""
    from lifecycle.tasks.train.launch import run_train

    return _losses(run_train(tokens, pp_config(**ONE, **MUON), str(tmp_path_factory.mktemp("one"))).metrics_path)


def _worst(got: dict[int, float], ref: dict[int, float]) -> float:
    assert sorted(got) == list(range(11, 21))  # the converted commit's curve starts after step 10
    return max(abs(got[s] - ref[s]) / abs(ref[s]) for s in got)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_muon_resumes_under_another_layout_and_follows_the_one_rank_curve(tokens, one_rank, tmp_path, name,
                                                                          monkeypatch):
    from lifecycle.tasks.train.launch import run_train

    src, dst = CASES[name]
    first = run_train(tokens, pp_config(**{**MUON, **src, "max_steps": 10}), str(tmp_path / "w"))
    assert first.steps == 10
    if name == "dp2-zero1->one-zero0":
        shutil.copytree(tmp_path / "w", tmp_path / "dropped")
    rest = run_train(tokens, pp_config(**dst, **MUON), str(tmp_path / "w"))
    assert rest.resumed_from == 10 and rest.steps == 20 and rest.layout_change.endswith("at step 10")
    marker = ckpt.read_marker(Path(rest.run_dir) / "checkpoints" / ckpt.tag_name(10))
    assert marker["converter"] == "muon" and marker["format"] == "deepspeed"
    worst = _worst(_losses(rest.metrics_path), one_rank)
    print(f"Muon {name} at step 10: max relative loss difference to one rank {worst:.2e} over steps 11-20")
    assert worst <= REL
    if name != "dp2-zero1->one-zero0":
        return
    read = muon_convert.read_state

    def without_momentum(*args):
        state, stages = read(*args)
        return {n: {k: torch.zeros_like(v) if k == "momentum_buffer" else v for k, v in s.items()}
                for n, s in state.items()}, stages

    monkeypatch.setattr(muon_convert, "read_state", without_momentum)
    dropped = run_train(tokens, pp_config(**dst, **MUON), str(tmp_path / "dropped"))
    lost = _worst(_losses(dropped.metrics_path), one_rank)
    print(f"the same with Muon's momentum dropped: {lost:.2e}")
    assert lost > 10 * REL
