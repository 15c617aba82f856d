"""Muon (train.optimizer.name: muon) with MoE experts (train.moe). Our experts are DeepSpeed MoE copies of our
MLP: each expert's matrices are 2-D and whole on the ep rank that holds them, so Muon orthogonalises each on its
own, as the single rank holding all experts does (engine.muon_optimizer puts them in DeepSpeed's expert groups).

Fast: one engine step at ZeRO-0 and ZeRO-2 moves every expert matrix by DeepSpeed's muon_update of that matrix's
own gradient (not AdamW's step, not an update orthogonalised over several matrices together).

Slow: 20 steps of the MoE model of test_parallel_moe with Muon, ep=2 over 2 ranks and ep=1 dp=2 (ZeRO-2), and of
test_parallel_moe_pp's with pipeline stages (pp=2, ZeRO-1) and with ep=2 at ZeRO-0, each against one rank at its
stage; loss curves agree to relative 1e-5. An ep=2 run resumed from its step-10 commit repeats the uninterrupted
run's losses bit for bit."""

import json
import os

import pytest
import torch

from lifecycle.core.procs import free_port

from tests.train.test_parallel_moe import moe_cfg

MUON = {"optimizer": {"name": "muon", "muon_lr": 0.02, "grad_clip": 0.0}}


def _losses(path) -> list[float]:
    return [r["loss"] for r in map(json.loads, open(path)) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.train.test_train import make_tokens

    return make_tokens(tmp_path_factory.mktemp("muon_moe_tokens"), 600)


def _cfg(ranks: int, ep: int):
    base = moe_cfg(ranks, ep).optimizer.model_dump()
    return moe_cfg(ranks, ep, optimizer={**base, **MUON["optimizer"]})


@pytest.fixture(scope="module")
def single(tokens, tmp_path_factory):
    from lifecycle.tasks.train.launch import run_train

    return _losses(run_train(tokens, _cfg(1, 1), str(tmp_path_factory.mktemp("one"))).metrics_path)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 1], ids=["ep2", "ep1-dp2"])
def test_muon_with_experts_trains_the_single_rank_loss_curve(tokens, single, tmp_path, ep):
    from lifecycle.tasks.train.launch import run_train

    got = _losses(run_train(tokens, _cfg(2, ep), str(tmp_path)).metrics_path)
    assert len(got) == len(single) == 20
    rel = max(abs(x - y) / abs(y) for x, y in zip(got, single))
    print(f"Muon with experts, ep={ep} on 2 ranks vs 1 rank, 20 steps: max relative loss difference {rel:.3g}")
    assert rel <= 1e-5
    assert got[-1] < 0.8 * got[0]


def _step_worker(rank: int, init: str, out: str) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"
    host, port = init.removeprefix("tcp://").split(":")
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
    import deepspeed
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    from lifecycle.tasks.train.engine import ds_config, muon_optimizer
    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.parallel.parallelism import Parallelism

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    got = {}
    for zero in (0, 2):
        cfg = moe_cfg(1, 1, engine={"zero_stage": zero, "precision": "fp32"}, batch={"grad_accum": 1},
                      model={"n_layer": 2, "n_head": 2, "n_embd": 64, "seq_len": 64, "vocab_size": 64},
                      optimizer={**moe_cfg(1, 1).optimizer.model_dump(), **MUON["optimizer"]})
        torch.manual_seed(0)
        par = Parallelism(cfg, 0, torch.device("cpu"))
        model = par.wrap_model(GPT(cfg.model_arch))
        x = torch.randint(0, cfg.model.vocab_size, (8, cfg.model.seq_len))
        model(x, x.roll(-1, 1))[1].backward()  # the gradients the engine's step will see (same weights, same batch)
        experts = {n: p for n, p in model.named_parameters() if ".deepspeed_experts." in n}
        before = {n: (p.detach().clone(), p.grad.detach().clone()) for n, p in experts.items()}
        model.zero_grad(set_to_none=True)
        opt = muon_optimizer(cfg, model, par)
        groups = {n: (g["use_muon"], g.get("moe", False)) for g in opt.param_groups for n, p in experts.items()
                  if any(p is q for q in g["params"])}
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg))
        engine.backward(engine(x, x.roll(-1, 1))[1])
        engine.step()
        lr, wd = cfg.optimizer.muon_lr, cfg.optimizer.weight_decay
        err, adam_err = 0.0, 0.0
        for n, p in experts.items():
            w, g = before[n]
            want = w * (1 - lr * wd) - lr * muon_update(g.clone(), torch.zeros_like(g))
            adam = w * (1 - lr * wd) - lr * g.sign()  # AdamW's first step (bias-corrected m/sqrt(v) = sign(g))
            err = max(err, ((p.detach() - want).abs().max() / (w - want).abs().max()).item())
            adam_err = max(adam_err, ((p.detach() - adam).abs().max() / (w - adam).abs().max()).item())
        got[zero] = {"groups": sorted(map(list, set(groups.values()))), "n": len(experts), "err": err,
                     "adam_err": adam_err}
    json.dump(got, open(out, "w"))


def test_one_step_moves_each_expert_matrix_by_muon_of_its_own_gradient(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "got.json")
    mp.spawn(_step_worker, args=(f"tcp://127.0.0.1:{free_port()}", out), nprocs=1)
    got = json.load(open(out))
    for zero, r in got.items():
        print(f"ZeRO-{zero}: expert step against muon_update per matrix {r['err']:.3g}, against AdamW {r['adam_err']:.3g}")
        assert r["n"] == 2 * 4 * 2  # 2 layers × 4 experts × (up: SwiGLU's gate and up fused, down)
        assert r["groups"] == [[True, True]]  # every expert matrix: Muon, in DeepSpeed's expert group
        assert r["err"] < 1e-3 and r["adam_err"] > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"ranks": 2, "pp": 2}, {"ranks": 2, "pp": 1, "moe.ep": 2, "zero": 0}],
                         ids=["pp2-zero1", "ep2-zero0"])
def test_muon_with_experts_in_pipeline_stages_and_at_zero0_trains_the_single_rank_curve(tokens, tmp_path, layout):
    from lifecycle.tasks.train.launch import run_train
    from tests.train.test_parallel_moe_pp import moe_pp_config

    muon = {"optimizer.name": "muon", "optimizer.muon_lr": 0.02, "optimizer.grad_clip": 0.0}
    zero = {"zero": layout["zero"]} if "zero" in layout else {}
    one = _losses(run_train(tokens, moe_pp_config(ranks=1, pp=1, **zero, **muon), str(tmp_path / "one")).metrics_path)
    got = _losses(run_train(tokens, moe_pp_config(**layout, **muon), str(tmp_path / "got")).metrics_path)
    assert len(got) == len(one) == 20
    rel = max(abs(x - y) / abs(y) for x, y in zip(got, one))
    print(f"Muon with experts, {layout} vs 1 rank, 20 steps: max relative loss difference {rel:.3g}")
    assert rel <= 1e-5 and got[-1] < 0.8 * got[0]


@pytest.mark.slow
def test_muon_with_experts_resumes_exactly(tokens, tmp_path):
    """ep=2 over 2 ranks, ZeRO-2: stopped at its step-10 commit and run on to 20, the losses of steps 11-20 are the
    uninterrupted run's bit for bit (each ep rank's expert momentum is in its checkpoint)."""
    from lifecycle.tasks.train.launch import run_train

    straight = _losses(run_train(tokens, _cfg(2, 2), str(tmp_path / "straight")).metrics_path)
    assert run_train(tokens, _cfg(2, 2).model_copy(update={"max_steps": 10}), str(tmp_path / "w")).steps == 10
    rest = run_train(tokens, _cfg(2, 2), str(tmp_path / "w"))
    got = {r["step"]: r["loss"] for r in map(json.loads, open(rest.metrics_path)) if r["kind"] == "train"}
    assert rest.resumed_from == 10 and [got[s] for s in range(11, 21)] == straight[10:]
