"""Pipeline parallelism (lifecycle.tasks.train.parallel.pp).

Fast: the config refusals, the layer specs against the dense GPT (forward and backward, one process), the
partition, and two gloo processes running a real DeepSpeed PipelineModule (dense-name export gathered to rank 0,
the first step's loss through the 1F1B schedule equal to the dense model's).
Launched (2 CPU ranks, gloo, through run_train): pp=2 against a single rank over 20 steps on the same global
batches; the consolidated weights export like a dense run's; pp=2 -> pp=1 conversion and resume; SIGKILL resume.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from lifecycle.core.procs import free_port
from lifecycle.tasks.train.config import ModelConfig, TrainConfig

TINY = ModelConfig(n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=97)


# --------------------------------------------------------------------------------------------------
# config


@pytest.mark.parametrize("over, message", [
    ({"batch": {"num_ranks": 2}, "parallel": {"pp": 2}, "engine": {"zero_stage": 2}},
     "train.parallel.pp=2 with train.engine.zero_stage=2: DeepSpeed's pipeline engine runs ZeRO-0 and ZeRO-1 only"),
    ({"batch": {"num_ranks": 2}, "parallel": {"pp": 2}, "engine": {"zero_stage": 3}}, "zero_stage=3"),
    ({"batch": {"num_ranks": 8}, "parallel": {"pp": 8}, "engine": {"zero_stage": 1}, "model": {"n_layer": 4}},
     "every pipeline stage needs at least one block"),
    ({"batch": {"num_ranks": 3}, "parallel": {"pp": 2}, "engine": {"zero_stage": 1}}, "must be a multiple"),
])
def test_pipeline_layouts_that_cannot_run_are_refused_with_the_reason(over, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.model_validate(over)


def test_pp_composes_with_dp():
    cfg = TrainConfig.model_validate({"batch": {"num_ranks": 4, "micro_batch_size": 2, "grad_accum": 3},
                                      "parallel": {"pp": 2}, "engine": {"zero_stage": 1}})
    assert cfg.dp == 2 and cfg.global_batch == 2 * 3 * 2


# --------------------------------------------------------------------------------------------------
# the layers, one process


def _sequential(cfg: ModelConfig, model):
    """The pipeline's layers built from the specs and run in order, without DeepSpeed's module."""
    from deepspeed.pipe import TiedLayerSpec

    from lifecycle.tasks.train.parallel import pp

    tied, layers, names = {}, [], {}
    for idx, spec in enumerate(pp.layer_specs(cfg)):
        if isinstance(spec, TiedLayerSpec):
            module = tied.setdefault(spec.key, spec.build())
            layers.append(module if spec.forward_fn is None else (lambda f, m: lambda x: f(m, x))(spec.forward_fn, module))
        else:
            module = spec.build()
            layers.append(module)
        for local, p in module.named_parameters():
            names[pp.layer_prefix(cfg, idx) + local] = p
    state = model.export_state()
    with torch.no_grad():
        for name, p in names.items():
            p.copy_(state[name])
    return layers, names


EOT = 0


def _with_documents(x: torch.Tensor) -> torch.Tensor:
    """x with end-of-text ids at fixed places: three documents in the first window, two in the second."""
    x = x.clone().clamp(min=1)
    x[0, [3, 9]] = EOT
    x[1, 6] = EOT
    return x


@pytest.mark.parametrize("sep", [None, EOT], ids=["packed", "document"])
@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": False, "pos": "learned", "norm": "layernorm", "mlp": "gelu"}])
def test_layer_specs_compute_the_dense_model(changes, sep):
    """Embedding, input, blocks, norm and head in sequence give GPT's logits, loss and gradients (tied head:
    the embedding's gradient sums both uses, as in GPT); with document attention too (the ids travel with the
    activations to every block)."""
    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.parallel import pp

    cfg = TINY.model_copy(update=changes)
    torch.manual_seed(0)
    model = GPT(cfg)
    layers, params = _sequential(cfg, model)
    assert set(params) == set(model.export_state())
    x, y = _with_documents(torch.randint(0, 97, (3, 16))), torch.randint(0, 97, (3, 16))
    if sep is not None:
        model.doc_sep = sep
        pp.set_doc_sep(torch.nn.ModuleList(m for m in layers if isinstance(m, torch.nn.Module)), sep)
    h = x
    for layer in layers:
        h = layer(h)
    loss = pp.lm_loss(h, y)
    logits, ref = model(x, y)
    torch.testing.assert_close(h, logits, rtol=0, atol=0)
    assert loss.item() == ref.item()
    loss.backward()
    ref.backward()
    dense = dict(model.named_parameters())
    for name, p in params.items():
        torch.testing.assert_close(p.grad, dense[name].grad, rtol=1e-6, atol=1e-7, msg=name)


def test_blocks_are_split_evenly_and_the_names_follow_the_dense_model():
    from lifecycle.tasks.train.parallel import pp

    cfg = TINY.model_copy(update={"n_layer": 5})
    parts = pp.partition(cfg, 2)  # layers: embed, input, 5 blocks, norm, head
    blocks = [sum(2 <= i < 7 for i in range(parts[s], parts[s + 1])) for s in range(2)]
    assert parts[0] == 0 and parts[-1] == 9 and sorted(blocks) == [2, 3]
    assert [pp.layer_prefix(cfg, i) for i in (0, 1, 2, 6, 7, 8)] == ["", "", "blocks.0.", "blocks.4.", "", ""]
    names = [pp.stage_param_names(cfg, 2, s) for s in range(2)]
    assert names[0][0] == "wte.weight" and names[1][0] == "wte.weight"  # the tied copy comes first on the last stage
    assert "norm_f.weight" in names[1] and "blocks.0.attn.qkv.weight" in names[0]


# --------------------------------------------------------------------------------------------------
# two gloo processes, a real PipelineModule


def _pipe_worker(rank: int, port: int, out: str, tie: bool, sep: int | None = None) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"})
    import deepspeed
    import torch.distributed as dist

    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.parallel import pp

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = TINY.model_copy(update={"tie_embeddings": tie})
    torch.manual_seed(0)
    model = GPT(cfg)
    model.doc_sep = sep
    # with documents, each block recomputed in backward too: the (activations, ids) tuple goes through checkpoint
    pipe = pp.pipeline_module(model, pp=2, dp=1, activation_checkpointing=sep is not None)
    stage = pipe.stage_id
    order = [pipe.dense_names().get(n, "wte.weight") for n, _ in pipe.named_parameters()]
    exported = pipe.export_state()
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=torch.optim.AdamW(pipe.parameters(), lr=1e-3), config={
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True})
    g = torch.Generator().manual_seed(1)
    batches = [(_with_documents(torch.randint(0, 97, (2, 16), generator=g)), torch.randint(0, 97, (2, 16), generator=g))
               for _ in range(2)]
    evaluated = pp.eval_loss(engine, *batches[1])
    loss = pp.forward_backward(engine, batches)
    ref = sum(model(x, y)[1].item() for x, y in batches) / 2
    result = {"stage": stage, "order": order, "expected_order": pp.stage_param_names(cfg, 2, stage),
              "loss": loss, "ref": ref, "eval": evaluated, "eval_ref": model(*batches[1])[1].item()}
    model.doc_sep = None
    result["packed_ref"] = sum(model(x, y)[1].item() for x, y in batches) / 2
    if rank == 0:
        dense = model.export_state()
        result["export_equal"] = sorted(exported) == sorted(dense) and all(torch.equal(exported[k], dense[k]) for k in dense)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("tie, sep", [(True, None), (True, EOT), pytest.param(False, None, marks=pytest.mark.slow)],
                         ids=["tied", "tied-document", "untied"])
def test_a_two_stage_pipeline_exports_the_dense_weights_and_computes_the_dense_loss(tmp_path, tie, sep):
    """Two gloo ranks, one stage each: rank 0 gathers model.safetensors' dense state (equal to GPT's), the
    stages' parameter order is what the converter assumes, and the first step's loss (before any update) and
    an eval loss equal the dense model's on the same micro-batches, on both ranks (DeepSpeed broadcasts it).
    With document attention (and activation checkpointing) the second stage's blocks mask by the ids the first
    stage sends: the loss is the dense document-aware model's, not the packed one's."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "r")
    mp.start_processes(_pipe_worker, args=(free_port(), out, tie, sep), nprocs=2, start_method="spawn")
    got = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert [g["stage"] for g in got] == [0, 1]
    assert got[0]["export_equal"]
    for g in got:
        assert g["order"] == g["expected_order"]
        assert math.isclose(g["loss"], g["ref"], rel_tol=1e-6) and math.isclose(g["eval"], g["eval_ref"], rel_tol=1e-6)
    assert got[0]["loss"] == got[1]["loss"]
    if sep is not None:  # the documents change the loss, so a stage that ignored them would fail the check above
        assert not math.isclose(got[0]["ref"], got[0]["packed_ref"], rel_tol=1e-4)


# --------------------------------------------------------------------------------------------------
# launched: 2 CPU ranks through run_train


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.train.test_train import make_tokens

    return make_tokens(tmp_path_factory.mktemp("tokens"), 600)


def pp_config(ranks: int = 2, pp: int = 2, zero: int = 1, **changes) -> TrainConfig:
    """20 steps of the tiny model, global batch 8 = micro 4 × grad_accum 2 × dp 1 (the pipeline's two
    micro-batches per step); `ranks=1, pp=1` is the single-rank run over the same global batches."""
    data = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "seq_len": 64}, "max_steps": 20,
            "optimizer": {"decay_steps": 40, "warmup_steps": 5, "lr": 3e-3, "min_lr": 3e-4},
            "batch": {"micro_batch_size": 4, "grad_accum": 2, "num_ranks": ranks}, "parallel": {"pp": pp},
            "engine": {"zero_stage": zero, "precision": "fp32"}, "checkpoint": {"every": 10, "keep_last": 2},
            "logging": {"every": 1, "eval_every": 10, "eval_batches": 2},
            "launch": {"threads_per_rank": 1, "timeout_s": 900}}
    for path, value in changes.items():
        *sections, name = path.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return TrainConfig.model_validate(data)


def _records(path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, open(path)) if r["kind"] == kind]


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tokens, tmp_path_factory):
    """The single-rank reference and the pp=2 run (ZeRO-1), 20 steps each, in their own work directories."""
    from lifecycle.tasks.train.launch import run_train

    root = tmp_path_factory.mktemp("runs")
    return {"dense": run_train(tokens, pp_config(ranks=1, pp=1), str(root / "dense")),
            "pp": run_train(tokens, pp_config(), str(root / "pp"))}


def test_pp2_trains_the_single_rank_loss_curve_and_exports_the_same_model(runs, tokens, tmp_path):
    """pp=2 (one block per stage, tied embeddings across the stages) against one rank: same initial weights, same
    global batches; the loss of every step and the validation losses agree within fp32 tolerance (the pipeline
    only reorders the reductions: the tied embedding's two gradient halves are summed by an all-reduce, and the
    gradient norm is summed over the stages). The consolidated checkpoint has the dense names, and
    `lifecycle export hf` of it matches the dense run's export."""
    from safetensors.torch import load_file

    from lifecycle.tasks.eval.export import export_hf
    from lifecycle.tasks.train import commit as ckpt

    dense, pipe = runs["dense"], runs["pp"]
    a = [r["loss"] for r in _records(pipe.metrics_path, "train")]
    b = [r["loss"] for r in _records(dense.metrics_path, "train")]
    assert len(a) == 20 and a[-1] < 0.8 * a[0]
    rel = _max_rel(a, b)
    print(f"pp=2 vs single rank, 20 steps: max relative loss difference {rel:.3g}")
    assert rel < 1e-5
    assert _max_rel([r["val_loss"] for r in _records(pipe.metrics_path, "eval")],
                    [r["val_loss"] for r in _records(dense.metrics_path, "eval")]) < 1e-5
    marker = ckpt.read_marker(pipe.checkpoint_dir)
    files = {f["path"] for f in marker["files"]}
    assert {"layer_00-model_states.pt", "layer_04-model_states.pt", "mp_rank_00_model_states.pt",
            "mp_rank_01_model_states.pt", "model.safetensors"} <= files
    ours, theirs = (load_file(str(Path(r.checkpoint_dir) / "model.safetensors")) for r in (pipe, dense))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-4
    tok = Path(tokens.path) / "tokenizer.json"
    reports = [export_hf(r.checkpoint_dir, tmp_path / name, tok) for name, r in (("pp", pipe), ("dense", dense))]
    assert all(rep["max_abs_logit_diff_fp32"] <= 1e-4 for rep in reports)
    hf = [load_file(str(tmp_path / name / "model.safetensors")) for name in ("pp", "dense")]
    assert sorted(hf[0]) == sorted(hf[1])
    assert max((hf[0][k] - hf[1][k]).abs().max().item() for k in hf[0]) < 1e-4


@pytest.mark.slow  # two launches of 2 ranks
def test_pp2_resumes_exactly_after_a_sigkill(runs, tmp_path):
    """SIGKILL the supervisor and both stages after the step-10 commit, rerun: the resumed run's loss curve and
    final weights are the uninterrupted pp=2 run's, bit for bit (tests/train/sigkill.py)."""
    from tests.train.sigkill import resumes_exactly

    resumes_exactly(tmp_path, "tests.train.test_parallel_pp:pp_config", {}, runs["pp"])


@pytest.mark.slow  # two launches
def test_pp2_checkpoint_converts_to_a_dense_run_that_continues_the_loss(runs, tokens, tmp_path):
    """pp=2 -> pp=1: the step-10 pipeline checkpoint (ZeRO-1 partitions of both stages) becomes a dense ZeRO-0
    engine state (weights, Adam moments, step, LR schedule, sampler position); a single-rank run resumed from it
    continues the pipeline run's loss curve within 1e-4 over steps 11-20."""
    import shutil

    from safetensors.torch import load_file

    from lifecycle.tasks.train import commit as ckpt
    from lifecycle.tasks.train.launch import run_train
    from lifecycle.tasks.train.parallel import pp_convert as pp

    src_tag = Path(runs["pp"].checkpoint_dir).parent / ckpt.tag_name(10)
    src = {"dp": 1, "zero": 1, "micro": 4, "accum": 2, "pp": 2}
    dst = {"dp": 1, "zero": 0, "micro": 4, "accum": 2}
    assert pp.dense_reason(src, {**dst, "zero": 1}) is not None and pp.dense_reason(dst, dst) is not None
    # the dense run's directory: a one-step run of the same trajectory creates it (max_steps is not in its key)
    dense_cfg = pp_config(ranks=1, pp=1, zero=0)
    first = run_train(tokens, dense_cfg.model_copy(update={"max_steps": 1}), str(tmp_path))
    root = Path(first.checkpoint_dir).parent
    shutil.rmtree(root)
    dst_tag = root / ckpt.tag_name(10)
    dst_tag.mkdir(parents=True)
    extra = pp.to_dense(src_tag, dst_tag, src, dst)
    ckpt.commit(dst_tag, 10, {**extra, "converted_from": str(src_tag)})
    state = torch.load(dst_tag / "mp_rank_00_model_states.pt", weights_only=False)
    weights = load_file(str(src_tag / ckpt.WEIGHTS))
    for name, t in weights.items():  # the fp32 master weights of the partitions are the exported weights
        assert torch.equal(state["module"][name], t), name
    assert len(state["optimizer"]["state"]) == len(weights) and state["sampler"]["world_size"] == 1

    resumed = run_train(tokens, dense_cfg, str(tmp_path))
    assert resumed.resumed_from == 10
    got = {r["step"]: r["loss"] for r in _records(resumed.metrics_path, "train") if r["step"] > 10}
    ref = {r["step"]: r["loss"] for r in _records(runs["pp"].metrics_path, "train") if r["step"] > 10}
    assert sorted(got) == list(range(11, 21))
    rel = _max_rel([got[s] for s in sorted(got)], [ref[s] for s in sorted(got)])
    print(f"pp=2 -> pp=1 at step 10: max relative loss difference over steps 11-20 {rel:.3g}")
    assert rel < 1e-4


@pytest.mark.slow  # one more launch of 2 ranks
def test_pp2_under_zero0_with_activation_checkpointing_matches_the_single_rank_run(runs, tokens, tmp_path):
    """ZeRO-0 clips with DeepSpeed's clip_grad_norm_, which counts only the first stage's gradients unless the
    parameters are marked model-parallel (pp.pipeline_module marks them): the curve still matches one rank's."""
    from lifecycle.tasks.train.launch import run_train

    r = run_train(tokens, pp_config(zero=0, **{"engine.activation_checkpointing": True}), str(tmp_path))
    a = [x["loss"] for x in _records(r.metrics_path, "train")]
    b = [x["loss"] for x in _records(runs["dense"].metrics_path, "train")]
    rel = _max_rel(a, b)
    print(f"pp=2 ZeRO-0 + activation checkpointing vs single rank ZeRO-1: max relative loss difference {rel:.3g}")
    assert rel < 1e-5


def test_pp2_by_dp2_on_four_ranks_trains_the_single_rank_loss_curve(runs, tokens, tmp_path):
    """pp × dp composed: 4 ranks, 2 stages × 2 data-parallel replicas (ZeRO-1 over each stage's dp group),
    micro-batch 2 × 2 pipeline micro-batches × dp 2 = the same global batch of 8 as the single-rank run, which
    reads the same sequences (the sampler is layout-invariant): the loss curves agree within fp32 tolerance."""
    from lifecycle.tasks.train.launch import run_train

    r = run_train(tokens, pp_config(ranks=4, **{"batch.micro_batch_size": 2}), str(tmp_path))
    a = [x["loss"] for x in _records(r.metrics_path, "train")]
    b = [x["loss"] for x in _records(runs["dense"].metrics_path, "train")]
    rel = _max_rel(a, b)
    print(f"pp=2 x dp=2 (4 ranks) vs single rank, 20 steps: max relative loss difference {rel:.3g}")
    assert len(a) == 20 and rel < 1e-5


@pytest.mark.slow  # one launch of 2 ranks
def test_pp2_bf16_zero1_trains(runs, tokens, tmp_path):
    """bf16 weights and activations through the pipeline (DeepSpeed's BF16_Optimizer keeps fp32 masters): it
    learns, and stays near the fp32 single-rank curve (bf16 rounding, not a reduction-order bound)."""
    from lifecycle.tasks.train import commit as ckpt
    from lifecycle.tasks.train.launch import run_train

    r = run_train(tokens, pp_config(**{"engine.precision": "bf16"}), str(tmp_path))
    losses = [x["loss"] for x in _records(r.metrics_path, "train")]
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses) and losses[-1] < 0.8 * losses[0]
    rel = _max_rel(losses, [x["loss"] for x in _records(runs["dense"].metrics_path, "train")])
    print(f"pp=2 bf16 vs single rank fp32: max relative loss difference {rel:.3g}")
    assert rel < 0.05
    assert ckpt.verify(r.checkpoint_dir) is None
