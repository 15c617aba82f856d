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
import socket
from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": False, "pos": "learned", "norm": "layernorm", "mlp": "gelu"}])
def test_layer_specs_compute_the_dense_model(changes):
    """Embedding, input, blocks, norm and head in sequence give GPT's logits, loss and gradients (tied head:
    the embedding's gradient sums both uses, as in GPT)."""
    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.parallel import pp

    cfg = TINY.model_copy(update=changes)
    torch.manual_seed(0)
    model = GPT(cfg)
    layers, params = _sequential(cfg, model)
    assert set(params) == set(model.export_state())
    x, y = torch.randint(0, 97, (3, 16)), torch.randint(0, 97, (3, 16))
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pipe_worker(rank: int, port: int, out: str, tie: bool) -> None:
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
    pipe = pp.pipeline_module(model, pp=2, dp=1, activation_checkpointing=False)
    stage = pipe.stage_id
    order = [pipe.dense_names().get(n, "wte.weight") for n, _ in pipe.named_parameters()]
    exported = pipe.export_state()
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=torch.optim.AdamW(pipe.parameters(), lr=1e-3), config={
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True})
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 97, (2, 16), generator=g), torch.randint(0, 97, (2, 16), generator=g)) for _ in range(2)]
    evaluated = pp.eval_loss(engine, *batches[1])
    loss = pp.forward_backward(engine, batches)
    ref = sum(model(x, y)[1].item() for x, y in batches) / 2
    result = {"stage": stage, "order": order, "expected_order": pp.stage_param_names(cfg, 2, stage),
              "loss": loss, "ref": ref, "eval": evaluated, "eval_ref": model(*batches[1])[1].item()}
    if rank == 0:
        dense = model.export_state()
        result["export_equal"] = sorted(exported) == sorted(dense) and all(torch.equal(exported[k], dense[k]) for k in dense)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("tie", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_two_stage_pipeline_exports_the_dense_weights_and_computes_the_dense_loss(tmp_path, tie):
    """Two gloo ranks, one stage each: rank 0 gathers model.safetensors' dense state (equal to GPT's), the
    stages' parameter order is what the converter assumes, and the first step's loss (before any update) and
    an eval loss equal the dense model's on the same micro-batches, on both ranks (DeepSpeed broadcasts it)."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "r")
    mp.start_processes(_pipe_worker, args=(_free_port(), out, tie), nprocs=2, start_method="spawn")
    got = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert [g["stage"] for g in got] == [0, 1]
    assert got[0]["export_equal"]
    for g in got:
        assert g["order"] == g["expected_order"]
        assert math.isclose(g["loss"], g["ref"], rel_tol=1e-6) and math.isclose(g["eval"], g["eval_ref"], rel_tol=1e-6)
    assert got[0]["loss"] == got[1]["loss"]
