"""Composed layouts: tensor × pipeline × data parallelism (lifecycle.tasks.train.parallel.pp with tp > 1).

Fast: what composes and what is refused, at config build. Launched (CPU ranks, gloo, through run_train): tp2×pp2
(4 ranks) and tp2×pp2×dp2 (8 ranks) against one rank over 20 steps on the same global batches, and the
consolidated weights against the single-rank run's. Slow: tp2×pp2 under ZeRO-0, and exact resume after SIGKILL.
"""

from pathlib import Path

import pytest

from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.parallel.mesh import Layout
from tests.train.test_parallel_pp import _max_rel, _records, pp_config

# --------------------------------------------------------------------------------------------------
# config


def test_tp_pp_dp_composes_and_describes_itself():
    cfg = TrainConfig.model_validate({"batch": {"num_ranks": 8, "micro_batch_size": 2, "grad_accum": 2},
                                      "parallel": {"tp": 2, "pp": 2}, "engine": {"zero_stage": 1},
                                      "model": {"n_head": 4, "dropout": 0.0}})
    assert cfg.dp == 2 and cfg.global_batch == 8
    assert Layout.of(cfg).describe() == "dp=2,zero=1,micro=2,accum=2,tp=2,pp=2"
    assert Layout.of(cfg).grid.coords(5) == {"pp": 1, "dp": 0, "sp": 0, "tp": 1}


@pytest.mark.parametrize("over, message", [
    ({"parallel": {"tp": 2, "pp": 2}, "engine": {"zero_stage": 2}}, "DeepSpeed's pipeline engine runs ZeRO-0 and"),
    ({"parallel": {"tp": 2, "sp": 2}, "engine": {"zero_stage": 1}}, "Ulysses sequence parallelism inside a tp"),
    ({"parallel": {"tp": 2, "pp": 2}, "engine": {"zero_stage": 1}, "moe": {"num_experts": 2}},
     "MoE experts are not tp-sharded"),  # MoE with pp alone composes (tests/train/test_parallel_moe_pp.py)
])
def test_what_does_not_compose_with_tp_x_pp_is_refused_with_the_reason(over, message):
    data = {"batch": {"num_ranks": 4}, "model": {"n_head": 4, "dropout": 0.0}, **over}
    with pytest.raises(ValueError, match=message):
        TrainConfig.model_validate(data)


# --------------------------------------------------------------------------------------------------
# launched


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.train.test_train import make_tokens

    return make_tokens(tmp_path_factory.mktemp("tokens"), 600)


def tp_pp_config(ranks: int = 4, **changes) -> TrainConfig:
    """pp_config's 20 steps (global batch 8) with tp=2 inside each of the two pipeline stages."""
    micro = 4 * 4 // ranks  # dp = ranks / 4: micro 4 at dp 1, 2 at dp 2 (grad_accum 2 fills the pipeline)
    return pp_config(ranks=ranks, pp=2, **{"parallel.tp": 2, "batch.micro_batch_size": micro, **changes})


@pytest.fixture(scope="module")
def runs(tokens, tmp_path_factory):
    from lifecycle.tasks.train.launch import run_train

    root = tmp_path_factory.mktemp("runs")
    return {"dense": run_train(tokens, pp_config(ranks=1, pp=1), str(root / "dense")),
            "tp2pp2": run_train(tokens, tp_pp_config(), str(root / "tp2pp2"))}


def _curve(run) -> list[float]:
    return [r["loss"] for r in _records(run.metrics_path, "train")]


def test_tp2_pp2_trains_the_single_rank_loss_curve_and_exports_the_dense_weights(runs):
    """Four ranks, two pipeline stages of two tensor-parallel ranks each: same initial weights (the dense model
    sliced), same global batches. Only the reduction order differs (tp's all-reduces, the tied embedding's two
    copies, the gradient norm summed over pp × tp), so every step's loss agrees within fp32 tolerance; the
    consolidated checkpoint, gathered over tp inside each stage, holds the dense names and shapes."""
    from safetensors.torch import load_file

    from lifecycle.tasks.train import commit as ckpt

    a, b = _curve(runs["tp2pp2"]), _curve(runs["dense"])
    rel = _max_rel(a, b)
    print(f"tp2 x pp2 (4 ranks) vs single rank, 20 steps: max relative loss difference {rel:.3g}")
    assert len(a) == 20 and a[-1] < 0.8 * a[0] and rel < 1e-5
    files = {f["path"] for f in ckpt.read_marker(runs["tp2pp2"].checkpoint_dir)["files"]}
    assert {"layer_02-model_01-model_states.pt", "mp_rank_03_model_states.pt"} <= files
    ours, theirs = (load_file(str(Path(r.checkpoint_dir) / "model.safetensors")) for r in (runs["tp2pp2"], runs["dense"]))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-4


@pytest.fixture(scope="module")
def eight(tokens, tmp_path_factory):
    """tp2×pp2×dp2 on 8 ranks, 20 steps (slow tests only: about a minute alone, several beside other tests)."""
    from lifecycle.tasks.train.launch import run_train

    return run_train(tokens, tp_pp_config(ranks=8), str(tmp_path_factory.mktemp("tp2pp2dp2")))


@pytest.mark.slow  # one launch of 8 ranks
def test_tp2_pp2_dp2_on_eight_ranks_trains_the_single_rank_loss_curve(runs, eight):
    """The full 3D grid: tp inside, dp between, pp outermost (Megatron's order), ZeRO-1 over each dp group."""
    r = eight
    rel = _max_rel(_curve(r), _curve(runs["dense"]))
    print(f"tp2 x pp2 x dp2 (8 ranks) vs single rank, 20 steps: max relative loss difference {rel:.3g}")
    assert len(_curve(r)) == 20 and rel < 1e-5


@pytest.mark.slow  # one more launch of 4 ranks
def test_tp2_pp2_under_zero0_with_selective_recomputation_matches_the_single_rank_run(runs, tokens, tmp_path):
    """ZeRO-0 clips with DeepSpeed's clip_grad_norm_, summing over the pp × tp model-parallel group only the
    parameters marked model-parallel and, unmarked, those of its rank 0: the tp-split ones are marked, the
    replicated ones only on tp rank 0 (pp.pipeline_module), so each gradient is counted once. The stages
    recompute per op (`selective`, through DeepSpeed's activation_checkpoint_func): the same gradients."""
    from lifecycle.tasks.train.launch import run_train

    r = run_train(tokens, tp_pp_config(zero=0, **{"engine.activation_checkpointing": "selective"}), str(tmp_path))
    rel = _max_rel(_curve(r), _curve(runs["dense"]))
    print(f"tp2 x pp2 ZeRO-0, selective recomputation vs single rank: max relative loss difference {rel:.3g}")
    assert rel < 1e-5


@pytest.mark.slow  # two launches of 4 ranks
def test_tp2_pp2_resumes_exactly_after_a_sigkill(runs, tmp_path):
    """SIGKILL the supervisor and all four ranks after the step-10 commit, rerun: the resumed curve and final
    weights are the uninterrupted tp2×pp2 run's, bit for bit (tests/train/sigkill.py)."""
    from tests.train.sigkill import resumes_exactly

    resumes_exactly(tmp_path, "tests.train.test_parallel_3d:tp_pp_config", {}, runs["tp2pp2"])


@pytest.mark.slow  # two more launches of 8 ranks
def test_tp2_pp2_dp2_resumes_exactly_after_a_sigkill(eight, tmp_path):
    """The 8-rank grid killed after its step-10 commit and rerun: every loss and the final weights bitwise."""
    from tests.train.sigkill import resumes_exactly

    resumes_exactly(tmp_path, "tests.train.test_parallel_3d:tp_pp_config", {"ranks": 8}, eight)


def _continues(resumed, ref, steps=range(11, 21)) -> float:
    got = {r["step"]: r["loss"] for r in _records(resumed.metrics_path, "train") if r["step"] in steps}
    want = {r["step"]: r["loss"] for r in _records(ref.metrics_path, "train") if r["step"] in steps}
    assert sorted(got) == list(steps), sorted(got)
    return _max_rel([got[s] for s in steps], [want[s] for s in steps])


@pytest.mark.slow  # two launches
def test_tp2_pp2_checkpoint_resumes_on_one_rank(runs, tokens, tmp_path):
    """tp2×pp2 -> one rank, found by run_train itself: a tp2×pp2 run stops at step 10; a single-rank ZeRO-0 run of
    the same trajectory in the same work dir converts that commit (pipeline-to-dense: each stage's ZeRO-1
    partitions, its tp slices merged) and continues; steps 11-20 follow the single-rank curve."""
    from lifecycle.tasks.train.launch import run_train

    run_train(tokens, tp_pp_config(max_steps=10), str(tmp_path))
    resumed = run_train(tokens, pp_config(ranks=1, pp=1, zero=0), str(tmp_path))
    assert resumed.resumed_from == 10
    rel = _continues(resumed, runs["dense"])
    print(f"tp2 x pp2 -> one rank at step 10: max relative loss difference over steps 11-20 {rel:.3g}")
    assert rel < 1e-5


@pytest.mark.slow  # two launches, 4 then 8 ranks
def test_tp2_pp2_resumes_as_tp2_pp2_dp2(runs, tokens, tmp_path):
    """tp2×pp2 -> tp2×pp2×dp2 under ZeRO-0 (pipeline-replicas: the per-layer and per-model-parallel-rank files
    hold the whole state, whatever dp); steps 11-20 on 8 ranks follow the single-rank curve."""
    from lifecycle.tasks.train.launch import run_train

    run_train(tokens, tp_pp_config(zero=0, max_steps=10), str(tmp_path))
    resumed = run_train(tokens, tp_pp_config(ranks=8, zero=0), str(tmp_path))
    assert resumed.resumed_from == 10
    rel = _continues(resumed, runs["dense"])
    print(f"tp2 x pp2 -> tp2 x pp2 x dp2 at step 10: max relative loss difference over steps 11-20 {rel:.3g}")
    assert rel < 1e-5
