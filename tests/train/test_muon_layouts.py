"""Muon (train.optimizer.name: muon) under pipeline and sequence parallelism, launched (slow: 2 CPU ranks, gloo,
through run_train): each layout trains the single-rank Muon run's loss curve over 20 steps on the same global
batches, and the pipeline run resumes exactly after a SIGKILL. DeepSpeed's Muon orthogonalises whole matrices:
a pipeline stage and a Ulysses rank hold whole matrices, so the update is the single rank's."""

import json

import pytest

from tests.train.test_parallel_pp import pp_config
from tests.train.test_train import make_tokens


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_tokens(tmp_path_factory.mktemp("tokens"), 600)


MUON = {"optimizer.name": "muon", "optimizer.muon_lr": 0.02, "optimizer.grad_clip": 0.0}


def _losses(path) -> list[float]:
    return [r["loss"] for r in map(json.loads, open(path)) if r["kind"] == "train"]


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 20
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def single(tokens, tmp_path_factory):
    """The single-rank Muon run at ZeRO-1 and at ZeRO-0, made when first asked for. They differ from each other
    (DeepSpeed clips Muon's orthogonalised update at ZeRO 1-3 and the raw gradient at ZeRO-0), so each layout is
    compared with the single rank at its own stage."""
    from lifecycle.tasks.train.launch import run_train

    made: dict[int, object] = {}

    def get(zero: int):
        if zero not in made:
            made[zero] = run_train(tokens, pp_config(ranks=1, pp=1, zero=zero, **MUON),
                                   str(tmp_path_factory.mktemp(f"single{zero}")))
        return made[zero]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"parallel.pp": 2}, {"parallel.pp": 2, "engine.zero_stage": 0},
                                    {"parallel.pp": 1, "parallel.sp": 2}], ids=["pp2-zero1", "pp2-zero0", "sp2"])
def test_muon_layout_trains_the_single_rank_loss_curve(tokens, single, tmp_path, layout):
    from lifecycle.tasks.train.launch import run_train

    r = run_train(tokens, pp_config(**{**MUON, **layout}), str(tmp_path))
    rel = _max_rel(_losses(r.metrics_path), _losses(single(layout.get("engine.zero_stage", 1)).metrics_path))
    print(f"Muon {layout} vs single rank, 20 steps: max relative loss difference {rel:.3g}")
    assert rel <= 1e-5


@pytest.mark.slow
def test_muon_pipeline_run_resumes_exactly_after_a_sigkill(tmp_path):
    """SIGKILL the supervisor and both stages of a Muon pp=2 run after its step-10 commit, rerun: every loss and
    the final weights those of an uninterrupted run (Muon's momentum and the AdamW half's moments are in each
    stage's checkpoint)."""
    from lifecycle.tasks.train.launch import run_train
    from tests.train.sigkill import resumes_exactly

    straight = run_train(make_tokens(tmp_path / "tok", 600), pp_config(**MUON), str(tmp_path / "straight"))
    resumes_exactly(tmp_path / "killed", "tests.train.test_parallel_pp:pp_config", MUON, straight)
