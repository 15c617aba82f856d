"""Mixture of experts with expert parallelism (lifecycle.tasks.train.parallel.moe).

Fast: the config's refusals, FLOPs counting top_k experts, DeepSpeed's MoE layer against our all-experts MoEMLP
(routing, capacity drops counted, the load-balancing loss) on one gloo rank and split over two (ep=2: DeepSpeed's
all-to-all on gloo, forward and backward), and the Mixtral export. Then real launches: ep=2 on 2 CPU ranks against
one rank holding all experts, 20 steps; exact resume of an ep=2 run under SIGKILL (slow).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from lifecycle.core.procs import free_port
from lifecycle.tasks.train.config import ModelConfig, MoEArch, TrainConfig

MOE = {"num_experts": 4, "top_k": 2, "ep": 2, "capacity_factor": 1.0, "aux_loss_weight": 0.01}


# --------------------------------------------------------------------------------------------------
# config


@pytest.mark.parametrize("over, message", [
    ({"moe": {"num_experts": 4, "ep": 3}, "batch": {"num_ranks": 3}}, r"num_experts \(4\) must be divisible by train.moe.ep"),
    ({"moe": {"num_experts": 4, "ep": 2}, "batch": {"num_ranks": 1}}, r"must divide the data-parallel degree \(1\)"),
    ({"moe": {"num_experts": 2, "top_k": 3}}, r"top_k \(3\) must not exceed"),
    ({"moe": {"num_experts": 4}, "engine": {"zero_stage": 3}}, "not supported under ZeRO-3"),
    ({"moe": {"num_experts": 4}, "engine": {"activation_checkpointing": True}}, "load-balancing loss"),
    ({"moe": {"num_experts": 4, "ep": 2}, "engine": {"zero_stage": 0}}, "not the global norm"),
    ({"moe": {"num_experts": 4, "every": 5}}, "no block would get an MoE MLP"),
    ({"moe": {"num_experts": 4}, "model": {"moe": {"num_experts": 4}}}, "set train.moe instead"),
])
def test_what_does_not_compose_with_experts_is_refused_with_the_reason(over, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.model_validate(over)


def test_dense_config_and_fingerprint_are_unchanged_and_moe_goes_into_the_architecture():
    dense = TrainConfig.model_validate({})
    assert "moe" not in dense.model.model_dump() and "moe" not in json.loads(dense.model.model_dump_json())
    assert dense.model_arch is dense.model
    cfg = TrainConfig.model_validate({"moe": MOE, "engine": {"zero_stage": 2}})
    arch = cfg.model_arch
    assert arch.moe == MoEArch(num_experts=4, top_k=2, every=1)
    assert ModelConfig.model_validate_json(arch.model_dump_json()) == arch  # model_config.json round trip
    for stage in (1, 2):
        TrainConfig.model_validate({"moe": MOE, "engine": {"zero_stage": stage}})
    TrainConfig.model_validate({"moe": MOE, "engine": {"zero_stage": 0}, "optimizer": {"grad_clip": 0}})
    TrainConfig.model_validate({"moe": {**MOE, "ep": 1}, "engine": {"zero_stage": 0}})  # replicated experts


def test_flops_per_token_count_top_k_experts_not_all():
    from lifecycle.tasks.train.model import GPT

    base = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=32, seq_len=16)
    dense = GPT(ModelConfig(**base))
    for k in (1, 2):
        moe = GPT(ModelConfig(**base, moe=MoEArch(num_experts=4, top_k=k)))
        expert = sum(p.numel() for p in dense.blocks[0].mlp.parameters())
        gates = 2 * 4 * 32
        assert moe.num_params() == dense.num_params() + 2 * 3 * expert + gates  # all experts are parameters
        assert moe.flops_per_token() == dense.flops_per_token() + 6 * (2 * (k - 1) * expert + gates)
    half = GPT(ModelConfig(**base, moe=MoEArch(num_experts=4, top_k=1, every=2)))
    assert type(half.blocks[0].mlp).__name__ == "MLP" and type(half.blocks[1].mlp).__name__ == "MoEMLP"


# --------------------------------------------------------------------------------------------------
# the layer: DeepSpeed's MoE against MoEMLP, 1 and 2 gloo ranks


def _layer_worker(rank: int, world: int, init: str, out: str, top_k: int, capacity_factor: float) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.comm as ds_dist
    import torch.distributed as dist

    from lifecycle.tasks.train.model import MLP
    from lifecycle.tasks.train.parallel import moe

    host, port = init.removeprefix("tcp://").split(":")
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, n_embd=16, n_head=2, mlp="swiglu", moe=MoEArch(num_experts=4, top_k=top_k))
    local = moe.MoEMLP(cfg, lambda: MLP(cfg))
    with torch.no_grad():
        local.gate.weight.mul_(50)  # a confident router: routes far from ties
    tokens = torch.randn(world, 2, 24, 16)  # every rank draws all ranks' tokens (same seed); uses its own
    train_cfg = TrainConfig.model_validate({"moe": {"num_experts": 4, "top_k": top_k, "ep": world,
                                                    "capacity_factor": capacity_factor},
                                            "batch": {"num_ranks": world}})
    from lifecycle.tasks.train.model import GPT

    holder = type("Holder", (torch.nn.Module,), {"export_state": GPT.export_state})()
    holder.mlp = local
    [layer] = moe.install(holder, train_cfg)
    layer.train()
    x = tokens[rank].clone().requires_grad_(True)
    y = holder.mlp(x)
    y.square().sum().backward()
    routed, kept = moe.take_counts(holder)
    # the reference: all experts here, every rank's tokens, no capacity
    ref_x = tokens.clone().requires_grad_(True)
    ref_y = local(ref_x)
    ref_y.square().sum().backward()
    L = 4 // world
    got = {"y_diff": (y - ref_y[rank]).abs().max().item(), "x_grad_diff": (x.grad - ref_x.grad[rank]).abs().max().item(),
           "routed": routed.tolist(), "kept": kept.tolist(), "l_aux": layer.l_aux.item()}
    # expert gradients: this rank's experts saw every rank's tokens through the all-to-all
    got["expert_grad_diff"] = max(
        (p.grad - q.grad).abs().max().item()
        for i, e in enumerate(layer.deepspeed_moe.experts.deepspeed_experts)
        for p, q in zip(e.parameters(), local.experts[rank * L + i].parameters()))
    state = moe.consolidated_state(holder)
    if rank == 0:
        got["consolidated"] = sorted(state)
        got["consolidated_diff"] = max((state[k] - v).abs().max().item() for k, v in
                                       {"mlp.gate.weight": local.gate.weight,
                                        **{f"mlp.experts.{j}.up.weight": local.experts[j].up.weight for j in range(4)},
                                        **{f"mlp.experts.{j}.down.weight": local.experts[j].down.weight
                                           for j in range(4)}}.items())
    # the load-balancing loss and the capacity, recomputed from the router's logits of this rank's tokens
    h = tokens[rank].reshape(-1, 16)
    probs = torch.softmax(h @ local.gate.weight.T, dim=-1)
    idx = torch.topk(probs, top_k, dim=-1).indices
    first = torch.bincount(idx[:, 0], minlength=4).float() / h.shape[0]
    counts = torch.bincount(idx.flatten(), minlength=4)
    got["l_aux_ref"] = (4 * (probs.mean(0) * first).sum()).item()
    got["routed_ref"] = counts.tolist()
    capacity = max(moe.MIN_CAPACITY, int(torch.ceil(torch.tensor(h.shape[0] / 4 * capacity_factor * top_k))))
    got["kept_ref"] = counts.clamp(max=capacity).tolist()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)
    ds_dist.barrier()
    dist.destroy_process_group()


def _run_layer(tmp_path, world: int, top_k: int, capacity_factor: float) -> list[dict]:

    import torch.multiprocessing as mp

    port = free_port()
    out = str(tmp_path / "got")
    mp.spawn(_layer_worker, args=(world, f"tcp://127.0.0.1:{port}", out, top_k, capacity_factor), nprocs=world)
    return [json.load(open(f"{out}.{r}")) for r in range(world)]


@pytest.mark.parametrize("world, top_k", [(1, 1), (1, 2), (2, 2)])
def test_deepspeed_moe_layer_equals_all_experts_in_one_process_when_nothing_is_dropped(tmp_path, world, top_k):
    """Capacity factor num_experts/top_k: every expert may take every token. DeepSpeed's layer (ep = world, its
    all-to-all over gloo for world 2) gives MoEMLP's output, input gradient and expert gradients; the
    load-balancing loss is GShard's; the consolidated state holds all experts under MoEMLP's names."""
    results = _run_layer(tmp_path, world, top_k, capacity_factor=4 / top_k)
    for got in results:
        assert got["y_diff"] < 1e-5 and got["x_grad_diff"] < 1e-5 and got["expert_grad_diff"] < 1e-4
        assert got["routed"] == got["routed_ref"] == got["kept"]  # no drops
        assert got["l_aux"] == pytest.approx(got["l_aux_ref"], rel=1e-5)
    zero = results[0]
    assert zero["consolidated_diff"] == 0
    assert zero["consolidated"] == sorted(["mlp.gate.weight"] + [f"mlp.experts.{j}.{m}.weight" for j in range(4)
                                                                 for m in ("up", "down")])


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_drops_are_counted_per_expert(tmp_path, top_k):
    """Capacity factor 0.5: an expert keeps at most ceil(tokens·top_k/E · 0.5) routes (at least 4); the counts
    say how many each expert was sent and kept, so dropped = routed - kept."""
    [got] = _run_layer(tmp_path, 1, top_k, capacity_factor=0.5)
    assert got["routed"] == got["routed_ref"] and got["kept"] == got["kept_ref"]
    assert sum(got["routed"]) == 48 * top_k and sum(r - k for r, k in zip(got["routed"], got["kept"])) > 0


# --------------------------------------------------------------------------------------------------
# export: MixtralForCausalLM


def _committed_moe(tmp_path, **moe_kw):
    from lifecycle.tasks.train import commit as ckpt
    from lifecycle.tasks.train.model import GPT

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=400, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, seq_len=32,
                      moe=MoEArch(**{"num_experts": 4, "top_k": 2, **moe_kw}))
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # a router with preferences: a wrong expert order or weighting shows
    tag = tmp_path / "checkpoints" / "step_00000001"
    tag.mkdir(parents=True)
    ckpt.write_model(tag, model.export_state(), cfg)
    ckpt.commit(tag, 1)
    return tag, model.eval()


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, new_bpe
    from tests.conftest import corpus_records

    tok, trainer = new_bpe(TokenizeConfig(vocab_size=400))
    tok.train_from_iterator([[r["text"] for r in corpus_records(30)]], trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_moe_exports_as_mixtral_with_the_dense_logits_tolerance(tmp_path, tokenizer_file):
    from transformers import AutoModelForCausalLM

    from lifecycle.tasks.eval.export import export_hf
    from lifecycle.tasks.train import commit as ckpt

    tag, ours = _committed_moe(tmp_path)
    assert type(ckpt.load_model(tag).blocks[0].mlp).__name__ == "MoEMLP"  # the checkpoint rebuilds the experts
    report = export_hf(tag, tmp_path / "hf", tokenizer_file)
    assert report["architecture"] == "MixtralForCausalLM" and report["max_abs_logit_diff_fp32"] <= 1e-4
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM" and hf.config.num_local_experts == 4
    ids = torch.randint(0, 400, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids)[0] - hf(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-4
    # the experts are really used, and in our order: swapping two experts' weights changes HF's logits
    with torch.no_grad():
        e = hf.model.layers[0].mlp.experts
        e.down_proj[[0, 1]] = e.down_proj[[1, 0]].clone()
        assert (ours(ids)[0] - hf(input_ids=ids).logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("kw, message", [({"top_k": 1}, "moe.top_k=1"), ({"every": 2}, "moe.every=2")])
def test_moe_models_mixtral_cannot_compute_are_refused(tmp_path, tokenizer_file, kw, message):
    from lifecycle.tasks.eval.export import ExportError, export_hf

    tag, _ = _committed_moe(tmp_path, **kw)
    with pytest.raises(ExportError, match=message):
        export_hf(tag, tmp_path / "hf", tokenizer_file)


def test_dropped_routes_per_expert_become_one_mlflow_series_each():
    from lifecycle.flows.pipeline import _per_expert

    rows = [{"step": 1, "loss": 3.0, "moe_dropped_per_expert": [0, 5, 1]}, {"step": 2, "loss": 2.0}]
    assert _per_expert(rows) == ["moe_dropped_e0", "moe_dropped_e1", "moe_dropped_e2"]
    assert rows[0]["moe_dropped_e1"] == 5 and "moe_dropped_e0" not in rows[1]
    assert _per_expert([{"step": 1, "loss": 1.0}]) == []


# --------------------------------------------------------------------------------------------------
# real launches (run_train, gloo CPU ranks)


def moe_cfg(ranks: int, ep: int, **over) -> TrainConfig:
    """Tiny SwiGLU model, 4 experts top-2 in every block, capacity factor 1 (tokens are dropped), global batch
    16 sequences: 2 ranks × 8, or 1 rank × 8 × 2 accumulated micro-batches (the same sequences, the same
    per-micro-batch token groups for the router's capacity)."""
    data = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "seq_len": 64}, "max_steps": 20,
            "optimizer": {"decay_steps": 40, "warmup_steps": 5, "lr": 3e-3, "min_lr": 3e-4},
            "batch": {"micro_batch_size": 8, "num_ranks": ranks, "grad_accum": 2 // ranks},
            "engine": {"zero_stage": 2, "precision": "fp32"},
            "moe": {**MOE, "ep": ep}, "checkpoint": {"every": 10, "keep_last": 2}, "logging": {"every": 1},
            "launch": {"threads_per_rank": 1, "timeout_s": 600}}
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return TrainConfig.model_validate(data)


def _train(path):
    return [r for r in map(json.loads, open(path)) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.train.test_train import make_tokens

    return make_tokens(tmp_path_factory.mktemp("moe_tokens"), 600)


def test_ep2_on_two_ranks_trains_the_single_rank_curve(tokens, tmp_path):
    """20 steps from the same initial weights on the same global batches: ep=2 over 2 gloo ranks (DeepSpeed's
    all-to-all) against 1 rank holding all 4 experts. Loss curves agree to relative 1e-5; each record has the
    load-balancing loss and the routes dropped per expert; the consolidated checkpoint holds all experts."""
    from safetensors.torch import load_file

    from lifecycle.tasks.train import commit as ckpt
    from lifecycle.tasks.train.launch import run_train

    # At capacity factor 1 a route whose gate value ties another's within float rounding is kept on one layout and
    # dropped on the other (ep=2's experts see both ranks' tokens in one matmul): a step with one route apart parts
    # the curves for good. Packed attention's trajectory here has no such tie; document attention's (the default)
    # has one at step 13 (966 routes dropped against 965, 2.6e-4 by step 20), so it is compared without drops.
    packed = {"model": {**moe_cfg(1, 1).model.model_dump(exclude_unset=True), "attention": "packed"}}
    one = run_train(tokens, moe_cfg(1, 1, **packed), str(tmp_path / "one"))
    two = run_train(tokens, moe_cfg(2, 2, **packed), str(tmp_path / "two"))
    a, b = _train(one.metrics_path), _train(two.metrics_path)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 21))
    rel = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))
    print(f"ep=2 vs 1 rank, 20 steps: max relative loss difference {rel:.3g}")
    assert rel <= 1e-5
    roomy = {"moe": {**MOE, "capacity_factor": 4.0}}  # document attention, nothing dropped
    doc = [_train(run_train(tokens, moe_cfg(n, n, moe={**roomy["moe"], "ep": n}), str(tmp_path / f"doc{n}"))
                  .metrics_path) for n in (1, 2)]
    assert all(r["moe_dropped"] == 0 for r in doc[0] + doc[1])
    rel_doc = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(*doc))
    print(f"document attention, no drops: max relative loss difference {rel_doc:.3g}")
    assert rel_doc <= 1e-5
    assert b[-1]["loss"] < 0.8 * b[0]["loss"]
    for r in a + b:
        assert r["moe_aux_loss"] > 0 and len(r["moe_dropped_per_expert"]) == 4
        assert sum(r["moe_routed_per_expert"]) == 16 * 64 * 2 * 2  # tokens × top_k × MoE layers
        assert r["moe_dropped"] == sum(r["moe_dropped_per_expert"]) >= 0
    assert any(r["moe_dropped"] > 0 for r in b)  # capacity factor 1 drops routes
    assert a[0]["flops_per_token"] == b[0]["flops_per_token"]
    wa, wb = load_file(f"{one.checkpoint_dir}/model.safetensors"), load_file(f"{two.checkpoint_dir}/model.safetensors")
    assert sorted(wa) == sorted(wb) and {f"blocks.1.mlp.experts.{j}.up.weight" for j in range(4)} <= set(wb)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4
    assert json.loads(open(f"{two.checkpoint_dir}/model_config.json").read())["moe"]["num_experts"] == 4
    files = {f["path"] for f in ckpt.read_marker(two.checkpoint_dir)["files"]}  # DeepSpeed: a file per expert
    assert {f"layer_{i}_expert_{j}_mp_rank_00_model_states.pt" for i in (0, 1) for j in range(4)} <= files


@pytest.mark.slow
def test_ep2_resumes_exactly_after_sigkill(tmp_path):
    """ep=2 on 2 ranks, 40 steps, commits every 5: SIGKILL the whole run (supervisor and ranks) once step 10 is
    committed, rerun; and SIGKILL rank 1 alone after step 25, rerun (the memory tier's restore). Both give the
    uninterrupted run's loss curve and final weights bit for bit, with the expert states restored per ep rank."""
    import time

    from lifecycle.tasks.train import commit as ckpt
    from tests.faults import kill_all, kill_rank_and_relaunch, launch, records, result, wait_ready

    tokdir = str(tmp_path / "tokens")
    opts = {"accelerator": "cpu", "ranks": 2, "precision": "fp32", "init_from": "scratch", "moe": {**MOE, "ep": 2}}
    ref_dir = str(tmp_path / "ref")
    launch(tokdir, ref_dir, opts).communicate()
    ref = result(ref_dir)
    assert ref["weights"] is not None and len(ref["losses"]) == 40
    assert all("moe_dropped_per_expert" in r for r in records(ref_dir, "train"))

    killed = str(tmp_path / "killed")
    proc = launch(tokdir, killed, opts)
    log = wait_ready(proc, killed)
    while not [s for s, _ in ckpt.list_committed(log.parent / "checkpoints") if s >= 10]:
        assert proc.poll() is None, "the run ended before its step-10 commit"
        time.sleep(0.01)
    kill_all(proc)
    assert not (log.parent / "checkpoints" / "step_00000040").exists()
    launch(tokdir, killed, opts).communicate()
    [restore] = records(killed, "restore")
    assert 10 <= restore["step"] < 40
    got = result(killed)
    assert got["losses"] == ref["losses"] and got["weights"] == ref["weights"]

    rank_dir = str(tmp_path / "rank")
    info = kill_rank_and_relaunch(tokdir, rank_dir, opts, after_step=25)
    assert info["rc"] == 0 and info["restore"]["step"] >= 25
    got = result(rank_dir)
    assert got["losses"] == ref["losses"] and got["weights"] == ref["weights"]
