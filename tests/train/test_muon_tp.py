"""Muon under tensor parallelism (lifecycle.tasks.train.muon_tp): DeepSpeed's own muon_update on the whole
matrix, gathered from the tp ranks' slices, on 2 gloo processes (fast); then launched runs (slow): 20 steps of
Muon at tp=2 (ZeRO-1 and ZeRO-2) and at tp2 × pp2 (ZeRO-1 and ZeRO-0) track the one-rank Muon run within the
tolerance of the AdamW tp runs (test_parallel_tp.LOSS_RTOL)."""

import json

import pytest
import torch
import torch.multiprocessing as mp

from lifecycle.tasks.train.config import ModelConfig
from tests.train.test_parallel_tp import LOSS_RTOL, tp_config
from tests.train.test_train import make_tokens

MUON = {"optimizer.name": "muon", "optimizer.muon_lr": 0.02, "optimizer.grad_clip": 0.0}
CFG = ModelConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=16, seq_len=8, vocab_size=32)


def _worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from deepspeed.runtime.zero.muon import original_muon

    from lifecycle.tasks.train import muon_tp
    from lifecycle.tasks.train.parallel.tp import shard_tensor, split_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    plain = original_muon.muon_update
    muon_tp.install()
    gen = torch.Generator().manual_seed(0)
    results = {}
    for name in ("blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.up.weight"):
        spec = split_spec(CFG, name)
        rows = sum(spec[1]) if spec[0] == 0 else CFG.n_embd
        cols = CFG.n_embd if spec[0] == 0 else sum(spec[1])
        grad, momentum = torch.randn(rows, cols, generator=gen), torch.randn(rows, cols, generator=gen)
        whole_m = momentum.clone()
        whole = plain(grad.clone(), whole_m, 0.95)
        split = muon_tp.TPSplit(spec, dist.group.WORLD, world, rank)
        my_m = shard_tensor(momentum, spec, world, rank)
        got = original_muon.muon_update(shard_tensor(grad, spec, world, rank), my_m, 0.95, is_expert_group=split)
        sliced = plain(shard_tensor(grad, spec, world, rank), shard_tensor(momentum, spec, world, rank), 0.95)
        results[name] = {"got": got, "want": shard_tensor(whole, spec, world, rank), "momentum": my_m,
                         "want_momentum": shard_tensor(whole_m, spec, world, rank), "sliced": sliced}
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def test_tp_aware_update_is_the_whole_matrix_update_sliced(tmp_path):
    """Each rank's update and momentum are its slices of DeepSpeed's update of the whole matrix (q/k/v and
    gate/up rows, proj columns); Newton-Schulz of the slice alone is not (what tp would train without it)."""
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/init", str(tmp_path / "out")), nprocs=2)
    for rank in range(2):
        for name, r in torch.load(tmp_path / f"out.{rank}").items():
            torch.testing.assert_close(r["got"], r["want"], rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(r["momentum"], r["want_momentum"], msg=name)
            assert (r["sliced"] - r["want"]).abs().max() > 1e-2, name


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_tokens(tmp_path_factory.mktemp("tokens"), 600)


def _losses(path) -> list[float]:
    return [r["loss"] for r in map(json.loads, open(path)) if r["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2])
def test_muon_tp2_trains_the_single_rank_loss_curve(tokens, tmp_path, zero):
    from lifecycle.tasks.train.launch import run_train

    dense = run_train(tokens, tp_config(**MUON, **{"batch.num_ranks": 1, "engine.zero_stage": zero}), str(tmp_path / "one"))
    tp2 = run_train(tokens, tp_config(**MUON, **{"parallel.tp": 2, "engine.zero_stage": zero}), str(tmp_path / "tp2"))
    a, b = _losses(dense.metrics_path), _losses(tp2.metrics_path)
    assert len(a) == len(b) == 20 and a[-1] < 0.8 * a[0]
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print(f"Muon tp=2 ZeRO-{zero} vs one rank, 20 steps: max relative loss difference {rel:.3g}")
    assert rel < LOSS_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 0])
def test_muon_tp2_inside_pipeline_stages_trains_the_single_rank_loss_curve(tokens, tmp_path, zero):
    """tp2 × pp2 (4 ranks; ZeRO-1 and ZeRO-0, what DeepSpeed's pipeline engine runs): each stage's tp-split
    matrices are tagged by their GPT names (the stage's dense_names) and gathered over the stage's tp group
    (DeepSpeed's slice group); 20 steps follow one rank with the same weights and global batches."""
    from lifecycle.tasks.train.launch import run_train
    from tests.train.test_parallel_3d import tp_pp_config
    from tests.train.test_parallel_pp import pp_config

    dense = run_train(tokens, pp_config(ranks=1, pp=1, zero=zero, **MUON), str(tmp_path / "one"))
    tp_pp = run_train(tokens, tp_pp_config(zero=zero, **MUON), str(tmp_path / "tp2pp2"))
    a, b = _losses(dense.metrics_path), _losses(tp_pp.metrics_path)
    assert len(a) == len(b) == 20 and a[-1] < 0.8 * a[0]
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print(f"Muon tp=2 x pp=2 ZeRO-{zero} vs one rank, 20 steps: max relative loss difference {rel:.3g}")
    assert rel < LOSS_RTOL
