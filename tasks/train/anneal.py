"""Annealing a warmup-stable-decay run from another run's commit (`train.optimizer.schedule: wsd`).

Two WSD runs that differ only in where their decay starts and how it goes (`optimizer.decay_steps`,
`decay_fraction`, `decay_shape`, `min_lr`) train the same steps up to the earlier of their decay starts: the same
learning rate (warmup, then `lr`), batches, seeds and state. So a run that is an anneal of a longer one (or a
longer run extended from a shorter one's stable phase) need not recompute those steps: `branch_source` finds,
among the work dir's train runs, one with the same *stable prefix* (the trajectory key less those four fields) and
the same layout and global batch, with a commit at or before both decay starts, and `branch` copies that commit
(hard links where the file system allows) into the new run's checkpoints, with a marker naming where it came
from. The new run then resumes from it as from its own commit: every step after it is the step an uninterrupted
run of the new config trains (tests/train/test_recipe_runs.py). config.json records the stable prefix.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from lifecycle.core import dataset as ds
from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.layout import layout_of, train_runs, trajectory_key

DECAY_FIELDS = ("decay_steps", "decay_fraction", "decay_shape", "min_lr")
"""Optimizer fields that only shape the decay: two WSD runs that differ in them share their stable phase."""


def stable_prefix_of(tokens: ds.DatasetRef, cfg: TrainConfig, init: dict, code: str) -> str | None:
    """The fingerprint of `cfg`'s stable phase (its trajectory without DECAY_FIELDS); None unless WSD."""
    if cfg.optimizer.schedule != "wsd":
        return None
    key = trajectory_key(cfg)
    for name in DECAY_FIELDS:
        key["optimizer"].pop(name, None)
    return ds.fingerprint("train-stable-prefix", {**key, **init}, code, [tokens])


def branch_source(workdir: Path, prefix: str | None, cfg: TrainConfig, exclude: Path) -> Path | None:
    """The newest verified commit of another run with stable prefix `prefix`, `cfg`'s layout and global batch, at
    a step where neither run has started to decay (and below `cfg.max_steps`); None when there is none."""
    if prefix is None:
        return None
    best: Path | None = None
    for run_dir, launch in train_runs(workdir, exclude):
        if launch.get("stable_prefix") != prefix:
            continue
        other = TrainConfig.model_validate(launch["train"])
        if layout_of(other) != layout_of(cfg) or other.global_batch != cfg.global_batch:
            continue
        limit = min(cfg.decay_start, other.decay_start, cfg.max_steps - 1)
        tag = ckpt.latest_valid(run_dir / "checkpoints", max_step=limit)
        if tag is not None and (best is None or ckpt.step_of(tag) > ckpt.step_of(best)):
            best = tag
    return best


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def branch(src_tag: Path, ckpt_root: Path, run_dir: Path) -> Path | None:
    """Copy commit `src_tag` into `ckpt_root` under its step and commit it there (marker last, naming the source);
    train.log says so. None, with the reason in train.log, when the copy fails (the source run pruned it
    meanwhile, a full disk): the run then starts as it would have without it."""
    step = ckpt.step_of(src_tag)
    dst = ckpt_root / ckpt.tag_name(step)
    if dst.exists():
        ckpt.remove(dst)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(src_tag, dst, copy_function=_link_or_copy, ignore=shutil.ignore_patterns(ckpt.MARKER))
        keep = {k: v for k, v in ckpt.read_marker(src_tag).items() if k not in ("files", "step", "tag", "time")}
        ckpt.commit(dst, step, {**keep, "branched_from": str(src_tag)})
        line = f"branched from {src_tag} at step {step}: the same stable phase (lifecycle.tasks.train.anneal)"
    except (OSError, ValueError) as e:
        if dst.exists():
            ckpt.remove(dst)
        dst, line = None, f"not branching from {src_tag}: {type(e).__name__}: {e}"
    with open(run_dir / "train.log", "a") as f:
        f.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
    return dst
