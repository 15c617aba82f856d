"""clip_train: the dual encoder trained on image_preprocess's shards by launched DeepSpeed ranks
(lifecycle.tasks.clip.trainer), supervised from here; its output is a dataset holding the model package.

The run directory `<workdir>/clip_train/<fingerprint>/` (the fingerprint of the dataset this stage commits: the
image shards, this config and the code) keeps the committed checkpoints, so a rerun after a crash resumes from the
newest commit, and a rerun after success reuses the committed dataset without launching. The dataset holds the
final commit's model.safetensors and model_config.json, its COMMITTED.json, the caption tokenizer, the run's
metrics.jsonl and its summary (`metrics` in the manifest: steps, final loss, mean stall fraction, cache hits).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from lifecycle.core import fs
from lifecycle.core.code import code_version
from lifecycle.core.dataset import DatasetRef, DatasetWriter, materialize
from lifecycle.core.procs import free_port, start_time
from lifecycle.core.shards import StageCode, heartbeat
from lifecycle.tasks.clip.config import ClipTrainConfig
from lifecycle.tasks.train import commit
from lifecycle.tasks.train.launcher import Launch, RankFailed, local_rank_envs, rank_threads
from lifecycle.tasks.train.supervise import prebuild_shm_op

NAME = "clip_train"
PACKAGE = ("model.safetensors", "model_config.json", "COMMITTED.json")


def resolved(images: DatasetRef, cfg: ClipTrainConfig) -> ClipTrainConfig:
    """`cfg` with the model's vocabulary and image size taken from the image_preprocess dataset."""
    extra = images.manifest()
    vocab, resolution = extra.get("vocab_size"), extra.get("resolution")
    if vocab is None or resolution is None:
        raise ValueError(f"{images.path}: not an image_preprocess dataset (no vocab_size/resolution in its manifest)")
    if cfg.model.vocab_size and cfg.model.vocab_size < vocab:
        raise ValueError(f"clip_train.model.vocab_size {cfg.model.vocab_size} < the captions' tokenizer ({vocab})")
    model = cfg.model.model_copy(update={"vocab_size": cfg.model.vocab_size or vocab})
    if model.image_size != resolution:
        raise ValueError(f"clip_train.model.image_size {model.image_size} != image_preprocess.resolution "
                         f"{resolution} ({images.path})")
    return cfg.model_copy(update={"model": type(model).model_validate(model.model_dump())})


def summary(metrics_path: Path) -> dict:
    """The run's figures from its metrics.jsonl (the last record of each step): the first step, which starts the
    workers, is left out of the stall."""
    by_step = {}
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line)
        by_step[rec["step"]] = rec
    recs = [by_step[s] for s in sorted(by_step)]
    steady = recs[1:] or recs
    return {"steps": recs[-1]["step"], "final_loss": recs[-1]["loss"], "first_loss": recs[0]["loss"],
            "stall_fraction": sum(r["wait_s"] for r in steady) / sum(r["step_s"] for r in steady),
            "step_s": sum(r["step_s"] for r in steady) / len(steady),
            "cache_hits_rank0": recs[-1]["cache_hits"], "cache_misses_rank0": recs[-1]["cache_misses"]}


def last_error(log: Path) -> str:
    """`: <the last line of the log that names an error>`, or nothing."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if "Error" in ln]
    return f": {lines[-1]}" if lines else ""


def launch(spec_path: Path, cfg: ClipTrainConfig, run_dir: Path) -> None:
    """Start the ranks on this host and wait for them; a failed rank fails the stage naming its log."""
    env = {**os.environ, "DS_ACCELERATOR": cfg.accelerator, "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(rank_threads(cfg.threads_per_rank, cfg.ranks)),
           "LIFECYCLE_SUPERVISOR_PID": str(os.getpid()), "LIFECYCLE_SUPERVISOR_START": str(start_time(os.getpid()))}
    prebuild_shm_op(cfg.accelerator, env)
    cmd = [sys.executable, "-u", "-m", "lifecycle.tasks.clip.trainer", "--config", str(spec_path)]
    with open(run_dir / "train.log", "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')}: {cfg.ranks} ranks: {' '.join(cmd)}\n".encode())
        log.flush()
        ranks = Launch.start_local(cmd, local_rank_envs(env, cfg.ranks, free_port()), run_dir, log)
        try:
            while not ranks.poll():
                heartbeat()
                time.sleep(0.2)
        except RankFailed as e:
            raise RuntimeError(f"clip_train: {e}{last_error(run_dir / 'train.log')}; see {run_dir / 'train.log'}") from None
        except BaseException:
            ranks.stop()
            raise


def _build(images: DatasetRef, cfg: ClipTrainConfig, workdir: str, writer: DatasetWriter) -> dict:
    run_dir = Path(workdir).resolve() / NAME / writer.fingerprint[:20]
    root = run_dir / "checkpoints"
    run_dir.mkdir(parents=True, exist_ok=True)
    before = commit.latest_valid(root)
    resumed_from = commit.step_of(before) if before is not None else None
    if resumed_from != cfg.steps:
        spec = {"train": cfg.model_dump(mode="json"), "dataset": images.path, "ckpt_root": str(root),
                "run_dir": str(run_dir)}
        fs.atomic_write_json(run_dir / "run.json", spec)
        launch(run_dir / "run.json", cfg, run_dir)
    final = commit.latest_valid(root)
    if final is None or commit.step_of(final) != cfg.steps:
        raise RuntimeError(f"clip_train: the ranks exited without committing step {cfg.steps} (see {run_dir})")
    for name in PACKAGE:
        shutil.copyfile(final / name, writer.path(name))
        writer.add_file(name)
    shutil.copyfile(images.dir / "tokenizer.json", writer.path("tokenizer.json"))
    writer.add_file("tokenizer.json")
    shutil.copyfile(run_dir / "metrics.jsonl", writer.path("metrics.jsonl"))
    writer.add_file("metrics.jsonl")
    figures = summary(run_dir / "metrics.jsonl")
    return {"num_rows": 0, "extra": {"metrics": figures, "checkpoint": str(final), "resumed_from": resumed_from,
                                     "train": cfg.model_dump(mode="json")}}


def run_clip_train(images: DatasetRef, cfg: ClipTrainConfig, workdir: str) -> DatasetRef:
    cfg = resolved(images, cfg)
    return materialize(workdir, NAME, cfg, code_version(__package__), lambda w: _build(images, cfg, workdir, w),
                       parents=[images])


STAGE = StageCode(run=run_clip_train)
