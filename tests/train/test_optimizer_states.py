"""bf16 optimizer states (`train.engine.optimizer_states: bf16`): DeepSpeed's bf16 master weights and Adam moments
under ZeRO 1-3, with pipeline stages too, with Muon (its momentum in bf16), what the planner counts for them, and
what is refused."""

import glob

import pytest
import torch

from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.engine import ds_config
from lifecycle.tasks.train.zero_memory import PRECISIONS, model_states


@pytest.mark.parametrize("engine, pp, message", [
    ({"precision": "fp32"}, 1, "needs train.engine.precision=bf16"),
    ({"precision": "bf16", "zero_stage": 0}, 1, "zero_stage 1-3"),
    ({"precision": "bf16", "zero_stage": 0}, 2, "zero_stage 1-3"),
])
def test_bf16_states_need_bf16_weights_and_zero(engine, pp, message):
    data = {"engine": {"optimizer_states": "bf16", **engine}, "parallel": {"pp": pp}, "batch": {"num_ranks": pp}}
    with pytest.raises(ValueError, match=message):
        TrainConfig.model_validate(data)
    TrainConfig.model_validate({**data, "engine": {**data["engine"], "precision": "bf16", "zero_stage": 1}})


def test_ds_config_asks_for_bf16_masters_and_moments_and_the_planner_halves_the_states():
    cfg = TrainConfig(engine={"precision": "bf16", "zero_stage": 2, "optimizer_states": "bf16"})
    assert ds_config(cfg)["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True,
                                      "bf16_optimizer_states": True}
    assert "bf16_optimizer_states" not in ds_config(TrainConfig(engine={"precision": "bf16"}))["bf16"]
    muon = TrainConfig(engine=cfg.engine, optimizer={"name": "muon", "grad_clip": 0.0})  # Muon's momentum too
    assert ds_config(muon)["bf16"] == ds_config(cfg)["bf16"]
    full, half = (model_states(1e9, 2, 8, PRECISIONS[p])["optimizer"] for p in ("bf16", "bf16-states"))
    assert (full, half) == (12e9 / 8, 6e9 / 8)


@pytest.mark.slow  # one launch of 2 ranks
def test_a_bf16_states_run_learns_and_its_checkpoint_holds_bf16_moments(tmp_path):
    from lifecycle.tasks.train.launch import run_train
    from tests.train.test_train import CFG, _records, make_tokens, with_

    cfg = with_(CFG, max_steps=30, **{"engine.precision": "bf16", "engine.zero_stage": 2,
                                      "engine.optimizer_states": "bf16", "logging.every": 1})
    r = run_train(make_tokens(tmp_path / "tok", 600), cfg, str(tmp_path / "w"))
    losses = [x["loss"] for x in _records(r.metrics_path, "train")]
    assert len(losses) == 30 and losses[-1] < 0.6 * losses[0]
    part = torch.load(glob.glob(f"{r.checkpoint_dir}/*optim_states.pt")[0], weights_only=False)["optimizer_state_dict"]
    base = part["base_optimizer_state"]
    state = base["state"][0] if isinstance(base, dict) else base[0]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in part["single_partition_of_fp32_groups"])


@pytest.mark.slow  # one launch of 2 ranks
def test_a_pipeline_bf16_states_run_learns_and_each_stage_holds_bf16_moments(tmp_path):
    """pp=2 at ZeRO-1: DeepSpeed's pipeline engine with bf16 weights (gradients accumulated in bf16, its default)
    takes the ZeRO-1 optimizer, not BF16_Optimizer (engine.py `_do_optimizer_sanity_check`), and that one keeps
    bf16 masters and moments when asked: each stage's partition holds them."""
    from lifecycle.tasks.train.launch import run_train
    from tests.train.test_parallel_pp import pp_config
    from tests.train.test_train import _records, make_tokens

    cfg = pp_config(max_steps=30, **{"engine.precision": "bf16", "engine.optimizer_states": "bf16",
                                     "checkpoint.every": 30})
    r = run_train(make_tokens(tmp_path / "tok", 600), cfg, str(tmp_path / "w"))
    losses = [x["loss"] for x in _records(r.metrics_path, "train")]
    assert len(losses) == 30 and losses[-1] < 0.6 * losses[0]
    files = sorted(glob.glob(f"{r.checkpoint_dir}/*optim_states.pt"))
    assert [f.rsplit("_mp_rank_", 1)[1] for f in files] == ["00_optim_states.pt", "01_optim_states.pt"]  # a stage each
    for f in files:
        part = torch.load(f, weights_only=False)["optimizer_state_dict"]
        state = part["base_optimizer_state"]["state"][0]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert all(t.dtype == torch.bfloat16 for t in part["single_partition_of_fp32_groups"])


@pytest.mark.slow  # one launch of 2 ranks each
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_muon_bf16_states_run_learns_and_keeps_muons_momentum_in_bf16(tmp_path, zero):
    """Muon with bf16 states: DeepSpeed keeps Muon's momentum in the gradients' dtype (ZeRO-1/2 stage_1_and_2.py
    `_muon_momentum_buffer`, ZeRO-3 partitioned like the weights), bf16 here, beside the AdamW half's bf16 moments
    and bf16 masters."""
    from lifecycle.tasks.train.launch import run_train
    from tests.train.test_train import CFG, _records, make_tokens, with_

    cfg = with_(CFG, max_steps=30, **{"engine.precision": "bf16", "engine.zero_stage": zero,
                                      "engine.optimizer_states": "bf16", "logging.every": 1, "optimizer.name": "muon",
                                      "optimizer.muon_lr": 0.02, "optimizer.grad_clip": 0.0})
    r = run_train(make_tokens(tmp_path / "tok", 600), cfg, str(tmp_path / "w"))
    losses = [x["loss"] for x in _records(r.metrics_path, "train")]
    assert len(losses) == 30 and losses[-1] < 0.6 * losses[0]
    files = sorted(glob.glob(f"{r.checkpoint_dir}/*optim_states.pt"))
    assert len(files) == 2
    for f in files:
        part = torch.load(f, weights_only=False)["optimizer_state_dict"]
        opt = part["optimizer_state_dict"] if zero == 3 else part["base_optimizer_state"]
        muon, *adam = opt["state"].values()  # MuonWithAuxAdam's groups, Muon's first
        assert muon["momentum_buffer"].dtype == torch.bfloat16 and muon["momentum_buffer"].abs().sum() > 0
        assert adam and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in adam)
        masters = part["fp32_flat_groups"] if zero == 3 else part["single_partition_of_fp32_groups"]
        assert all(t.dtype == torch.bfloat16 for t in masters)
