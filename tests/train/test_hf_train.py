"""Continued pretraining from an imported checkpoint: 20 steps under ZeRO-3 on the bundled corpus, tokenized
with the model's own tokenizer, start from exactly the imported weights, lower the loss, and the result exports
and loads in transformers. The exact-resume case (SIGKILL, rerun) is slow-marked."""

import json
import os
from pathlib import Path

import pytest
import torch

from bench.hf_import import make_tiny
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, run_tokenize, token_shards
from lifecycle.tasks.eval.export import export_hf
from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.hf_import import load_hf
from lifecycle.tasks.train.launch import run_train
from lifecycle.tasks.train.loader import get_batch
from tests.conftest import corpus_records
from tests.data.test_tokenizer import make_docs

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def continue_config(base: Path, **over) -> TrainConfig:
    return TrainConfig.model_validate({
        "init_from": f"hf:{base}", "model": {"seq_len": 64}, "max_steps": 20,
        "optimizer": {"warmup_steps": 2, "lr": 3e-3, "min_lr": 3e-4},
        "batch": {"micro_batch_size": 4, "num_ranks": 2}, "engine": {"zero_stage": 3, "precision": "fp32"},
        "checkpoint": {"every": 10, "keep_last": 2}, "logging": {"every": 1},
        "launch": {"threads_per_rank": 1, "timeout_s": 1800}, **over})


def test_continued_pretraining_from_an_imported_llama(tmp_path):
    base = make_tiny(tmp_path / "base", "llama3", shard_size="60KB")
    texts = [r["text"] for r in corpus_records(40)]
    tokens = run_tokenize(make_docs(tmp_path, texts), TokenizeConfig(base_model=str(base), val_fraction=0.1),
                          str(tmp_path))
    cfg = continue_config(base)
    result = run_train(tokens, cfg, str(tmp_path))
    assert result.base_model == str(base.resolve())
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= set(result.base_model_files)
    train = [r for r in map(json.loads, open(result.metrics_path)) if r["kind"] == "train"]
    first, last = train[0], train[-1]
    assert (first["step"], last["step"]) == (1, 20)
    # step 1's loss is the imported model's own loss on the first batch of each rank (ZeRO-3 partitions loaded)
    model = load_hf(base, seq_len=64)
    meta = token_shards(tokens)
    with torch.no_grad():
        start = sum(model(*get_batch(meta, result_cfg(cfg, meta), 0, rank, 0))[1].item() for rank in (0, 1)) / 2
    assert abs(first["loss"] - start) < 1e-4, (first["loss"], start)
    assert last["loss"] < first["loss"] - 0.5  # the run learns from the corpus
    report = export_hf(result.checkpoint_dir, tmp_path / "hf-out", tokenizer=meta.tokenizer_path)
    assert report["architecture"] == "LlamaForCausalLM" and report["max_abs_logit_diff_fp32"] <= 1e-4
    from transformers import AutoModelForCausalLM, AutoTokenizer

    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf-out"))
    assert again.config.rope_parameters["rope_type"] == "llama3" and again.config.num_key_value_heads == 2
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf-out"))
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")


def result_cfg(cfg: TrainConfig, meta) -> TrainConfig:
    """The config the ranks ran (vocab_size is the checkpoint's already)."""
    assert cfg.model.vocab_size >= meta.vocab_size
    return cfg


@pytest.mark.slow
def test_exact_resume_of_a_run_started_from_an_imported_model(tmp_path):
    from tests.faults import kill_and_resume

    base = make_tiny(tmp_path / "base", "llama2", vocab=512)  # the faults' corpus has 384 ids
    got = kill_and_resume(kills=3, init_from=f"hf:{base}")  # the third kill lands inside a checkpoint save
    assert got["identical"] == got["kills"] == 3
    assert got["identical_mid_run"] >= 1


@pytest.mark.slow
@pytest.mark.e2e
def test_lifecycle_run_continues_a_llama_and_records_the_base(tmp_path, capsys):
    """`lifecycle run deploy/configs/continue_llama.yaml` on a slice of the corpus: the registered version names
    its base, `lineage model` lists the base model's files above the data."""
    from mlflow import MlflowClient

    from tests.conftest import last_json, lifecycle
    from tests.conftest import lifecycle_in_process as audit
    from tests.conftest import ROOT

    base = make_tiny(tmp_path / "base", "llama3", shard_size="60KB")
    inputs = tmp_path / "docs.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in corpus_records(120)))
    wd = tmp_path / "work"
    sets = [f"workdir={wd}", f"collect.inputs={json.dumps([str(inputs)])}", f"train.init_from=hf:{base}",
            "train.model.seq_len=64", "train.batch.micro_batch_size=4", "train.logging.every=1",
            "evaluate.max_batches=4", "tokenize.val_fraction=0.2"]
    args = ["run", ROOT / "deploy/configs/continue_llama.yaml", "--json"]
    for s in sets:
        args += ["--set", s]
    out = last_json(lifecycle(*args, timeout=1800).stdout)
    assert out["status"] == "completed"
    name, version = out["model"]["name"], out["model"]["version"]
    rc, model = audit(capsys, "lineage", "model", f"{name}/{version}", "--workdir", str(wd))
    assert rc == 0 and model["base_model"]["dir"] == str(base.resolve())
    assert {f["name"] for f in model["base_model"]["files"]} >= {"config.json", "tokenizer.json",
                                                                 "model.safetensors.index.json"}
    tags = MlflowClient(out["mlflow_tracking_uri"]).get_model_version(name, version).tags
    assert tags["lifecycle.base_model"] == str(base.resolve())
