"""Train config, sampler and hostfile checks (fast), then real 2-rank DeepSpeed runs on CPU: ZeRO-2 fp32
(rollback, resume, reuse), ZeRO-3 fp32 with activation checkpointing through a hostfile (exact resume),
and ZeRO-2 bf16 (20-40 s per launch on 2 cores).

The first DeepSpeed launch on a machine also JIT-builds DeepSpeed's shared-memory comm op with gcc
(cached under ~/.cache/torch_extensions afterwards), which adds about 40 s once.
"""

import base64
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from lifecycle.core import dataset as ds
from lifecycle.core import fs
from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.eval.evaluate.stage import windows
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, run_tokenize, token_shards
from lifecycle.tasks.train.config import ModelConfig, TrainConfig
from lifecycle.tasks.train.launch import run_train
from lifecycle.tasks.train.engine import ds_config
from lifecycle.tasks.train.loader import get_batch

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches and then".split()


def make_tokens(workdir, n_docs: int = 1500) -> ds.DatasetRef:
    """Docs made of 4-word runs of a fixed word list: learnable structure, so the loss must fall."""
    rng = np.random.default_rng(0)
    texts = [" ".join(" ".join(WORDS[j : j + 4]) for j in rng.integers(0, len(WORDS) - 4, size=int(rng.integers(3, 12)))) + "."
             for _ in range(n_docs)]
    table = pa.table({"doc_id": [f"d{i:05d}" for i in range(n_docs)], "source_id": [f"s:{i}" for i in range(n_docs)],
                      "text": texts, "source": ["s"] * n_docs, "url": [None] * n_docs, "meta": ["{}"] * n_docs},
                     schema=ds.DOC_SCHEMA)
    docs = ds.materialize(workdir, "scrub", {"n": n_docs}, "test", lambda w: w.write_table(table) or {})
    # synthetic runs of a 19-word list share 13-grams across any split: the data checks are not this test's subject
    return run_tokenize(docs, TokenizeConfig(vocab_size=384, val_fraction=0.1, min_val_docs=0, min_val_tokens=0,
                                             max_contamination=1.0), str(workdir))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_tokens(tmp_path_factory.mktemp("tokens"))


TINY = ModelConfig(n_layer=2, n_head=2, n_embd=64, seq_len=64)
CFG = TrainConfig.model_validate({
    "model": TINY.model_dump(), "max_steps": 30,
    "optimizer": {"decay_steps": 60, "warmup_steps": 5, "lr": 3e-3, "min_lr": 3e-4},
    "batch": {"micro_batch_size": 8, "num_ranks": 2}, "engine": {"zero_stage": 2, "precision": "fp32"},
    "checkpoint": {"every": 10, "keep_last": 2}, "logging": {"every": 5, "eval_every": 10, "eval_batches": 2},
    "launch": {"threads_per_rank": 1, "timeout_s": 300}})


def with_(cfg: TrainConfig, **changes) -> TrainConfig:
    """`cfg` with dotted-path changes (`"optimizer.lr": 1e-3`), validated again like a YAML override."""
    data = cfg.model_dump()
    for path, value in changes.items():
        *sections, name = path.split(".")
        node = data
        for section in sections:
            node = node[section]
        node[name] = value
    return TrainConfig.model_validate(data)


# --------------------------------------------------------------------------------------------------
# fast


def _error_locs(data: dict) -> list[str]:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        TrainConfig.model_validate(data)
    return [".".join(map(str, err["loc"])) for err in e.value.errors()]


def test_config_validation_names_the_dotted_field():
    with pytest.raises(ValueError, match=r"min_lr \(0.001\) must not exceed lr"):
        TrainConfig.model_validate({"optimizer": {"lr": 1e-4, "min_lr": 1e-3}})
    assert _error_locs({"optimizer": {"lr": 1e-4, "min_lr": 1e-3}}) == ["optimizer.min_lr"]
    with pytest.raises(ValueError, match="train.optimizer.warmup_steps .10. must be below .* train.max_steps .10."):
        TrainConfig.model_validate({"max_steps": 10, "optimizer": {"warmup_steps": 10}})
    assert _error_locs({"zero": 2}) == ["zero"]  # extra fields are refused
    assert _error_locs({"zero_stage": 2}) == ["zero_stage"]  # an old flat field is not silently dropped
    assert _error_locs({"engine": {"zero_stage": 4}}) == ["engine.zero_stage"]
    assert _error_locs({"engine": {"precision": "fp16"}}) == ["engine.precision"]
    assert _error_locs({"checkpoint": {"every": 0}, "batch": {"grad_accum": 0}}) == ["batch.grad_accum", "checkpoint.every"]


def test_lr_schedule_warmup_cosine_then_flat():
    cfg = TrainConfig.model_validate({"max_steps": 50, "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10,
                                                                     "decay_steps": 100}})
    lrs = [cfg.lr_at(s) for s in range(120)]
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[9] == pytest.approx(1e-3 * 10 / 11)
    assert lrs[10] == pytest.approx(1e-3) and max(lrs) == pytest.approx(1e-3)
    assert lrs[55] == pytest.approx(1e-4 + 0.5 * 9e-4)  # cosine midpoint
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[100] == lrs[119] == pytest.approx(1e-4)


def test_run_key_leaves_out_where_the_run_stops():
    longer = with_(CFG, max_steps=40, **{"checkpoint.every": 5, "logging.every": 1, "launch.master_port": 29999})
    assert longer.run_key() == CFG.run_key()
    assert with_(CFG, **{"optimizer.lr": 1e-3}).run_key() != CFG.run_key()
    # without an explicit horizon the cosine follows max_steps, so a longer run is a different run
    plain = TrainConfig(max_steps=30)
    assert with_(plain, max_steps=40).run_key() != plain.run_key()
    assert plain.run_key()["optimizer"]["decay_steps"] == 30 == with_(plain, **{"optimizer.decay_steps": 30}).run_key()["optimizer"]["decay_steps"]


def test_run_key_ignores_operational_sections_and_follows_the_others():
    from lifecycle.tasks.train.config import Section, is_operational

    fields = TrainConfig.model_fields
    operational = {name for name, f in fields.items() if is_operational(f)}
    assert operational == {"checkpoint", "logging", "launch", "max_steps", "max_epochs", "init_from",
                           "layout", "layout_memory", "resume_across_layouts"}  # layout: the fields it resolves to are in the key
    assert set(CFG.run_key()) == set(fields) - operational
    # every field of an operational section may change without changing the run
    changed = {"checkpoint.every": 7, "checkpoint.keep_last": 9, "checkpoint.async_save": False,
               "checkpoint.auto_overhead": 0.1, "checkpoint.memory_tier": False,
               "logging.every": 3, "logging.eval_every": 0, "logging.eval_batches": 9, "logging.peak_flops_per_rank": 1e12,
               "launch.hostfile": "hosts", "launch.num_nodes": 1, "launch.master_addr": "10.0.0.1",
               "launch.master_port": 29999, "launch.launcher": "slurm", "launch.threads_per_rank": 4,
               "launch.prefetch": 0, "launch.timeout_s": 5.0, "launch.stall_s": 9.0, "launch.startup_s": 99.0, "max_epochs": 1.0, "init_from": "champion",
               "resume_across_layouts": False}
    assert set(changed) >= {f"{s}.{n}" for s in ("checkpoint", "logging", "launch") for n in
                            type(getattr(CFG, s)).model_fields if n not in ("include", "exclude", "spares")}
    assert with_(CFG, **changed).run_key() == CFG.run_key()
    assert with_(CFG, **{"launch.spares": 2}).run_key() == CFG.run_key()  # refused with a hostfile: apart
    # every field of every other section is in the key
    for name, f in fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, Section) and name not in operational:
            assert set(CFG.run_key()[name]) == set(f.annotation.model_fields), name
    for change in ({"optimizer.weight_decay": 0.0}, {"optimizer.betas": (0.9, 0.99)}, {"optimizer.grad_clip": 0.5},
                   {"batch.grad_accum": 2}, {"engine.zero_stage": 3}, {"guard.spike_factor": None}, {"seed": 1},
                   {"model.n_layer": 3}):
        assert with_(CFG, **change).run_key() != CFG.run_key(), change


def test_ds_config_follows_train_config():
    c = ds_config(with_(CFG, **{"batch.grad_accum": 3, "engine.zero_stage": 3, "engine.precision": "bf16"}))
    assert c["train_batch_size"] == 8 * 3 * 2 and c["gradient_accumulation_steps"] == 3
    assert c["zero_optimization"]["stage"] == 3 and c["bf16"]["enabled"] and "fp16" not in c


def test_sampler_is_a_pure_function_of_seed_step_rank_micro(tokens):
    shards = token_shards(tokens)
    cfg = CFG.model_copy(update={"model": TINY.model_copy(update={"vocab_size": shards.vocab_size})})
    x, y = get_batch(shards, cfg, step=3, dp_rank=0, micro=0)
    assert x.shape == y.shape == (8, 64) and x.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    x2, _ = get_batch(shards, cfg, step=3, dp_rank=0, micro=0)
    assert torch.equal(x, x2)
    for other in ({"step": 4, "dp_rank": 0, "micro": 0}, {"step": 3, "dp_rank": 1, "micro": 0},
                  {"step": 3, "dp_rank": 0, "micro": 1}):
        assert not torch.equal(x, get_batch(shards, cfg, **other)[0])
    train = np.fromfile(shards.train[0], dtype=shards.dtype)
    row = x[0].numpy()
    starts = np.flatnonzero(train[: len(train) - 64] == row[0])
    assert any(np.array_equal(train[s : s + 64], row) for s in starts)  # a real window of the shard


def test_the_global_batch_is_the_same_under_every_split_of_ranks_accumulation_and_micro_batch(tokens):
    """What lets a checkpoint change layout and a parallel run be compared with one rank: the sequences of a
    step depend on the global batch size only, not on how dp × grad_accum × micro_batch_size split it."""
    shards = token_shards(tokens)
    model = TINY.model_copy(update={"vocab_size": shards.vocab_size})

    def global_batch(dp: int, accum: int, micro: int) -> torch.Tensor:
        cfg = with_(CFG.model_copy(update={"model": model}),
                    **{"batch.num_ranks": dp, "batch.grad_accum": accum, "batch.micro_batch_size": micro})
        return torch.cat([get_batch(shards, cfg, 5, r, m)[0] for r in range(dp) for m in range(accum)])

    one = global_batch(1, 1, 8)
    for dp, accum, micro in ((2, 1, 4), (1, 2, 4), (2, 2, 2), (1, 8, 1), (4, 1, 2)):
        assert torch.equal(global_batch(dp, accum, micro), one), (dp, accum, micro)
    assert not torch.equal(global_batch(1, 1, 8), torch.cat([get_batch(shards, CFG.model_copy(
        update={"model": model}), 6, 0, 0)[0]]))  # another step, other sequences


def test_eval_windows_cover_every_prediction_once():
    assert windows(11, 4) == [(0, 4), (4, 4), (8, 2)]
    assert windows(9, 4) == [(0, 4), (4, 4)]
    assert sum(n for _, n in windows(1000, 64)) == 999
    assert windows(1, 4) == []


def test_model_vocab_smaller_than_tokenizer_is_refused(tokens, tmp_path):
    cfg = CFG.model_copy(update={"model": TINY.model_copy(update={"vocab_size": 100})})
    with pytest.raises(ValueError, match="vocab_size 100"):
        run_train(tokens, cfg, str(tmp_path))
    assert not (tmp_path / "train").exists()


def test_model_size_auto_sizes_from_train_tokens_and_warns_on_repeats():
    from lifecycle.tasks.train.sizing import non_embedding_params
    from lifecycle.tasks.train.launch import RepeatedDataWarning, resolve_model

    cfg = TrainConfig(model_size="auto", max_steps=100, batch={"micro_batch_size": 8, "num_ranks": 2},
                      model=ModelConfig(seq_len=128, norm="layernorm"))
    sized, info = resolve_model(cfg, vocab_size=4096, train_tokens=200_000_000)  # 200M tokens -> N = 10M
    assert abs(non_embedding_params(sized.model) / 1e7 - 1) < 0.1 and info["model_params"] == non_embedding_params(sized.model)
    assert sized.model.vocab_size == 4096 and sized.model.norm == "layernorm" and sized.model.seq_len == 128
    assert info["epochs"] == pytest.approx(100 * 8 * 2 * 128 / 200_000_000)
    bigger, _ = resolve_model(cfg, vocab_size=4096, train_tokens=2_000_000_000)
    assert non_embedding_params(bigger.model) > 5 * non_embedding_params(sized.model)
    fixed, _ = resolve_model(cfg.model_copy(update={"model_size": "fixed"}), 4096, 200_000_000)
    assert fixed.model.n_layer == 4 and fixed.model.n_embd == 128
    with pytest.warns(RepeatedDataWarning, match="repeats the data 8.2 times"):
        resolve_model(cfg, vocab_size=4096, train_tokens=25_000)  # 204,800 tokens trained over 25,000
    with pytest.warns(RepeatedDataWarning):
        resolve_model(cfg.model_copy(update={"max_epochs": 1.0}), 4096, 150_000)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_model(cfg, 4096, 100_000)  # 2 epochs: within max_epochs=4


def test_hostfile_is_validated_and_selects_the_ranks(tmp_path):
    from lifecycle.tasks.train.launcher import launch_args

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2  # first\n\n# a comment\nnode2 slots=2\n")
    multi = with_(CFG, **{"launch.hostfile": str(hostfile), "batch.num_ranks": 4, "launch.master_addr": "10.0.0.1"})
    args = launch_args(multi, 29500, tmp_path, threads=3)
    assert args == ["--hostfile", str(hostfile), "--master_port", "29500", "--launcher", "pdsh", "--master_addr", "10.0.0.1"]
    assert (tmp_path / ".deepspeed_env").read_text() == "DS_ACCELERATOR=cpu\nOMP_NUM_THREADS=3\n"  # for the remote ranks
    one = launch_args(with_(multi, **{"launch.num_nodes": 1, "batch.num_ranks": 2}), 29500, tmp_path, 1)
    assert one[-5:] == ["--master_addr", "10.0.0.1", "--no_ssh_check", "--num_nodes", "1"]
    assert "--include" in launch_args(with_(multi, **{"launch.include": "node2:0", "batch.num_ranks": 1}), 1, tmp_path, 1)
    launch_args(with_(multi, **{"launch.exclude": "node1@node2:1", "batch.num_ranks": 1}), 1, tmp_path, 1)
    with pytest.raises(ValueError, match="gives 4 ranks .*train.batch.num_ranks=2"):
        launch_args(with_(multi, **{"batch.num_ranks": 2}), 1, tmp_path, 1)
    with pytest.raises(ValueError, match="'node3' of 'node3' is not in hostfile"):
        launch_args(with_(multi, **{"launch.include": "node3"}), 1, tmp_path, 1)
    for bad, line in (("node1 slots=2\nnode2 slot=2\n", 2), ("node1 slots=2\nnode1 slots=1\n", 2),
                      ("# only\nnode1\n", 2), ("node1 slots=0\n", 1), ("node1 slots=2 node2\n", 1)):
        hostfile.write_text(bad)
        with pytest.raises(ValueError, match=f"hostfile {re.escape(str(hostfile))}, line {line}:"):
            launch_args(multi, 1, tmp_path, 1)
    hostfile.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no '<host> slots=<ranks>' line"):
        launch_args(multi, 1, tmp_path, 1)
    with pytest.raises(ValueError, match="cannot read"):
        launch_args(with_(multi, **{"launch.hostfile": str(tmp_path / "missing")}), 1, tmp_path, 1)
    with pytest.raises(ValueError, match="set train.launch.hostfile"):
        TrainConfig(launch={"num_nodes": 2})
    with pytest.raises(ValueError, match="mutually exclusive"):
        TrainConfig(launch={"hostfile": "h", "include": "a", "exclude": "b"})
    assert launch_args(CFG, 29500, tmp_path, 1) == ["--num_gpus", "2", "--master_port", "29500"]


# --------------------------------------------------------------------------------------------------
# the real thing: 2 ranks, ZeRO-2, CPU


def _records(path, kind):
    return [r for r in map(json.loads, open(path)) if r["kind"] == kind]


def test_deepspeed_zero2_train_resume_and_reuse(tokens, tmp_path, monkeypatch):
    workdir = str(tmp_path)
    # a NaN loss at data step 13 (training step 14): roll back to the step-10 commit, skip that batch
    monkeypatch.setenv("LIFECYCLE_FAULT_NAN_DATA_STEPS", "13")
    seen: list[dict] = []
    r1 = run_train(tokens, CFG, workdir, on_metrics=seen.append)
    assert r1.launched and r1.resumed_from is None and r1.steps == 30
    train = _records(r1.metrics_path, "train")
    assert [r["step"] for r in train] == [1, 5, 10, 15, 20, 25, 30]
    assert train[-1]["loss"] < 0.6 * train[0]["loss"]  # it learns
    assert r1.final_loss == train[-1]["loss"]
    assert [r["step"] for r in _records(r1.metrics_path, "eval")] == [10, 20, 30]
    [rb] = _records(r1.metrics_path, "rollback")
    assert rb["step"] == 10 and rb["bad_step"] == 14 and rb["reason"] == "nan" and rb["skipped_data_steps"] == [13]
    assert all(math.isfinite(r["loss"]) for r in train)
    # throughput, MFU and the loader's stall fraction are logged with every train record. On the CPU the MFU's peak
    # is a matmul measured at launch, which reads low while other processes load the cores (MFU 2.3 was seen under
    # load 7 on 2 cores): the bound catches a unit error (x1000), not the machine's load
    for r in train:
        assert 0 <= r["stall_frac"] < 1 and r["data_wait"] >= 0 and 0 < r["mfu"] < 10 and r["tokens_per_s"] > 0
        assert r["flops_per_token"] == r1.flops_per_token and r["params"] == r1.model_params
    assert ckpt.read_marker(r1.checkpoint_dir)["loss"] == train[-1]["loss"]
    assert [(r["kind"], r["step"]) for r in seen] == [(r["kind"], r["step"]) for r in map(json.loads, open(r1.metrics_path))]
    root = Path(r1.checkpoint_dir).parent
    assert [s for s, _ in ckpt.list_committed(root)] == [20, 30]  # keep_last=2 pruned step 10
    assert ckpt.verify(r1.checkpoint_dir) is None
    marker = ckpt.read_marker(r1.checkpoint_dir)
    assert marker["dataset_sha256"] == tokens.sha256 and marker["world_size"] == 2 and marker["zero_stage"] == 2
    files = {f["path"] for f in marker["files"]}
    assert {"model.safetensors", "model_config.json", "mp_rank_00_model_states.pt"} <= files
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= files
    launched = open(r1.log_path).read()  # 2 local ranks started by the supervisor, no DeepSpeed launcher
    assert "2 local ranks, MASTER_ADDR=127.0.0.1 MASTER_PORT=" in launched and "deepspeed.launcher" not in launched
    assert launched.count("[supervisor] rank 0 (pid ") == launched.count("[supervisor] rank 1 (pid ") == 1
    assert launched.count("exited with code 0") == 2
    # the first save's arena, sized from DeepSpeed's own state dicts, was made before training; nothing left behind
    assert re.search(r"checkpoint arena of [\d.,]+ MiB made and faulted in before training", launched)
    assert not (Path(r1.run_dir) / ".checkpoint-sizing").exists()
    state = torch.load(Path(r1.checkpoint_dir) / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["sampler"]["skipped"] == [13] and state["sampler"]["next_step"] == 30

    # the consolidated safetensors weights give a validation loss well below uniform
    model = ckpt.load_model(r1.checkpoint_dir)
    val = np.fromfile(token_shards(tokens).val[0], dtype=token_shards(tokens).dtype).astype(np.int64)
    n = (len(val) - 1) // 64
    x, y = torch.from_numpy(val[: n * 64].reshape(n, 64)), torch.from_numpy(val[1 : n * 64 + 1].reshape(n, 64))
    with torch.no_grad():
        val_loss = model(x, y)[1].item()
    assert val_loss < math.log(token_shards(tokens).vocab_size) - 2

    # a longer run in the same directory resumes from the committed step
    seen.clear()
    longer = with_(CFG, max_steps=40)
    r2 = run_train(tokens, longer, workdir, on_metrics=seen.append)
    assert r2.launched and r2.resumed_from == 30 and r2.steps == 40 and r2.run_dir == r1.run_dir
    assert [(r["kind"], r["step"]) for r in seen] == [("train", 31), ("train", 35), ("train", 40), ("eval", 40)]
    assert [r["step"] for r in _records(r2.metrics_path, "train")] == [1, 5, 10, 15, 20, 25, 30, 31, 35, 40]

    # the same config again: the final checkpoint is committed, nothing is launched
    r3 = run_train(tokens, longer, workdir)
    assert not r3.launched and r3.checkpoint_dir == r2.checkpoint_dir and r3.final_loss == r2.final_loss

    # damage the final checkpoint after its commit: the rerun falls back to step 30 and, because batches
    # and RNG states are restored, reproduces step 40 bit for bit (same weights file, byte for byte)
    weights_sha = fs.sha256_file(Path(r2.checkpoint_dir) / "model.safetensors")
    shard = Path(r2.checkpoint_dir) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    r4 = run_train(tokens, longer, workdir)
    assert r4.launched and r4.resumed_from == 30 and r4.checkpoint_dir == r2.checkpoint_dir
    assert ckpt.verify(r4.checkpoint_dir) is None
    assert fs.sha256_file(Path(r4.checkpoint_dir) / "model.safetensors") == weights_sha
    assert r4.final_loss == r2.final_loss


def test_metrics_resume_drops_lost_steps_and_a_torn_last_line(tmp_path):
    from lifecycle.tasks.train.metrics import Metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 5}\n{"kind": "eval", "step": 10}\n{"kind": "train", "step": 15}\n'
                    '{"kind": "train", "st')  # killed mid-write
    Metrics(path, resume_step=10, enabled=True)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [5, 10]
    Metrics(path, resume_step=0, enabled=True)
    assert path.read_text() == ""


def _launch_log(log_path) -> str:
    """The last launch's part of train.log (the supervisor appends one section per launch)."""
    return open(log_path).read().rsplit("\n=== ", 1)[-1]


@pytest.mark.slow  # minutes on 2 cores (CI stays under 30 min)
def test_deepspeed_zero3_through_a_hostfile_with_activation_checkpointing_resumes_exactly(tokens, tmp_path):
    """ZeRO-3 fp32 with activation checkpointing, launched through the launcher's hostfile path
    (`localhost slots=2`: DeepSpeed reads the hostfile, then starts the single host's ranks locally);
    a damaged final checkpoint falls back to the previous commit and the rerun reproduces it bit for bit."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one host, two ranks\nlocalhost slots=2\n")
    cfg = with_(CFG, max_steps=6, **{"engine.zero_stage": 3, "engine.activation_checkpointing": True,
                                     "launch.hostfile": str(hostfile), "checkpoint.every": 3, "logging.every": 1,
                                     "logging.eval_every": 0})
    r1 = run_train(tokens, cfg, str(tmp_path / "w"))
    assert r1.launched and r1.steps == 6
    launch = _launch_log(r1.log_path)
    assert f"--hostfile {hostfile}" in launch and "--num_gpus" not in launch and "--no_ssh_check" in launch
    world_info = re.search(r"--world_info=(\S+)", launch).group(1)
    assert json.loads(base64.urlsafe_b64decode(world_info)) == {"localhost": [0, 1]}  # 2 ranks from the hostfile
    assert "Unable to find hostfile" not in launch
    losses = [r["loss"] for r in _records(r1.metrics_path, "train")]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    marker = ckpt.read_marker(r1.checkpoint_dir)
    assert marker["zero_stage"] == 3 and marker["world_size"] == 2
    files = {f["path"] for f in marker["files"]}
    assert {f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in (0, 1) for k in ("model", "optim")} <= files
    weights = fs.sha256_file(Path(r1.checkpoint_dir) / "model.safetensors")

    shard = Path(r1.checkpoint_dir) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    r2 = run_train(tokens, cfg, str(tmp_path / "w"))
    assert r2.launched and r2.resumed_from == 3 and r2.checkpoint_dir == r1.checkpoint_dir
    assert fs.sha256_file(Path(r2.checkpoint_dir) / "model.safetensors") == weights
    assert [r["loss"] for r in _records(r2.metrics_path, "train")] == losses


@pytest.mark.slow  # minutes on 2 cores (CI stays under 30 min)
def test_deepspeed_bf16_zero2_trains(tokens, tmp_path):
    cfg = with_(CFG, max_steps=12, **{"engine.precision": "bf16", "batch.grad_accum": 2, "checkpoint.every": 12,
                                      "logging.every": 1, "logging.eval_every": 0})
    r = run_train(tokens, cfg, str(tmp_path))
    losses = [r["loss"] for r in _records(r.metrics_path, "train")]
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3  # it learns in bf16
    assert ckpt.read_marker(r.checkpoint_dir)["precision"] == "bf16" and ckpt.verify(r.checkpoint_dir) is None
    assert json.loads((Path(r.run_dir) / "ds_config.json").read_text())["bf16"] == {"enabled": True}


def test_accelerator_picks_device_and_backend(monkeypatch):
    """`train.engine.accelerator`: cpu -> gloo on the CPU; cuda -> this rank's GPU (LOCAL_RANK) and NCCL, or a clear
    error naming the field on a host where torch sees no GPU. The launcher's environment follows the field."""
    from lifecycle.tasks.train import trainer as train_loop
    from lifecycle.tasks.train.distributed import select_device
    from lifecycle.tasks.train.launcher import launch_args

    assert select_device(CFG) == (torch.device("cpu"), "gloo")
    cuda = with_(CFG, **{"engine.accelerator": "cuda"})
    if torch.cuda.is_available():
        monkeypatch.setenv("LOCAL_RANK", "0")
        assert select_device(cuda) == (torch.device("cuda", 0), "nccl")
    else:
        with pytest.raises(RuntimeError, match="train.engine.accelerator=cuda, but torch sees no CUDA device"):
            select_device(cuda)
    assert not hasattr(train_loop, "DEVICE")  # the device is the Trainer's attribute, not module state
    assert launch_args(cuda, 29500, Path("/tmp"), 1) == ["--num_gpus", str(CFG.batch.num_ranks), "--master_port", "29500"]


def test_a_rank_imports_deepspeed_without_mlflow():
    """DeepSpeed's autotuner would import MLflow (and pandas) on every `import deepspeed`: most of that import's
    time in a rank. The rank keeps it out, and DeepSpeed takes it as not installed."""
    code = ("import sys; from lifecycle.tasks.train.engine import keep_mlflow_out; keep_mlflow_out(); "
            "import deepspeed; from deepspeed.autotuning import autotuner; "
            "assert sys.modules['mlflow'] is None and not autotuner.has_mlflow; "
            "assert not [m for m in sys.modules if m.startswith(('mlflow.', 'pandas'))]; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
