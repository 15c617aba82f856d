"""clip_train.loader: dali, with real NVIDIA DALI on its CPU operators (the `dali` extra, in dev): the same samples
in the same order as the worker processes' backend, pixels within the stated tolerance, exact resume from any step
(the loader alone, and one launched 2-rank run), the config check where DALI is not installed, and
bench/gpu_figures.sh's `dali` step."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from lifecycle.tasks.clip.augment import STD
from lifecycle.tasks.clip.config import ClipModelConfig, ClipTrainConfig
from lifecycle.tasks.clip.dali import DaliLoader
from lifecycle.tasks.clip.loader import Loader, Pairs, split
from tests.conftest import ROOT

TINY = ClipModelConfig(image_size=16, patch=8, width=16, layers=1, heads=2, text_width=16, text_layers=1,
                       context=8, embed_dim=16, vocab_size=300)
LEVELS = torch.tensor(STD * 255).view(1, 3, 1, 1)  # a normalised difference times this: levels of 255
STEPS = 6  # 4 pairs a step, each rank owns 16-17 pairs: the walk crosses an epoch


def cfg(**kw) -> ClipTrainConfig:
    return ClipTrainConfig.model_validate({"model": TINY, "micro_batch": 4, "workers": 0, "cache_mb": 1,
                                           "crop_scale": (0.5, 0.9), **kw})


def batches(loader, steps) -> list[tuple[torch.Tensor, torch.Tensor]]:
    try:
        return [loader.next(s)[:2] for s in steps]
    finally:
        loader.close()


def test_dali_yields_the_workers_batches_within_the_resize_filters_rounding(shards):
    """Rank by rank, step by step: the same captions in the same order (so the same samples) and the same random
    crops; the pixels differ only by the two cubic filters' rounding (docs/data.md: mean 0.13, max 13 levels of 255
    on the demo's shards; here the tiny set's)."""
    train, _ = split(Pairs(shards.dir).ids, 0.1)
    for rank in range(2):
        workers = Loader(Pairs(shards.dir), train, cfg(), rank, 2, STEPS)
        dali = DaliLoader(Pairs(shards.dir), train, cfg(), rank, 2, STEPS)
        ours, theirs = batches(workers, range(STEPS)), batches(dali, range(STEPS))
        assert set(workers.cache.items) == set(dali.cache.items) and workers.cache.stats() == dali.cache.stats()
        for (a, tokens_a), (b, tokens_b) in zip(ours, theirs, strict=True):
            assert torch.equal(tokens_a, tokens_b) and a.shape == b.shape == (4, 3, 16, 16)
            diff = ((a - b) * LEVELS).abs()
            assert diff.mean() < 0.5 and diff.max() <= 16, (diff.mean(), diff.max())
        # the crop is reproduced, not approximated: the whole image against the same batch differs far more
        whole = batches(DaliLoader(Pairs(shards.dir), train, cfg(crop_scale=(1.0, 1.0)), rank, 2, 1), [0])
        assert ((whole[0][0] - ours[0][0]) * LEVELS).abs().mean() > 5


def test_without_a_crop_dali_decodes_what_pillow_decodes(shards):
    """DALI's CPU decoder and Pillow are both libjpeg-turbo: with crop_scale (1, 1) at the shards' resolution
    nothing is resized, and the batches are equal to the float32 normalisation's rounding."""
    train, _ = split(Pairs(shards.dir).ids, 0.1)
    whole = cfg(crop_scale=(1.0, 1.0))
    a = batches(Loader(Pairs(shards.dir), train, whole, 0, 2, 2), range(2))
    b = batches(DaliLoader(Pairs(shards.dir), train, whole, 0, 2, 2), range(2))
    for (x, _), (y, _) in zip(a, b, strict=True):
        assert torch.allclose(x, y, atol=1e-5)


def test_a_resumed_dali_loader_reads_the_uninterrupted_runs_batches(shards):
    """Exact resume at the loader level: a DALI loader started at step 3 (a run resumed from a step-3 commit)
    gives, bit for bit, steps 3-5 of the one started at 0; steps are asked for in order."""
    train, _ = split(Pairs(shards.dir).ids, 0.1)
    straight = batches(DaliLoader(Pairs(shards.dir), train, cfg(prefetch=3), 1, 2, STEPS), range(STEPS))
    resumed = batches(DaliLoader(Pairs(shards.dir), train, cfg(prefetch=1), 1, 2, STEPS), range(3, STEPS))
    for (x, t), (y, u) in zip(straight[3:], resumed, strict=True):
        assert torch.equal(x, y) and torch.equal(t, u)
    skipping = DaliLoader(Pairs(shards.dir), train, cfg(), 0, 2, STEPS)
    with pytest.raises(RuntimeError, match="asked for step 2 after step 0"):
        batches(skipping, [0, 2])


HIDE_DALI = r"""
import runpy, sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name == "nvidia.dali" or name.startswith("nvidia.dali."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def without_dali(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args` in a process where `nvidia.dali` cannot be found."""
    return subprocess.run([sys.executable, "-c", HIDE_DALI, module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_dali_without_dali_installed_is_refused_at_the_config_check(tmp_path):
    """One line naming the field and the remedy, exit 2, before any stage runs."""
    proc = without_dali("lifecycle.cli", "run", str(ROOT / "deploy/configs/clip-demo.yaml"),
                        "--set", f"workdir={tmp_path}", "--set", "clip_train.loader=dali")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "clip_train" in line and "NVIDIA DALI is not installed" in line and "[dali]" in line
    assert not any(tmp_path.iterdir())  # nothing computed


def test_gpu_figures_last_step_measures_both_loaders_or_says_dali_is_missing(tmp_path):
    """bench/gpu_figures.sh's `dali` step on the CPU (--cpu-check): both backends' stall per step and their ratio in
    one JSON line; bench.image_loader without DALI says so in its JSON line and exits 0, so the script goes on."""
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_figures.sh"), "--cpu-check", "--python", sys.executable,
                        "--out", str(tmp_path), "--only", "dali"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (line,) = (tmp_path / "summary.jsonl").read_text().splitlines()
    got = json.loads(line)
    for arm in ("workers", "dali"):
        assert 0 <= got[arm]["median"] <= got[arm]["p90"] <= got[arm]["max"] < 1 and got[arm]["steps"] == 5
    assert got["ratio_mean"] == pytest.approx(got["dali"]["mean"] / got["workers"]["mean"])
    assert 0 < got["pixels_cubic"]["mean"] < 0.5 and got["pixels_cubic"]["max"] <= 16
    proc = without_dali("bench.image_loader", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DALI not installed" in json.loads(proc.stdout.strip().splitlines()[-1])["skipped"]


def test_two_launched_ranks_train_on_dali_and_a_resumed_run_ends_on_the_same_weights(shards, tmp_path):
    """clip_train with `loader: dali` in 2 real DeepSpeed ranks (gloo, ZeRO-1): a rerun after a crash past step 2's
    commit (step 4's commit and the dataset gone) resumes there and ends with the same bytes."""
    from lifecycle.core.fs import sha256_file
    from lifecycle.tasks.clip.train.stage import run_clip_train
    from lifecycle.tasks.train import commit

    run = cfg(loader="dali", steps=4, save_every=2, ranks=2, threads_per_rank=1, holdout=0.25,
              model=TINY.model_copy(update={"vocab_size": 0}))
    first = run_clip_train(shards, run, str(tmp_path))
    weights, root = sha256_file(first.dir / "model.safetensors"), first.manifest()["checkpoint"].rsplit("/", 1)[0]
    assert first.manifest()["metrics"]["steps"] == 4 and 0 <= first.manifest()["metrics"]["stall_fraction"] < 1
    commit.remove(f"{root}/{commit.tag_name(4)}")
    shutil.rmtree(first.dir)
    again = run_clip_train(shards, run, str(tmp_path))
    assert again.manifest()["resumed_from"] == 2 and sha256_file(again.dir / "model.safetensors") == weights
