"""Tensor parallelism (lifecycle.tasks.train.parallel.tp): the split table, the tp layers against the dense model on
2 gloo processes (forward, backward, export), the config refusals, then real 2-rank DeepSpeed runs (tp=2 against
one rank over 20 steps; exact resume under SIGKILL; the tp checkpoint converted to dense; HF export)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lifecycle.core.procs import free_port
from lifecycle.tasks.train.config import ModelConfig, TrainConfig
from lifecycle.tasks.train.model import GPT
from lifecycle.tasks.train.parallel.tp import merge_tensors, shard_tensor, split_spec

# GQA (4 query heads over 2 kv heads), a q/k/v bias, SwiGLU: every fused split the table knows
GQA = ModelConfig(vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, seq_len=16, qkv_bias=True)
GELU = ModelConfig(vocab_size=96, n_layer=2, n_head=4, n_embd=32, seq_len=16, mlp="gelu", pos="learned",
                   norm="layernorm", tie_embeddings=False)


@pytest.mark.parametrize("cfg", [GQA, GELU], ids=["gqa-swiglu", "gelu"])
def test_shards_merge_back_to_the_dense_tensor_and_keep_whole_heads(cfg):
    torch.manual_seed(0)
    model = GPT(cfg)
    split = 0
    for name, p in model.export_state().items():
        spec = split_spec(cfg, name)
        if spec is None:
            continue
        split += 1
        shards = [shard_tensor(p, spec, 2, r) for r in range(2)]
        assert torch.equal(merge_tensors(shards, spec), p)
        assert sum(s.numel() for s in shards) == p.numel()
    assert split == cfg.n_layer * (5 if cfg.qkv_bias else 4)
    # rank 1's q/k/v rows: the second half of the q heads, then of the k heads, then of the v heads
    qkv = model.blocks[0].attn.qkv.weight.detach()
    C, kvd = cfg.n_embd, cfg.kv_heads * cfg.head_dim
    mine = shard_tensor(qkv, split_spec(cfg, "blocks.0.attn.qkv.weight"), 2, 1)
    assert torch.equal(mine, torch.cat([qkv[C // 2: C], qkv[C + kvd // 2: C + kvd], qkv[C + kvd + kvd // 2:]]))
    assert split_spec(cfg, "wte.weight") is None and split_spec(cfg, "blocks.0.norm1.weight") is None


def _tp_worker(rank: int, world: int, init: str, out: str, cfg_json: str, seq_parallel: bool = False) -> None:
    import torch.distributed as dist

    from lifecycle.tasks.train.parallel.mesh import Grid, Mesh
    from lifecycle.tasks.train.parallel.tp import TPGroup, shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cfg = ModelConfig.model_validate_json(cfg_json)
    mesh = Mesh(Grid(tp=world), rank)
    torch.manual_seed(0)
    model = shard_model(GPT(cfg), TPGroup.of(mesh), seq_parallel)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx, idx.roll(-1, 1))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    state = model.export_state()  # collective
    torch.save({"logits": logits.detach(), "loss": loss.detach(), "grads": grads, "state": state,
                "sharded": {n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)}},
               f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("seq_parallel", [False, True], ids=["tp", "tp+sequence-parallel"])
@pytest.mark.parametrize("cfg", [GQA, GELU], ids=["gqa-swiglu", "gelu"])
def test_tp2_layers_match_the_dense_model_forward_backward_and_export(cfg, seq_parallel, tmp_path):
    """Two gloo ranks as tp=2 from the dense model's seed: logits, loss and every gradient (each rank's slice of the
    dense gradient; replicated parameters the full one on both ranks) equal the dense model's to fp32 rounding,
    and the collective export gives the dense names, shapes and values. With Megatron's sequence parallelism the
    norms and residual adds see half the sequence on each rank, and the norms' gradients are summed back."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "r")
    mp.spawn(_tp_worker, args=(2, f"file://{tmp_path / 'store'}", out, cfg.model_dump_json(), seq_parallel),
             nprocs=2, join=True)
    got = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    torch.manual_seed(0)
    dense = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    logits, loss = dense(idx, idx.roll(-1, 1))
    loss.backward()
    ref = dense.export_state()
    for g in got:
        torch.testing.assert_close(g["logits"], logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g["loss"], loss, rtol=1e-6, atol=0)
        assert {n: t.shape for n, t in g["state"].items()} == {n: t.shape for n, t in ref.items()}
        for n, t in g["state"].items():
            assert torch.equal(t, ref[n]), n  # the initial weights: sliced, then gathered back exactly
    for name, p in dense.named_parameters():
        spec = split_spec(cfg, name)
        for r, g in enumerate(got):
            want = p.grad if spec is None else shard_tensor(p.grad, spec, 2, r)
            torch.testing.assert_close(g["grads"][name], want, rtol=1e-4, atol=1e-6, msg=name)
    assert got[0]["sharded"] == {n for n in ref if split_spec(cfg, n) is not None}


@pytest.mark.parametrize("over, message", [
    ({"model": {"n_head": 3, "n_embd": 96}}, r"tp=2 must divide train.model's n_head \(3\)"),
    ({"model": {"n_head": 4, "n_kv_head": 1}}, r"key/value heads \(n_kv_head\) \(1\)"),
    ({"engine": {"zero_stage": 3}}, "ZeRO-3 would partition the tp shards again"),
    ({"engine": {"zero_stage": 0}}, "reads ZeRO-1/2 optimizer partitions"),
    ({"model": {"dropout": 0.1}}, "Megatron's tp RNG tracker"),
    ({"batch": {"num_ranks": 3}}, "must be a multiple of train.parallel"),
])
def test_what_tp_does_not_compose_with_is_refused_when_the_config_is_built(over, message):
    base = {"parallel": {"tp": 2}, "batch": {"num_ranks": 2}, "engine": {"zero_stage": 1}}
    data = {**base, **{k: {**base.get(k, {}), **v} for k, v in over.items()}}
    with pytest.raises(ValueError, match=message):
        TrainConfig.model_validate(data)


def test_tp_times_dp_takes_dp_from_the_ranks_left():
    cfg = TrainConfig.model_validate({"parallel": {"tp": 2}, "batch": {"num_ranks": 4, "micro_batch_size": 4},
                                      "engine": {"zero_stage": 1}})
    assert cfg.dp == 2 and cfg.global_batch == 8


# --------------------------------------------------------------------------------------------------
# real DeepSpeed runs through run_train (2 CPU ranks, gloo)

from tests.train.test_train import CFG, _records, make_tokens, with_  # noqa: E402  (the tiny corpus and run)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_tokens(tmp_path_factory.mktemp("tokens"))


# GQA + q/k/v bias exercise every split; ZeRO-1 over dp (= 1 here); fp32; every step logged
TP_CFG = with_(CFG, max_steps=20, **{
    "model": ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, seq_len=64, qkv_bias=True).model_dump(),
    "engine.zero_stage": 1, "checkpoint.every": 10, "checkpoint.keep_last": 3, "logging.every": 1,
    "logging.eval_every": 0, "launch.timeout_s": 900})
LOSS_RTOL = 1e-5
TP_SEQ = {"parallel.tp": 2, "parallel.tp_sequence_parallel": True}


def tp_config(**changes):
    """TP_CFG with `changes` (dotted keys): what tests/train/sigkill.py's child process trains."""
    return with_(TP_CFG, **changes)


def _losses(result) -> list[float]:
    return [r["loss"] for r in _records(result.metrics_path, "train")]


def _tokenizer(tokens) -> Path:
    return next(Path(tokens.path).parent.rglob("tokenizer.json"))


@pytest.fixture(scope="module")
def tp_and_dense_runs(tokens, tmp_path_factory):
    """The same 20 steps twice: one rank (tp=1), and two ranks as tp=2 (dp=1, the same global batch)."""
    from lifecycle.tasks.train.launch import run_train

    dense = run_train(tokens, with_(TP_CFG, **{"batch.num_ranks": 1}), str(tmp_path_factory.mktemp("dense")))
    tp2 = run_train(tokens, with_(TP_CFG, **{"parallel.tp": 2}), str(tmp_path_factory.mktemp("tp2")))
    return dense, tp2


def test_tp2_trains_the_single_rank_loss_curve(tp_and_dense_runs):
    """The issue's check: 20 steps from the same initial weights on the same global batches, tp=2 against one
    rank; the losses agree to relative 1e-5 (the only difference is the order of the row-parallel sums)."""
    dense, tp2 = tp_and_dense_runs
    a, b = _losses(dense), _losses(tp2)
    assert len(a) == len(b) == 20 and all(math.isfinite(v) for v in a)
    rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    print(json.dumps({"tp2_vs_single_rank_max_rel_loss_diff": max(rel), "steps": len(rel)}))
    assert max(rel) < LOSS_RTOL, rel
    assert a[-1] < 0.8 * a[0]  # it learns
    # the consolidated weights have the dense names and shapes, and the values of the single-rank run
    wa, wb = (ckpt_weights(r.checkpoint_dir) for r in (dense, tp2))
    assert {n: t.shape for n, t in wa.items()} == {n: t.shape for n, t in wb.items()}
    for n in wa:
        torch.testing.assert_close(wb[n], wa[n], rtol=1e-3, atol=1e-5, msg=n)
    marker = json.loads((Path(tp2.checkpoint_dir) / "COMMITTED.json").read_text())
    files = {f["path"] for f in marker["files"]}  # the DeepSpeed checkpoint is per tp rank
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_0_mp_rank_01_optim_states.pt", "model.safetensors"} <= files


def ckpt_weights(tag_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(tag_dir) / "model.safetensors"))


@pytest.mark.slow  # one more launch of 2 ranks
def test_tp2_with_megatron_sequence_parallelism_trains_the_single_rank_loss_curve(tp_and_dense_runs, tokens, tmp_path):
    """tp=2 with Megatron's sequence parallelism (norms and residual adds on half the sequence, all-gather and
    reduce-scatter around the matmuls, the norms' gradients summed over the tp group) against one rank: 20
    steps agree to relative 1e-5, and the checkpoint's files and names are those of plain tp."""
    from lifecycle.tasks.train.launch import run_train

    dense, tp2 = tp_and_dense_runs
    r = run_train(tokens, tp_config(**TP_SEQ), str(tmp_path))
    a, b = _losses(dense), _losses(r)
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print(json.dumps({"tp2_sequence_parallel_vs_single_rank_max_rel_loss_diff": rel, "steps": len(b)}))
    assert len(b) == 20 and rel < LOSS_RTOL
    assert set(ckpt_weights(r.checkpoint_dir)) == set(ckpt_weights(tp2.checkpoint_dir))


def test_tp_checkpoint_converts_to_the_dense_state_with_adam_moments(tp_and_dense_runs):
    """`dense_from_checkpoint` on the tp=2 checkpoint: the fp32 master weights are the consolidated weights
    exactly, and the master weights and AdamW moments match the single-rank run's (read by the same function
    from its tp=1 checkpoint) to fp32 reduction-order tolerance."""
    from lifecycle.tasks.train.parallel.tp import dense_from_checkpoint

    dense, tp2 = tp_and_dense_runs
    got = dense_from_checkpoint(tp2.checkpoint_dir, TP_CFG.model.model_copy(update={"vocab_size": 384}))
    ref = dense_from_checkpoint(dense.checkpoint_dir, TP_CFG.model.model_copy(update={"vocab_size": 384}))
    weights = ckpt_weights(tp2.checkpoint_dir)
    assert set(got["fp32"]) == set(weights) == set(ref["fp32"])
    for n, t in weights.items():
        assert torch.equal(got["fp32"][n], t), n
        for kind, (rtol, atol) in {"fp32": (1e-3, 1e-5), "exp_avg": (1e-2, 1e-7), "exp_avg_sq": (1e-2, 1e-10)}.items():
            torch.testing.assert_close(got[kind][n], ref[kind][n], rtol=rtol, atol=atol, msg=f"{kind} {n}")
        assert got["step"][n].item() == ref["step"][n].item() == 20


@pytest.mark.slow  # ds_to_universal and a DeepSpeed engine on top of the two runs: about a minute idle
def test_deepspeed_universal_checkpoint_merges_our_tp_slices_as_the_converter_does(tp_and_dense_runs, tmp_path):
    """The plug-in for layout changes through DeepSpeed's universal checkpoint: the engine saved our
    `universal_checkpoint_info` into the tp checkpoint, and `ds_to_universal` merges the tp slices (fused GQA q/k/v
    with bias, SwiGLU gate|up, row-parallel proj/down) into exactly the dense tensors `dense_from_checkpoint` gives."""
    import subprocess
    import sys

    from lifecycle.tasks.train.parallel.tp import dense_from_checkpoint

    _, tp2 = tp_and_dense_runs
    out = tmp_path / "universal"
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(tp2.checkpoint_dir), "--output_folder", str(out), "--num_extract_workers", "1",
                           "--num_merge_workers", "1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    got = dense_from_checkpoint(tp2.checkpoint_dir, TP_CFG.model.model_copy(update={"vocab_size": 384}))
    for name, t in got["fp32"].items():
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            uc = torch.load(out / "zero" / name / f"{kind}.pt", weights_only=False)["param"]
            assert torch.equal(uc, got[kind][name]), f"{kind} {name}"


def test_a_tp_trained_model_exports_to_hf_as_a_dense_one_with_the_same_weights(tp_and_dense_runs, tokens, tmp_path):
    """`lifecycle export hf` of the tp=2 checkpoint against the export of a checkpoint a dense model with the same
    weights writes: the same model.safetensors in the checkpoint, and the same exported files, byte for byte."""
    from lifecycle.tasks.eval.export import export_hf
    from lifecycle.tasks.train import commit as ckpt

    _, tp2 = tp_and_dense_runs
    twin = tmp_path / "dense" / "step_00000020"
    twin.mkdir(parents=True)
    model = ckpt.load_model(tp2.checkpoint_dir)  # a plain GPT
    ckpt.commit(twin, 20, known=ckpt.write_model(twin, model.export_state(), model.cfg))
    assert (twin / "model.safetensors").read_bytes() == (Path(tp2.checkpoint_dir) / "model.safetensors").read_bytes()
    tok = _tokenizer(tokens)
    export_hf(tp2.checkpoint_dir, tmp_path / "hf_tp", tok)
    export_hf(twin, tmp_path / "hf_dense", tok)
    names = sorted(p.name for p in (tmp_path / "hf_tp").iterdir() if p.name != "lifecycle_export.json")
    assert "model.safetensors" in names and "config.json" in names
    assert names == sorted(p.name for p in (tmp_path / "hf_dense").iterdir() if p.name != "lifecycle_export.json")
    for name in names:
        assert (tmp_path / "hf_tp" / name).read_bytes() == (tmp_path / "hf_dense" / name).read_bytes(), name


@pytest.mark.slow  # three 20-step launches on 2 ranks: minutes on 2 shared cores
def test_tp2_resumes_exactly_after_a_sigkill(tmp_path):
    """Exact resume under tp=2 (ZeRO-2): SIGKILL the supervisor and both ranks after the first commit, rerun;
    the loss curve and the final consolidated weights are bitwise those of the uninterrupted run."""
    import time

    from lifecycle.tasks.train import commit as ckpt
    from tests import faults

    opts = {"accelerator": "cpu", "ranks": 2, "precision": "fp32", "init_from": "scratch",
            "model": {"dropout": 0.0, "n_head": 4, "n_kv_head": 2}, "parallel": {"tp": 2}, "max_steps": 20}

    def result(workdir: Path) -> dict:
        run = next((workdir / "train").iterdir())
        final = run / "checkpoints" / "step_00000020" / "model.safetensors"
        return {"losses": [(r["step"], r["loss"]) for r in faults.records(str(workdir), "train")],
                "weights": final.read_bytes() if final.exists() else None}

    tokdir = str(tmp_path / "tokens")
    ref = faults.launch(tokdir, str(tmp_path / "ref"), opts)
    ref.communicate()
    assert ref.returncode == 0
    want = result(tmp_path / "ref")
    assert want["weights"] is not None and len(want["losses"]) == 20

    proc = faults.launch(tokdir, str(tmp_path / "run"), opts)
    log = faults.wait_ready(proc, str(tmp_path / "run"))
    assert log is not None
    while proc.poll() is None and not [s for s, _ in ckpt.list_committed(log.parent / "checkpoints") if s >= 10]:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    faults.kill_all(proc)
    killed = [r["step"] for r in faults.records(str(tmp_path / "run"), "train")]
    assert killed and killed[-1] < 20
    again = faults.launch(tokdir, str(tmp_path / "run"), opts)
    out, _ = again.communicate()
    assert again.returncode == 0
    assert json.loads(out.strip().splitlines()[-1])["resumed_from"] >= 10
    got = result(tmp_path / "run")
    assert got["losses"] == want["losses"]
    assert got["weights"] == want["weights"]


@pytest.mark.slow  # three 20-step launches on 2 ranks
def test_tp2_with_sequence_parallelism_resumes_exactly_after_a_sigkill(tokens, tmp_path):
    """tp=2 with Megatron's sequence parallelism (ZeRO-1): SIGKILL the supervisor and both ranks after the step-10
    commit, rerun: every loss and the final consolidated weights are the uninterrupted run's, bit for bit."""
    from lifecycle.tasks.train.launch import run_train
    from tests.train.sigkill import resumes_exactly

    ref = run_train(tokens, tp_config(**TP_SEQ), str(tmp_path / "ref"))
    resumes_exactly(tmp_path, "tests.train.test_parallel_tp:tp_config", TP_SEQ, ref, docs=1500)


def _dense_continue_worker(rank: int, port: int, launch_path: str, universal_root: str, tag: str, out: str) -> None:
    """One rank, tp=1: a DeepSpeed engine as the trainer builds it, loaded from the universal checkpoint (what
    lifecycle.tasks.train's layout change does), then the remaining steps on the sampler's batches."""
    import os

    import deepspeed
    import torch.distributed as dist

    from lifecycle.tasks.data.tokenize.stage import TokenShards
    from lifecycle.tasks.train.engine import ds_config, stub_muon
    from lifecycle.tasks.train.loader import get_batch

    torch.set_num_threads(1)
    launch = json.loads(Path(launch_path).read_text())
    data = launch["train"]
    data["parallel"]["tp"], data["batch"]["num_ranks"] = 1, 1  # the same global batch: dp=1 either way
    cfg = TrainConfig.model_validate(data)
    stub_muon()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")  # the rank environment DeepSpeed's engine asks for
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() >= 2],
                                    "weight_decay": opt.weight_decay},
                                   {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=opt.lr, betas=opt.betas)
    schedule = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: cfg.lr_at(s) / opt.lr)  # noqa: E731
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                           config=ds_config(cfg))
    engine._config.load_universal_checkpoint = True
    _, client_state = engine.load_checkpoint(universal_root, tag=tag)
    shards = TokenShards.model_validate(launch["tokens"])
    losses = []
    for step in range(client_state["step"], cfg.max_steps):
        x, y = get_batch(shards, cfg, step, 0, 0)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    Path(out).write_text(json.dumps({"from": client_state["step"], "losses": losses}))
    dist.destroy_process_group()


@pytest.mark.slow  # ds_to_universal and a DeepSpeed engine on top of the two runs: about a minute idle
def test_tp2_checkpoint_continues_under_tp1_through_the_universal_checkpoint(tp_and_dense_runs, tmp_path):
    """Layout change tp=2 -> tp=1: the tp=2 run's step-10 checkpoint through `ds_to_universal` (our
    `universal_checkpoint_info` tells it how to merge the slices), loaded with the optimizer state into a dense
    one-rank engine, trains steps 11-20 with the losses of the uninterrupted tp=2 run (issue bound: 1e-4)."""
    import subprocess
    import sys

    import torch.multiprocessing as mp

    _, tp2 = tp_and_dense_runs
    src = Path(tp2.checkpoint_dir).parent / "step_00000010"
    out = tmp_path / "universal" / src.name
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src),
                           "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = tmp_path / "continued.json"
    mp.spawn(_dense_continue_worker, args=(free_port(), str(Path(tp2.run_dir) / "config.json"),
                                           str(out.parent), out.name, str(result)), nprocs=1, join=True)
    got = json.loads(result.read_text())
    want = [r["loss"] for r in _records(tp2.metrics_path, "train") if r["step"] > 10]
    assert got["from"] == 10 and len(got["losses"]) == len(want) == 10
    rel = max(abs(a - b) / b for a, b in zip(got["losses"], want))
    print(json.dumps({"tp2_to_tp1_resume_max_rel_loss_diff": rel, "steps": len(want)}))
    assert rel < 1e-4
