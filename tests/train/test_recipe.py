"""Issue 47's recipe options, fast: warmup-stable-decay (`train.optimizer.schedule: wsd`: lr values, extension,
the stable phase shared by any horizon, the run key) and document-aware attention
(`train.model.attention: document`: a document's logits do not depend on the other documents of its window,
positions restart at each document, the same under tp=2 on two gloo processes; accepted under pp/sp). The runs
that train through DeepSpeed are in test_recipe_runs.py."""

from __future__ import annotations

import math

import pytest
import torch

from lifecycle.tasks.train.config import ModelConfig, TrainConfig
from lifecycle.tasks.train.engine import attention
from lifecycle.tasks.train.model import GPT, documents

WSD = {"max_steps": 100, "optimizer": {"schedule": "wsd", "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10,
                                       "decay_steps": 100, "decay_fraction": 0.2}}


def _cfg(data: dict, **opt) -> TrainConfig:
    return TrainConfig.model_validate({**data, "optimizer": {**data["optimizer"], **opt}})


@pytest.mark.parametrize("shape, at_half", [("linear", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5)])
def test_wsd_warms_up_holds_then_decays_to_min_lr_at_the_horizon(shape, at_half):
    cfg = _cfg(WSD, decay_shape=shape)
    lrs = [cfg.lr_at(s) for s in range(120)]
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[9] == pytest.approx(1e-3 * 10 / 11)
    assert cfg.decay_start == 80
    assert lrs[10] == lrs[50] == lrs[79] == 1e-3  # stable
    assert lrs[90] == pytest.approx(1e-4 + at_half * 9e-4)  # halfway through the decay
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[100] == lrs[119] == pytest.approx(1e-4)
    assert lrs[99] > 1e-4


def test_wsd_stable_phase_does_not_depend_on_the_horizon_so_an_anneal_branches_off_any_step():
    long = _cfg(WSD, decay_steps=1000)
    anneal = _cfg(WSD, decay_steps=60, decay_fraction=0.25)  # a 15-step anneal from step 45 of the long run
    assert anneal.decay_start == 45
    assert [long.lr_at(s) for s in range(45)] == [anneal.lr_at(s) for s in range(45)]
    assert anneal.lr_at(46) < long.lr_at(46) and anneal.lr_at(60) == 1e-4


def test_a_run_extended_keeps_its_lr_curve_and_its_fingerprint():
    short = _cfg({**WSD, "max_steps": 40}, decay_steps=200)
    longer = TrainConfig.model_validate({**short.model_dump(), "max_steps": 150})
    assert longer.run_key() == short.run_key()
    assert [short.lr_at(s) for s in range(40)] == [longer.lr_at(s) for s in range(40)]
    # the horizon follows max_steps when decay_steps is null: then a longer run is another run, as with cosine
    free = _cfg({**WSD, "max_steps": 40}, decay_steps=None)
    assert TrainConfig.model_validate({**free.model_dump(), "max_steps": 80}).run_key() != free.run_key()


def test_the_schedule_and_its_fields_are_in_the_run_key():
    assert TrainConfig(max_steps=30).run_key()["optimizer"]["schedule"] == "cosine"
    assert _cfg(WSD).run_key()["optimizer"]["schedule"] == "wsd"
    assert _cfg(WSD, decay_shape="linear").run_key() != _cfg(WSD).run_key()
    assert _cfg(WSD, decay_fraction=0.1).run_key() != _cfg(WSD).run_key()
    # the cosine curve itself is the one of before (test_train.test_lr_schedule_warmup_cosine_then_flat)
    assert TrainConfig.model_validate({"max_steps": 50, "optimizer": {"warmup_steps": 10, "decay_steps": 100}}
                                      ).lr_at(55) == pytest.approx(1e-4 + 0.5 * 9e-4)


# --------------------------------------------------------------------------------------------------
# document-aware attention

EOT = 0
ROPE = ModelConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, seq_len=24)
LEARNED = ModelConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=32, seq_len=24, pos="learned", mlp="gelu",
                      norm="layernorm", tie_embeddings=False)


def _window(*docs: list[int]) -> torch.Tensor:
    """Documents end to end, each followed by the end-of-text id, as the tokenizer packs them."""
    return torch.tensor([[t for d in docs for t in (*d, EOT)]])


def test_documents_finds_positions_and_the_block_causal_mask():
    pos, mask = documents(_window([5, 6], [7, 8, 9]), EOT)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3]]  # the end-of-text id closes its document
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False]
    assert mask[0, 0, 2].tolist() == [True, True, True, False, False, False, False]
    assert documents(torch.tensor([[5, 6, 7]]), EOT) is None  # no boundary: the causal kernel


@pytest.mark.parametrize("cfg", [ROPE, LEARNED], ids=["rope-gqa", "learned"])
def test_changing_one_document_leaves_every_other_documents_logits_unchanged(cfg):
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    model.doc_sep = EOT
    a, b, c = [3, 4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16, 17]
    base = model(_window(a, b, c))[0]
    changed = model(_window(a, [20, 21, 22, 23], c))[0]
    n_a, n_b = len(a) + 1, len(b) + 1
    torch.testing.assert_close(changed[:, :n_a], base[:, :n_a], rtol=0, atol=1e-6)  # before: unchanged
    torch.testing.assert_close(changed[:, n_a + n_b:], base[:, n_a + n_b:], rtol=0, atol=1e-5)  # after: too
    assert not torch.allclose(changed[:, n_a:n_a + n_b], base[:, n_a:n_a + n_b])
    # a document gives the logits it gives alone: its positions restart at 0
    alone = model(_window(c))[0]
    torch.testing.assert_close(base[:, n_a + n_b:], alone, rtol=0, atol=1e-5)
    # packed attention (no doc_sep) lets the changed document reach the last one
    model.doc_sep = None
    assert not torch.allclose(model(_window(a, b, c))[0][:, -1], model(_window(a, [20, 21, 22, 23], c))[0][:, -1])


def _tp_doc_worker(rank: int, world: int, init: str, out: str, cfg_json: str) -> None:
    import torch.distributed as dist

    from lifecycle.tasks.train.parallel.mesh import Grid, Mesh
    from lifecycle.tasks.train.parallel.tp import TPGroup, shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cfg = ModelConfig.model_validate_json(cfg_json)
    torch.manual_seed(0)
    model = shard_model(GPT(cfg), TPGroup.of(Mesh(Grid(tp=world), rank)), False)
    model.doc_sep = EOT
    logits = [model(_window([3, 4, 5], doc, [12, 13, 14, 15]))[0].detach() for doc in ([8, 9], [20, 21])]
    torch.save(logits, f"{out}.{rank}")
    dist.destroy_process_group()


def test_document_attention_under_tp2_matches_the_dense_model(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "r")
    mp.spawn(_tp_doc_worker, args=(2, f"file://{tmp_path / 'store'}", out, ROPE.model_dump_json()), nprocs=2, join=True)
    torch.manual_seed(0)
    dense = GPT(ROPE)
    dense.doc_sep = EOT
    want = [dense(_window([3, 4, 5], doc, [12, 13, 14, 15]))[0].detach() for doc in ([8, 9], [20, 21])]
    for r in range(2):
        got = torch.load(f"{out}.{r}")
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[0][:, -5:], got[1][:, -5:], rtol=0, atol=1e-5)  # the last document


def test_attention_defaults_to_document_under_every_layout_and_old_runs_stay_packed():
    assert TrainConfig().model.attention == "document"
    pp = {"parallel": {"pp": 2}, "engine": {"zero_stage": 1}}
    assert TrainConfig.model_validate(pp).model.attention == "document"
    assert TrainConfig.model_validate({**pp, "model": {"attention": "packed"}}).model.attention == "packed"
    # pipeline and sequence parallelism compute it (tests/train/test_parallel_pp.py, test_parallel_sp.py)
    assert TrainConfig.model_validate({**pp, "model": {"attention": "document"}}).model.attention == "document"
    assert TrainConfig.model_validate({"parallel": {"sp": 2}, "model": {"attention": "document"}}
                                      ).model.attention == "document"
    new = {"train": TrainConfig.model_validate({"model": {"attention": "document"}}).model_dump(mode="json")}
    old = {"train": {**new["train"], "model": {k: v for k, v in new["train"]["model"].items() if k != "attention"}}}
    assert attention(new) == "document" and attention(old) == "packed"
    assert TrainConfig().run_key()["model"]["attention"] == "document"  # in the fingerprint: a packed run is another


# --------------------------------------------------------------------------------------------------
# Muon


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    from lifecycle.tasks.train.engine import muon_optimizer

    model = GPT(ModelConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, seq_len=16, tie_embeddings=False))
    cfg = TrainConfig.model_validate({"optimizer": {"name": "muon", "lr": 3e-3, "muon_lr": 0.02, "grad_clip": 0.0}})
    opt = muon_optimizer(cfg, model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adam = ([names[id(p)] for g in opt.param_groups if g["use_muon"] is on for p in g["params"]]
                  for on in (True, False))
    assert sorted(muon) == sorted(f"blocks.{i}.{m}.weight" for i in range(2)
                                  for m in ("attn.qkv", "attn.proj", "mlp.up", "mlp.down"))
    assert {"wte.weight", "lm_head.weight", "norm_f.weight", "blocks.0.norm1.weight"} <= set(adam)
    lrs = {g["use_muon"]: g["lr"] for g in opt.param_groups}
    assert lrs == {True: 0.02, False: 3e-3}
    assert {g["weight_decay"] for g in opt.param_groups if not g["use_muon"]} == {0.1, 0.0}  # none on norms
    # one step changes every parameter that has a gradient, with Muon's update on the matrices
    x = torch.randint(0, 64, (2, 16))
    model(x, x.roll(-1, 1))[1].backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("over, message", [
    ({"engine": {"zero_stage": 2}}, r"grad_clip=1.0 under ZeRO-2: .*set train.optimizer.grad_clip=0"),
])
def test_muon_is_refused_where_it_is_not_verified(over, message):
    with pytest.raises(ValueError, match=f"train.optimizer.name=muon with .*{message}"):
        TrainConfig.model_validate({**over, "optimizer": {"name": "muon"}})
