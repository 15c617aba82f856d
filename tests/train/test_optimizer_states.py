"""bf16 optimizer states (`train.engine.optimizer_states: bf16`): DeepSpeed's bf16 master weights and Adam moments
under ZeRO 1-3, what the planner counts for them, and what is refused."""

import glob

import pytest
import torch

from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.engine import ds_config
from lifecycle.tasks.train.zero_memory import PRECISIONS, model_states


@pytest.mark.parametrize("engine, pp, message", [
    ({"precision": "fp32"}, 1, "needs train.engine.precision=bf16"),
    ({"precision": "bf16", "zero_stage": 0}, 1, "zero_stage 1-3"),
    ({"precision": "bf16", "zero_stage": 1}, 2, "without pipeline"),
])
def test_bf16_states_need_bf16_weights_zero_and_no_pipeline(engine, pp, message):
    data = {"engine": {"optimizer_states": "bf16", **engine}, "parallel": {"pp": pp}, "batch": {"num_ranks": pp}}
    with pytest.raises(ValueError, match=message):
        TrainConfig.model_validate(data)


def test_ds_config_asks_for_bf16_masters_and_moments_and_the_planner_halves_the_states():
    cfg = TrainConfig(engine={"precision": "bf16", "zero_stage": 2, "optimizer_states": "bf16"})
    assert ds_config(cfg)["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True,
                                      "bf16_optimizer_states": True}
    assert "bf16_optimizer_states" not in ds_config(TrainConfig(engine={"precision": "bf16"}))["bf16"]
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
