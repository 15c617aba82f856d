"""The GPU speed levers that a CPU can check: `train.engine.compile` (the model compiled with torch.compile under
DeepSpeed, on real CPU ranks), the MFU basis (datasheet peaks), `train.vocab_multiple`, and the loss read without
a host synchronisation. The CUDA path (compile on by default there) is measured by bench/gpu_mfu.py and
bench/kill_resume.py on a GPU host."""

from __future__ import annotations

import json

import pytest
import torch

from lifecycle.tasks.data.tokenize.stage import token_shards
from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.hardware import datasheet_peak, mfu_basis
from lifecycle.tasks.train.launch import resolve_model, run_train
from lifecycle.tasks.train.model import GPT
from lifecycle.tasks.train.distributed import DeviceValue
from lifecycle.tasks.train.loader import get_batch
from tests.train.test_train import CFG, make_tokens, with_


def test_compile_resolves_per_accelerator_and_is_refused_with_pipelines():
    assert not TrainConfig().engine.compiled  # auto on the CPU: off
    assert TrainConfig(engine={"accelerator": "cuda"}).engine.compiled
    assert not TrainConfig(engine={"accelerator": "cuda", "compile": False}).engine.compiled
    assert TrainConfig(engine={"compile": True}).engine.compiled
    with pytest.raises(ValueError, match="train.engine.compile=true with train.parallel.pp=2"):
        TrainConfig(model={"n_layer": 2}, batch={"num_ranks": 2}, engine={"zero_stage": 1, "compile": True},
                    parallel={"pp": 2})
    # auto with a pipeline is accepted (the ranks run it eager)
    TrainConfig(model={"n_layer": 2}, batch={"num_ranks": 2}, engine={"zero_stage": 1, "accelerator": "cuda"},
                parallel={"pp": 2})


def test_datasheet_peaks_and_the_basis_line():
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bf16")[0] == 989.4e12
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "fp32")[0] == 494.7e12  # TF32
    assert datasheet_peak("NVIDIA H100 PCIe", "bf16")[0] == 756.5e12
    assert datasheet_peak("NVIDIA H200", "bf16")[0] == 989.4e12
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "bf16")[0] == 312e12
    assert datasheet_peak("NVIDIA L40S", "bf16")[0] == 362.05e12  # not the L4's row
    assert datasheet_peak("Some Future GPU", "bf16") is None
    line = mfu_basis(868_000_000, 124_000_000, 12, 768, 1024, 989.4e12, "datasheet bf16 dense peak of X")
    assert "6·N + 12·L·H·Q·T" in line and "N=124,000,000" in line and "989.4 TFLOP/s" in line


def test_compiled_ranks_train_like_eager_ones_and_save_plain_checkpoints(tmp_path):
    """A CPU rank with compile on: the log says so, the first step's loss is the eager model's on the same
    batch (the compiled graph computes the same function), and the committed weights load into a plain model."""
    tokens = make_tokens(tmp_path / "tok", 300)
    cfg = with_(CFG, max_steps=3, **{"engine.compile": True, "checkpoint.every": 3, "logging.every": 1,
                                     "logging.eval_every": 0, "batch.num_ranks": 1})
    r = run_train(tokens, cfg, str(tmp_path / "w"))
    log = open(r.log_path).read()
    assert "model compiled with torch.compile (backend inductor" in log
    first = next(rec for rec in map(json.loads, open(r.metrics_path)) if rec["kind"] == "train")
    assert first["step"] == 1

    # the eager loss of step 1: the same initial weights (seed), the same batch
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model.model_copy(update={"vocab_size": token_shards(tokens).vocab_size}))
    if cfg.model.attention == "document":  # as engine.build sets it (the default attention)
        model.doc_sep = token_shards(tokens).eot_id
    with torch.no_grad():
        eager = model(*get_batch(token_shards(tokens), cfg, 0, 0, 0))[1].item()
    assert first["loss"] == pytest.approx(eager, rel=1e-4)

    loaded = ckpt.load_model(r.checkpoint_dir)  # model.safetensors: parameter names without `_orig_mod.`
    assert set(loaded.state_dict()) == set(model.state_dict())


def test_vocab_multiple_pads_the_filled_vocabulary_only():
    padded, _ = resolve_model(TrainConfig(vocab_multiple=64), 50257, 10**6)
    assert padded.model.vocab_size == 50304  # nanoGPT's padding of GPT-2's vocabulary
    same, _ = resolve_model(TrainConfig(vocab_multiple=64), 4096, 10**6)
    assert same.model.vocab_size == 4096
    assert resolve_model(TrainConfig(), 50257, 10**6)[0].model.vocab_size == 50257  # default: the tokenizer's
    given = TrainConfig(model={"vocab_size": 32001}, vocab_multiple=64)  # an imported checkpoint's: kept
    assert resolve_model(given, 32001, 10**6)[0].model.vocab_size == 32001


def test_a_device_value_reads_the_tensor_it_was_given():
    t = torch.tensor(2.5, dtype=torch.float64) * 2
    assert DeviceValue(t).get() == 5.0
