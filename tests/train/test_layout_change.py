"""Checkpoints that change layout (lifecycle.tasks.train.layout): the conversion logic (fast, no DeepSpeed launch),
then real resumes across layouts on 2 CPU ranks (slow): a run saved under layout A resumes under layout B with
the same global batch, and its loss curve stays within 1e-4 (relative) of an uninterrupted run under A.
"""

import json
from pathlib import Path

import pytest

from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train import layout as lay
from lifecycle.tasks.train.config import TrainConfig
from tests.train.test_train import CFG, make_tokens, with_

# --------------------------------------------------------------------------------------------------
# fast


def test_layout_of_and_describe():
    assert lay.layout_of(CFG) == {"dp": 2, "zero": 2, "micro": 8, "accum": 1}
    assert lay.describe(lay.layout_of(CFG)) == "dp=2,zero=2,micro=8,accum=1"
    ac = with_(CFG, **{"engine.activation_checkpointing": True, "batch.num_ranks": 1, "engine.zero_stage": 3})
    assert lay.describe(lay.layout_of(ac)) == "dp=1,zero=3,micro=8,accum=1,ac=1"


def test_trajectory_key_ignores_the_layout_and_keeps_the_rest():
    moved = with_(CFG, **{"batch.num_ranks": 1, "batch.grad_accum": 2, "engine.zero_stage": 3,
                          "engine.activation_checkpointing": True})
    assert lay.trajectory_key(moved) == lay.trajectory_key(CFG)
    assert moved.run_key() != CFG.run_key()  # the run directory (fingerprint) still holds the layout
    for other in (with_(CFG, **{"optimizer.lr": 1e-3}), with_(CFG, seed=7), with_(CFG, **{"engine.precision": "bf16"})):
        assert lay.trajectory_key(other) != lay.trajectory_key(CFG)


def test_fit_batch_keeps_the_global_batch_or_refuses_naming_the_numbers():
    one = with_(CFG, **{"batch.num_ranks": 1, "engine.zero_stage": 3})
    fitted = lay.fit_batch(one, CFG.global_batch)
    assert fitted.batch.grad_accum == 2 and fitted.global_batch == CFG.global_batch == 16
    assert lay.fit_batch(CFG, 16) is CFG
    with pytest.raises(ValueError, match=r"global batch of 12 sequences.*8 x data-parallel degree 1 .* = 8 does not divide"):
        lay.fit_batch(one, 12)


def _fake_run(workdir: Path, cfg: TrainConfig, trajectory: str, steps: list[int], name: str) -> Path:
    """A run directory as run_train leaves it: config.json with the trajectory, committed tag dirs."""
    run_dir = workdir / "train" / name
    for s in steps:
        tag = run_dir / "checkpoints" / ckpt.tag_name(s)
        tag.mkdir(parents=True)
        (tag / "x.bin").write_bytes(b"x" * s)
        ckpt.commit(tag, s, {"layout": lay.layout_of(cfg), "format": "deepspeed"})
    (run_dir / "config.json").write_text(json.dumps({"train": cfg.model_dump(mode="json"), "trajectory": trajectory}))
    return run_dir


def test_siblings_and_batch_for_siblings(tmp_path):
    a = _fake_run(tmp_path, CFG, "T", [4, 8], "a")
    _fake_run(tmp_path, CFG, "other", [12], "b")  # another trajectory: not a sibling
    found = lay.siblings(tmp_path, "T", max_steps=20)
    assert [(s.run_dir, s.step, s.global_batch) for s in found] == [(a, 8, 16)]
    assert lay.siblings(tmp_path, "T", max_steps=6)[0].step == 4  # commits past max_steps are not resumed
    assert lay.siblings(tmp_path, "T", max_steps=20, exclude=a) == []
    # only the ranks and the ZeRO stage changed: grad_accum adjusts to the sibling's global batch
    one = with_(CFG, **{"batch.num_ranks": 1, "engine.zero_stage": 3})
    assert lay.batch_for_siblings(one, found).batch.grad_accum == 2
    # the micro-batch changed too and the global batch with it: another trajectory, the config as given
    other = with_(one, **{"batch.micro_batch_size": 4})
    assert lay.batch_for_siblings(other, found) is other
    # the same global batch under another split: as given
    split = with_(one, **{"batch.micro_batch_size": 4, "batch.grad_accum": 4})
    assert lay.batch_for_siblings(split, found) is split
    # ranks changed, and no grad_accum fits: refused with the reason
    three = with_(CFG, **{"batch.num_ranks": 3, "batch.micro_batch_size": 8})
    with pytest.raises(ValueError, match="does not divide it"):
        lay.batch_for_siblings(three, found)


def test_a_sibling_commit_is_hashed_when_it_is_converted_not_when_it_is_listed(tmp_path, caplog, monkeypatch):
    """`siblings` runs at every launch over every run of the trajectory: it checks sizes; the commit chosen for
    conversion is hashed first, and a damaged one is not converted."""
    import logging

    from lifecycle.tasks.train import launch

    a = _fake_run(tmp_path, CFG, "T", [4, 8], "a")
    (a / "checkpoints" / ckpt.tag_name(8) / "x.bin").write_bytes(b"y" * 8)  # the same size, other bytes
    [sib] = lay.siblings(tmp_path, "T", max_steps=20)
    assert sib.step == 8
    converted = []
    monkeypatch.setattr(launch, "convert_layout", lambda src, root, dst: converted.append(src))
    one = with_(CFG, **{"batch.num_ranks": 1, "engine.zero_stage": 3})
    with caplog.at_level(logging.WARNING, logger="lifecycle.tasks.train.launch"):
        assert launch._resume_other_layout([sib], tmp_path / "new" / "checkpoints", one, tmp_path / "new") is None
    assert converted == [] and "x.bin: sha256 mismatch" in caplog.text and "step_00000008" in caplog.text


def test_the_resumed_step_is_the_one_the_ranks_restored(tmp_path):
    from lifecycle.tasks.train.launch import _restored

    metrics = tmp_path / "metrics.jsonl"
    assert _restored(metrics, 10) == (10, [])  # no file: the supervisor's pick
    metrics.write_text('{"kind": "restore", "step": 5, "tier": "disk"}\n{"kind": "train", "step": 6}\n'
                       '{"kind": "restore", "step": 6, "tier": "disk"}\n{"kind": "train", "step": 7}\n')
    assert _restored(metrics, 10)[0] == 6  # this launch's: the last one
    metrics.write_text('{"kind": "train", "step": 1}\n')
    assert _restored(metrics, None) == (None, [])


def test_convert_refuses_with_every_converters_reason_and_takes_a_registered_one(tmp_path, monkeypatch):
    src_cfg = with_(CFG, **{"engine.zero_stage": 0})
    run = _fake_run(tmp_path, src_cfg, "T", [4], "a")
    [sib] = lay.siblings(tmp_path, "T", max_steps=10)
    dst = lay.layout_of(with_(CFG, **{"batch.num_ranks": 1, "engine.zero_stage": 3, "batch.grad_accum": 2}))
    with pytest.raises(ValueError, match=r"deepspeed-universal: ZeRO stage 0 keeps a plain torch optimizer state"):
        lay.convert(sib, tmp_path / "dst", dst)
    assert not (tmp_path / "dst" / ckpt.tag_name(4)).exists()
    assert "pp/sp/ep above 1, or a tp destination" in lay.CONVERTERS[0].reason(dst, {**dst, "tp": 2})
    assert "pp/sp/ep above 1" in lay.CONVERTERS[0].reason({**dst, "pp": 2}, dst)
    assert lay.CONVERTERS[0].reason({**dst, "tp": 2}, dst) is None  # tp slices merge into whole parameters
    assert "not a pipeline checkpoint" in lay.CONVERTERS[1].reason(dst, dst)

    def copy(src_tag, dst_tag, src, dst):  # a converter as tp18/pp18 register theirs
        (dst_tag / "x.bin").write_bytes((src_tag / "x.bin").read_bytes())
        return {"format": "copied"}

    monkeypatch.setattr(lay, "CONVERTERS", [*lay.CONVERTERS, lay.Converter("copy", lambda s, d: None, copy)])
    tag, marker = lay.convert(sib, tmp_path / "dst", dst)
    assert tag == tmp_path / "dst" / ckpt.tag_name(4) and ckpt.verify(tag) is None
    assert marker["format"] == "copied" and marker["converter"] == "copy" and marker["step"] == 4
    assert marker["layout"] == lay.layout_of(src_cfg) and marker["converted_for"] == dst
    assert marker["converted_from"] == str(run / "checkpoints" / ckpt.tag_name(4))

    def broken(src_tag, dst_tag, src, dst):
        (dst_tag / "half").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(lay, "CONVERTERS", [lay.Converter("broken", lambda s, d: None, broken)])
    ckpt.remove(tag)
    with pytest.raises(RuntimeError, match="disk full"):
        lay.convert(sib, tmp_path / "dst", dst)
    assert not tag.exists()  # no half-converted directory left behind


def _universal(tmp_path, optimizer_state: dict, flat: bool, step_files: bool) -> Path:
    """A universal checkpoint as ds_to_universal leaves it: zero/optimizer_state.pt and per-parameter states."""
    import torch
    from safetensors.torch import save_file

    tag = tmp_path / "step_00000004"
    (tag / "zero").mkdir(parents=True)
    weights = {"w.weight": torch.arange(6.0).view(2, 3), "n.weight": torch.ones(3)}
    save_file(weights, str(tag / "model.safetensors"))
    torch.save(optimizer_state, tag / "zero" / "optimizer_state.pt")
    for name, w in weights.items():
        (tag / "zero" / name).mkdir()
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            torch.save(w.flatten() if flat else {"param": w.clone(), "cat_dim": 0}, tag / "zero" / name / f"{key}.pt")
        if step_files:
            torch.save(torch.tensor(4.0), tag / "zero" / name / "step.pt")
    return tag


def test_normalize_universal_makes_either_stage_loadable(tmp_path):
    """ds_to_universal writes optimizer_state.pt in the source stage's layout; each of DeepSpeed's universal
    loaders reads only its own (ZeRO-1/2: top-level ds_version and param_groups, per-parameter step.pt and shaped
    states; ZeRO-3: optimizer_state_dict.state[0].step and .param_groups)."""
    import torch

    groups = [{"lr": 2.5e-3, "weight_decay": 0.1, "params": [0]}, {"lr": 2.5e-3, "weight_decay": 0.0, "params": [1]}]
    # from ZeRO-2: the ZeRO-3 loader's keys are added, the rest is left as it was
    tag = _universal(tmp_path / "z2", {"ds_version": "0.19.8", "param_groups": groups, "clip_grad": 1.0}, False, True)
    lay.normalize_universal(str(tag), 4)
    sd = torch.load(tag / "zero" / "optimizer_state.pt", weights_only=False)
    assert sd["optimizer_state_dict"]["param_groups"] == groups and float(sd["optimizer_state_dict"]["state"][0]["step"]) == 4
    assert sd["clip_grad"] == 1.0 and sd["ds_version"] == "0.19.8"
    # from ZeRO-3: ds_version, top-level param_groups, step files and shaped states are added
    inner = {"state": {0: {"step": torch.tensor(4.0)}}, "param_groups": groups}
    tag = _universal(tmp_path / "z3", {"optimizer_state_dict": inner, "zero_stage": 3}, True, False)
    lay.normalize_universal(str(tag), 4)
    sd = torch.load(tag / "zero" / "optimizer_state.pt", weights_only=False)
    assert sd["param_groups"] == groups and sd["ds_version"] and sd["optimizer_state_dict"] is not None
    for name, shape in (("w.weight", (2, 3)), ("n.weight", (3,))):
        assert float(torch.load(tag / "zero" / name / "step.pt", weights_only=False)) == 4
        state = torch.load(tag / "zero" / name / "exp_avg.pt", weights_only=False)
        assert tuple(state["param"].shape) == shape
    assert torch.equal(torch.load(tag / "zero" / "w.weight" / "fp32.pt", weights_only=False)["param"],
                       torch.arange(6.0).view(2, 3))


# --------------------------------------------------------------------------------------------------
# slow: real 2-rank runs


def _losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(path)) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_tokens(tmp_path_factory.mktemp("tokens"), 600)


BASE = with_(CFG, max_steps=8, **{"checkpoint.every": 4, "logging.every": 1, "logging.eval_every": 0, "launch.timeout_s": 900, "launch.stall_s": 600})
REL = 1e-4


def _change(tokens, tmp_path, src: dict, dst: dict):
    """Uninterrupted run under `src`; the same run stopped at step 4 and finished under `dst`."""
    from lifecycle.tasks.train.launch import run_train

    a = with_(BASE, **src)
    whole = run_train(tokens, a, str(tmp_path / "whole"))
    first = run_train(tokens, with_(a, max_steps=4), str(tmp_path / "moved"))
    rest = run_train(tokens, with_(BASE, **dst), str(tmp_path / "moved"))
    assert first.steps == 4 and rest.resumed_from == 4 and rest.steps == 8 and rest.run_dir != first.run_dir
    ref, got = _losses(whole.metrics_path), _losses(rest.metrics_path)
    assert sorted(got) == list(range(5, 9))  # the new run directory's curve starts after the converted commit
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in got)
    print(f"{lay.describe(lay.layout_of(a))} -> {rest.layout}: max relative loss difference {worst:.2e} over steps 5-8")
    assert worst <= REL, (ref, got)
    return first, rest, worst


@pytest.mark.slow  # 3 launches, 1-3 minutes each on 2 loaded cores
def test_dp2_zero2_resumes_as_dp1_zero3(tokens, tmp_path):
    first, rest, _ = _change(tokens, tmp_path, {}, {"batch.num_ranks": 1, "engine.zero_stage": 3})
    assert rest.layout == "dp=1,zero=3,micro=8,accum=2"  # grad_accum adjusted: the same global batch
    assert rest.layout_change == "dp=2,zero=2,micro=8,accum=1 -> dp=1,zero=3,micro=8,accum=2 at step 4"
    marker = ckpt.read_marker(Path(rest.run_dir) / "checkpoints" / ckpt.tag_name(4))
    assert marker["format"] == "universal" and marker["converter"] == "deepspeed-universal"
    assert marker["layout"] == {"dp": 2, "zero": 2, "micro": 8, "accum": 1}
    assert ckpt.read_marker(rest.checkpoint_dir)["layout"] == {"dp": 1, "zero": 3, "micro": 8, "accum": 2}
    log = open(rest.log_path).read()
    assert "layout change: dp=2,zero=2,micro=8,accum=1 -> dp=1,zero=3,micro=8,accum=2 at step 4" in log
    [change] = [r for r in map(json.loads, open(rest.metrics_path)) if r["kind"] == "layout_change"]
    assert change["step"] == 4 and change["to"] == "dp=1,zero=3,micro=8,accum=2"


@pytest.mark.slow
def test_dp1_zero3_resumes_as_dp2_zero2(tokens, tmp_path):
    _, rest, _ = _change(tokens, tmp_path, {"batch.num_ranks": 1, "batch.grad_accum": 2, "engine.zero_stage": 3},
                         {"batch.num_ranks": 2, "batch.grad_accum": 2, "engine.zero_stage": 2})
    assert rest.layout == "dp=2,zero=2,micro=8,accum=1"


@pytest.mark.slow
def test_dp2_zero1_resumes_as_dp2_zero3(tokens, tmp_path):
    _, rest, _ = _change(tokens, tmp_path, {"engine.zero_stage": 1}, {"engine.zero_stage": 3})
    assert rest.layout_change.startswith("dp=2,zero=1,micro=8,accum=1 -> dp=2,zero=3,micro=8,accum=1")


@pytest.mark.slow
def test_pp2_resumes_as_one_dense_rank(tokens, tmp_path):
    """pp=2 (ZeRO-1) to pp=1 (ZeRO-0, one rank) through the pipeline converter (parallel.pp_convert.to_dense)."""
    _, rest, _ = _change(tokens, tmp_path,
                         {"parallel.pp": 2, "engine.zero_stage": 1, "batch.grad_accum": 2, "batch.micro_batch_size": 4},
                         {"batch.num_ranks": 1, "engine.zero_stage": 0, "batch.grad_accum": 2,
                          "batch.micro_batch_size": 4})
    before, after = rest.layout_change.split(" -> ")
    assert "pp=2" in before and "zero=1" in before and "pp" not in after and "zero=0" in after
    assert ckpt.read_marker(Path(rest.run_dir) / "checkpoints" / ckpt.tag_name(4))["converter"] == "pipeline-to-dense"


@pytest.mark.slow
def test_tp2_resumes_as_one_rank(tokens, tmp_path):
    """tp=2 (ZeRO-1) to tp=1 (one rank, ZeRO-1): ds_to_universal merges the tp slices (parallel.tp gives each
    sliced parameter its universal_checkpoint_info)."""
    _, rest, _ = _change(tokens, tmp_path, {"parallel.tp": 2, "engine.zero_stage": 1, "model.dropout": 0.0},
                         {"batch.num_ranks": 1, "engine.zero_stage": 1, "model.dropout": 0.0})
    before, after = rest.layout_change.split(" -> ")
    assert "tp=2" in before and "tp" not in after
    assert ckpt.read_marker(Path(rest.run_dir) / "checkpoints" / ckpt.tag_name(4))["converter"] == "deepspeed-universal"


def test_a_new_run_that_cannot_keep_the_global_batch_is_refused(tokens, tmp_path):
    """No launch: the sibling is a committed fake; the refusal comes before anything starts."""
    from lifecycle.tasks.data.tokenize.stage import token_shards
    from lifecycle.tasks.train.launch import resolve_model, run_train, trajectory_of

    meta = token_shards(tokens)
    resolved, _ = resolve_model(BASE, meta.vocab_size, meta.num_tokens["train"])  # as run_train resolves it
    _fake_run(tmp_path, resolved, trajectory_of(tokens, resolved), [4], "a")
    with pytest.raises(ValueError, match=r"global batch of 16 sequences.* = 24 does not divide it"):
        run_train(tokens, with_(BASE, **{"batch.num_ranks": 3}), str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["a"]  # nothing started
