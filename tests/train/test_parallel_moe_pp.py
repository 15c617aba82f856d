"""Mixture of experts with pipeline stages (lifecycle.tasks.train.parallel.moe under parallel.pp).

Fast: the layout composes (and the planner keeps it), what stays refused, and the balancing loss carried into
backward (moe.AuxLossCarrier) as gradient. Slow, launched (CPU ranks, gloo, through run_train): MoE ep2 with pp2
(4 ranks: pp2 × dp2, each stage's two dp ranks one expert-parallel group) against one rank holding every expert
over 20 steps on the same global batches, the same over pp2 × dp4 (8 ranks: expert-data-parallel groups of two
inside each stage), exact resume after SIGKILL (tests/train/sigkill.py), and the step-10 commits of ep2 × pp2
(ZeRO-1) and pp2 (ZeRO-0) resumed on one rank (pipeline-to-dense, parallel.moe_convert).
"""

from __future__ import annotations

import pytest
import torch

from lifecycle.tasks.train.config import ModelConfig, MoEArch, TrainConfig
from lifecycle.tasks.train.parallel.mesh import Layout
from tests.train.test_parallel_pp import _max_rel, _records, pp_config

MOE = {"moe.num_experts": 4, "moe.top_k": 2, "moe.capacity_factor": 1.0, "moe.aux_loss_weight": 0.01}

# --------------------------------------------------------------------------------------------------
# config and the carrier


def test_experts_compose_with_pipeline_stages_and_the_planner_keeps_them():
    from lifecycle.tasks.train.layout_search import trainer_refusal

    cfg = moe_pp_config(ep=2)
    assert cfg.dp == 2 and cfg.global_batch == 16
    assert Layout.of(cfg).describe() == "dp=2,zero=1,micro=4,accum=2,pp=2,ep=2"
    m = ModelConfig(n_layer=4, n_head=4, n_embd=64, seq_len=64, moe=MoEArch(num_experts=4, top_k=2))
    assert trainer_refusal(m, tp=1, pp=2, sp=1, zero=1, recompute="none") is None
    assert "not tp-sharded" in trainer_refusal(m, tp=2, pp=2, sp=1, zero=1, recompute="none")


@pytest.mark.parametrize("changes, message", [
    ({"engine.zero_stage": 2}, "DeepSpeed's pipeline engine runs ZeRO-0 and"),
    ({"moe.ep": 4}, r"must divide the data-parallel degree \(2\)"),
    ({"engine.activation_checkpointing": True}, "load-balancing loss"),
])
def test_what_experts_with_stages_cannot_compute_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        moe_pp_config(ep=2, **changes)


def test_the_carrier_returns_the_output_and_gives_the_balancing_loss_its_gradient():
    """Backward through the carrier equals backward of (output-side loss) + scale × aux: the stage's balancing loss
    reaches its router without being passed to the next stage."""
    from lifecycle.tasks.train.parallel.moe import AuxLossCarrier

    torch.manual_seed(0)
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(16, 8)

    def parts(w):
        logits = x @ w
        aux = logits.softmax(-1).square().sum()
        return torch.tanh(logits), aux

    out, aux = parts(w)
    carried = AuxLossCarrier.apply(out, aux, 0.25)
    assert torch.equal(carried, out)
    carried.sum().backward()
    got, w.grad = w.grad.clone(), None
    out, aux = parts(w)
    (out.sum() + 0.25 * aux).backward()
    assert torch.allclose(got, w.grad, rtol=1e-6, atol=1e-7) and not torch.allclose(got, 0 * got)


def test_pipeline_to_dense_takes_expert_checkpoints_to_one_rank_only():
    """ep2 × pp2 (ZeRO-1) and pp2 (ZeRO-0) convert to one rank holding every expert (ep = 1); a destination that
    splits the experts again (ep = 2) is refused with the reason."""
    from lifecycle.tasks.train.parallel import pp_convert

    one = {"dp": 1, "zero": 0, "micro": 4, "accum": 4}
    assert pp_convert.dense_reason({"dp": 2, "zero": 1, "micro": 4, "accum": 2, "pp": 2, "ep": 2}, one) is None
    assert pp_convert.dense_reason({"dp": 1, "zero": 0, "micro": 4, "accum": 4, "pp": 2}, one) is None
    why = pp_convert.dense_reason({"dp": 2, "zero": 1, "micro": 4, "accum": 2, "pp": 2, "ep": 2},
                                  {"dp": 2, "zero": 0, "micro": 4, "accum": 2, "ep": 2})
    assert "ep = 1" in why


def test_deepspeed_expert_names_map_to_the_dense_models_and_back():
    """A stage's local expert i of expert-parallel rank r is global expert r·L + i under GPT's names; the
    single-rank engine's names (ep = 1) are DeepSpeed's with the global id, the router under `gate.wg`."""
    from lifecycle.tasks.train.parallel.moe_convert import dense_name, ds_name, expert_id

    local = "blocks.1.mlp.deepspeed_moe.experts.deepspeed_experts.1.up.weight"
    assert dense_name(local, 1, 2) == "blocks.1.mlp.experts.3.up.weight"
    assert ds_name("blocks.1.mlp.experts.3.up.weight") == local.replace(".1.up", ".3.up")
    assert dense_name("blocks.0.mlp.deepspeed_moe.gate.wg.weight", 1, 2) == "blocks.0.mlp.gate.weight"
    assert ds_name("blocks.0.mlp.gate.weight") == "blocks.0.mlp.deepspeed_moe.gate.wg.weight"
    assert ds_name("blocks.0.mlp.up.weight") == "blocks.0.mlp.up.weight" and expert_id("blocks.0.mlp.up.weight") is None


# --------------------------------------------------------------------------------------------------
# launched


def moe_pp_config(ranks: int = 4, pp: int = 2, ep: int = 1, **changes) -> TrainConfig:
    """pp_config's tiny model (2 blocks: one a stage) with 4 experts top-2 in every block, capacity factor 1
    (routes are dropped), global batch 16 = micro 4 × grad_accum (4 / dp) × dp: `ranks=1, pp=1` is the
    single-rank run over the same micro-batches (the same token groups for the router's capacity)."""
    dp = ranks // pp
    return pp_config(ranks=ranks, pp=pp, **{**MOE, "moe.ep": ep, "batch.grad_accum": 4 // dp, **changes})


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.train.test_train import make_tokens

    return make_tokens(tmp_path_factory.mktemp("tokens"), 600)


@pytest.fixture(scope="module")
def runs(tokens, tmp_path_factory):
    from lifecycle.tasks.train.launch import run_train

    root = tmp_path_factory.mktemp("runs")
    return {"one": run_train(tokens, moe_pp_config(ranks=1, pp=1), str(root / "one")),
            "ep2pp2": run_train(tokens, moe_pp_config(ep=2), str(root / "ep2pp2"))}


@pytest.mark.slow  # two launches, 1 and 4 ranks
def test_ep2_pp2_trains_the_single_rank_curve_with_each_stages_balancing_loss(runs):
    """Same initial weights and global batches; each stage's MoE layer carries its balancing loss into backward
    (without it the curves part by ~5e-3 in 20 steps). The logged loss is the LM loss, as on one rank, and the
    logged balancing loss (summed over the stages' layers, mean over dp) and the dropped routes are the single
    rank's; the consolidated checkpoint holds every expert under the dense names."""
    from safetensors.torch import load_file

    one, pipe = (_records(runs[k].metrics_path, "train") for k in ("one", "ep2pp2"))
    rel = _max_rel([r["loss"] for r in pipe], [r["loss"] for r in one])
    print(f"MoE ep2 x pp2 (4 ranks) vs single rank, 20 steps: max relative loss difference {rel:.3g}")
    assert len(pipe) == 20 and pipe[-1]["loss"] < 0.8 * pipe[0]["loss"] and rel <= 1e-5
    assert _max_rel([r["moe_aux_loss"] for r in pipe], [r["moe_aux_loss"] for r in one]) <= 1e-5
    assert [r["moe_dropped_per_expert"] for r in pipe] == [r["moe_dropped_per_expert"] for r in one]
    assert sum(r["moe_dropped"] for r in pipe) > 0
    a, b = (load_file(f"{runs[k].checkpoint_dir}/model.safetensors") for k in ("one", "ep2pp2"))
    assert sorted(a) == sorted(b) and "blocks.1.mlp.experts.3.up.weight" in b
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


@pytest.mark.slow  # one launch of 8 ranks
def test_ep2_over_pp2_dp4_reduces_expert_gradients_over_the_expert_data_group(runs, tokens, tmp_path):
    """pp2 × dp4 with ep2 (8 ranks): each stage's four dp ranks form two expert-parallel groups, so each expert has
    two copies, averaged over its expert-data-parallel group inside the stage (ranks 0,2 / 1,3 of it, checked by
    moe.ep_group against the grid), never across stages: still the single-rank curve (grad_accum 1 here)."""
    from lifecycle.tasks.train.launch import run_train

    r = run_train(tokens, moe_pp_config(ranks=8, ep=2), str(tmp_path))
    one, pipe = (_records(path, "train") for path in (runs["one"].metrics_path, r.metrics_path))
    rel = _max_rel([x["loss"] for x in pipe], [x["loss"] for x in one])
    print(f"MoE ep2 over pp2 x dp4 (8 ranks) vs single rank, 20 steps: max relative loss difference {rel:.3g}")
    assert len(pipe) == 20 and rel <= 1e-5


@pytest.mark.slow  # two launches, 1 and 2 ranks
def test_replicated_experts_in_pipeline_stages_under_zero0_match_the_single_rank_run(tokens, tmp_path):
    """pp2 under ZeRO-0 (ep1, clipping on): DeepSpeed's clip_grad_norm_ sums over the stages the parameters marked
    model-parallel, so each stage's experts and router are marked (Parallelism.wrap_model) as its blocks are."""
    from lifecycle.tasks.train.launch import run_train

    one = run_train(tokens, moe_pp_config(ranks=1, pp=1, zero=0), str(tmp_path / "one"))
    two = run_train(tokens, moe_pp_config(ranks=2, pp=2, zero=0), str(tmp_path / "two"))
    rel = _max_rel(*([x["loss"] for x in _records(r.metrics_path, "train")] for r in (two, one)))
    print(f"MoE pp2 ZeRO-0 (2 ranks) vs single rank, 20 steps: max relative loss difference {rel:.3g}")
    assert rel <= 1e-5


@pytest.mark.slow  # two launches of 4 ranks
def test_ep2_pp2_resumes_exactly_after_a_sigkill(runs, tmp_path):
    """SIGKILL the supervisor and the four ranks after the step-10 commit, rerun: every loss and the final weights
    are the uninterrupted run's, bit for bit (DeepSpeed's MoE files per stage: a module file and one per expert)."""
    from tests.train.sigkill import resumes_exactly

    resumes_exactly(tmp_path, "tests.train.test_parallel_moe_pp:moe_pp_config", {"ep": 2}, runs["ep2pp2"])


@pytest.mark.slow  # four launches: 4 and 1 ranks, 2 and 1
@pytest.mark.parametrize("source", [{"ep": 2}, {"ranks": 2, "zero": 0}], ids=["ep2pp2-zero1", "pp2-zero0"])
def test_a_pipeline_checkpoint_with_experts_resumes_on_one_rank(runs, tokens, tmp_path, source):
    """pp2 with experts -> one rank holding every expert, found by run_train itself: the pipeline run stops at step
    10; a single-rank ZeRO-0 run of the same trajectory converts that commit (pipeline-to-dense: each stage's
    shared weights and every expert's, from the ZeRO-1 partitions of each expert-parallel rank or the ZeRO-0
    per-rank optimizer files, Adam moments and step, into DeepSpeed's single-rank MoE files) and continues: steps
    11-20 follow the single-rank curve, balancing loss and dropped routes included."""
    from lifecycle.tasks.train.launch import run_train

    run_train(tokens, moe_pp_config(max_steps=10, **source), str(tmp_path))
    resumed = run_train(tokens, moe_pp_config(ranks=1, pp=1, zero=0), str(tmp_path))
    assert resumed.resumed_from == 10 and resumed.layout_change.endswith("-> dp=1,zero=0,micro=4,accum=4 at step 10")
    got, ref = ([r for r in _records(x.metrics_path, "train") if r["step"] > 10] for x in (resumed, runs["one"]))
    assert [r["step"] for r in got] == list(range(11, 21))
    rel = _max_rel([r["loss"] for r in got], [r["loss"] for r in ref])
    print(f"MoE {resumed.layout_change.split(' -> ')[0]} -> one rank at step 10: max relative loss difference "
          f"over steps 11-20 {rel:.3g}")
    assert rel <= 1e-5 and _max_rel([r["moe_aux_loss"] for r in got], [r["moe_aux_loss"] for r in ref]) <= 1e-5
    assert [r["moe_dropped_per_expert"] for r in got] == [r["moe_dropped_per_expert"] for r in ref]
