"""Train task: write a launch config, start the ranks (`python -m lifecycle.tasks.train.trainer`, one process per local
rank with the environment DeepSpeed's launcher would give it, or DeepSpeed's runner with a hostfile: `launcher.py`),
supervise them (`supervise.py`) and return the final commit.

One run directory `<workdir>/train/<fingerprint[:20]>/` per trajectory: config.json (read by every rank),
ds_config.json, train.log (appended per launch), metrics.jsonl (rank 0), checkpoints/step_<8 digits>/.

The fingerprint covers what determines the trajectory: token dataset, code, model and optimisation
sections (`TrainConfig.run_key`). It leaves out where the run stops (`max_steps`) and how it is operated (the
operational sections `checkpoint`, `logging`, `launch`). So a larger `max_steps` resumes from the last
committed checkpoint of the same directory, and the same config again launches nothing. The cosine horizon is
`optimizer.decay_steps`: set it to extend a run later; left null it follows `max_steps`, so a longer run is a
new run (its lr curve differs).

No torch here (the CLI imports this module for its config): the ranks import it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict

from lifecycle.core import dataset as ds
from lifecycle.core import fs
from lifecycle.core.code import code_version
from lifecycle.core.procs import free_port, start_time
from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train import hf_import
from lifecycle.tasks.train import memtier
from lifecycle.tasks.train import anneal
from lifecycle.tasks.train.resume import fallback_note
from lifecycle.tasks.data.tokenize.stage import token_shards
from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.heartbeats import Heartbeats, SupervisorBeat
from lifecycle.tasks.train.launcher import Launch, launcher_cmd, local_rank_envs, rank_threads
from lifecycle.tasks.train.layout import (Sibling, batch_for_siblings, describe, layout_of, refusal, siblings,
                                         trajectory_key)
from lifecycle.tasks.train.layout import convert as convert_layout
from lifecycle.tasks.train.supervise import Ownership, Supervision, World, prebuild_shm_op

log = logging.getLogger(__name__)


class TrainResult(BaseModel):
    model_config = ConfigDict(frozen=True)
    checkpoint_dir: str
    """The committed checkpoint at `steps` (tag directory with COMMITTED.json and model.safetensors)."""
    steps: int
    final_loss: float | None
    """Rank-averaged training loss of the last step, from the commit marker."""
    metrics_path: str
    resumed_from: int | None
    """Step the launched ranks resumed from; None for a fresh start or when nothing was launched."""
    launched: bool
    run_dir: str
    log_path: str
    model_params: int | None = None
    """Non-embedding parameters N of the trained model (the N of 6·N FLOPs per token)."""
    flops_per_token: int | None = None
    """Training FLOPs per token (lifecycle.tasks.train.sizing.flops_per_token)."""
    epochs: float | None = None
    """Passes over the train tokens that max_steps makes."""
    base_model: str | None = None
    """The Hugging Face checkpoint directory the run continued (`train.init_from: hf:<dir>`), or None."""
    base_model_files: dict[str, str] = {}
    """Its files (config, tokenizer, index, shards) by name, with their sha256: a parent of the run."""
    layout: str | None = None
    """The layout the run trains under (`dp=2,zero=2,micro=8,accum=1`: lifecycle.tasks.train.layout)."""
    layout_change: str | None = None
    """`dp=2,zero=2,micro=8,accum=1 -> dp=1,zero=3,micro=8,accum=2 at step 10`: the run resumed a checkpoint
    saved under another layout (None: it did not)."""
    promotions: int = 0
    """Rank failures this launch recovered from by promoting a standby world (`train.launch.spares`)."""


def _result(tag_dir: Path, run_dir: Path, resumed_from: int | None, launched: bool, sizing: dict,
            promotions: int = 0) -> TrainResult:
    marker = ckpt.read_marker(tag_dir)
    launch = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    change = run_dir / LAYOUT_CHANGE
    layout = describe(layout_of(TrainConfig.model_validate(launch["train"]))) if "train" in launch else None
    return TrainResult(layout=layout, layout_change=json.loads(change.read_text())["change"] if change.is_file() else None,
                       checkpoint_dir=str(tag_dir), steps=marker["step"], final_loss=marker.get("loss"),
                       metrics_path=str(run_dir / "metrics.jsonl"), resumed_from=resumed_from,
                       launched=launched, run_dir=str(run_dir), log_path=str(run_dir / "train.log"),
                       base_model=launch.get("base_model"), base_model_files=launch.get("base_model_files") or {},
                       promotions=promotions, **sizing)


def resolve_model(cfg: TrainConfig, vocab_size: int, train_tokens: int) -> tuple[TrainConfig, dict]:
    """Fill vocab_size, size the model under `model_size: auto`, pick the layout under `layout: auto`, and warn
    about repeated data.
    Returns the resolved config and the sizing fields of TrainResult."""
    from lifecycle.tasks.train import sizing as plan

    if cfg.model.vocab_size is None:
        padded = -(-vocab_size // cfg.vocab_multiple) * cfg.vocab_multiple
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": padded})})
    if cfg.model_size == "auto":
        target = plan.compute_optimal(tokens=train_tokens).n_params
        sized = plan.model_for_params(target, cfg.model)
        log.info("model_size=auto: %s train tokens -> N = %.4g -> n_layer=%d n_embd=%d n_head=%d (N = %d)",
                 train_tokens, target, sized.n_layer, sized.n_embd, sized.n_head, plan.non_embedding_params(sized))
        cfg = cfg.model_copy(update={"model": sized})
    if cfg.layout == "auto":
        from lifecycle.tasks.train.layout_search import resolve_layout

        cfg, why = resolve_layout(cfg)
        log.info("%s", why)
    tokens_per_step = cfg.global_batch * cfg.model.seq_len
    epochs = cfg.max_steps * tokens_per_step / max(train_tokens, 1)
    if epochs > cfg.max_epochs:
        msg = (f"training repeats the data {epochs:.1f} times (max_steps {cfg.max_steps} x {tokens_per_step} tokens "
               f"per step over {train_tokens} train tokens), more than train.max_epochs={cfg.max_epochs}")
        log.warning(msg)
        warnings.warn(msg, RepeatedDataWarning, stacklevel=3)
    sizing = {"model_params": plan.non_embedding_params(cfg.model), "flops_per_token": plan.flops_per_token(cfg.model),
              "epochs": epochs}
    return cfg, sizing


class RepeatedDataWarning(UserWarning):
    """max_steps passes over the train tokens more often than train.max_epochs."""


class _MetricsTail:
    """Feeds complete new metrics.jsonl records past the resume step to a callback, each (kind, step) once."""

    def __init__(self, path: Path, after_step: int, callback: Callable[[dict], None] | None):
        self.path, self.after, self.callback, self.offset, self.seen = path, after_step, callback, 0, set()
        self.inode: int | None = None

    def poll(self) -> None:
        if self.callback is None:
            return
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return
        with f:
            st = os.fstat(f.fileno())
            # rank 0 rewrites it (a new file, renamed over this one) to drop records past the resume step; the new
            # one can be as long as what was read of the old one already, so the size alone does not tell
            if st.st_ino != self.inode or st.st_size < self.offset:
                self.inode, self.offset = st.st_ino, 0
            f.seek(self.offset)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]
        self.offset += len(data)
        for rec in map(json.loads, data.splitlines()):
            if rec["step"] > self.after and (rec["kind"], rec["step"]) not in self.seen:
                self.seen.add((rec["kind"], rec["step"]))
                self.callback(rec)


def trajectory_of(tokens: ds.DatasetRef, cfg: TrainConfig, init: dict | None = None, code: str | None = None) -> str:
    """The trajectory fingerprint (lifecycle.tasks.train.layout.trajectory_key): equal for the runs of `cfg`
    under any layout; config.json records it, and run_train resumes a sibling run that has it."""
    return ds.fingerprint("train-trajectory", {**trajectory_key(cfg), **(init or {})},
                          code or code_version(__package__), [tokens])


def run_train(tokens: ds.DatasetRef, cfg: TrainConfig, workdir: str,
              on_metrics: Callable[[dict], None] | None = None, init_weights: str | None = None) -> TrainResult:
    """Train to `cfg.max_steps` (resuming from the run's last committed checkpoint) and return the final one.

    `on_metrics(record)` is called from this process for each new metrics record while the ranks run.
    `init_weights`: a consolidated `model.safetensors` to start from instead of a fresh initialisation."""
    timing = {"stage_start": time.time()}  # with the ranks' launch-timing-rank<r>.json: bench/launch_overhead.py
    meta = token_shards(tokens)
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < meta.vocab_size:
        raise ValueError(f"model.vocab_size {cfg.model.vocab_size} < tokenizer vocab {meta.vocab_size} ({tokens.path})")
    cfg, sizing = resolve_model(cfg, meta.vocab_size, meta.num_tokens["train"])
    _check_windows(cfg, meta, tokens)
    code = code_version(__package__)
    init = _start_weights(cfg, init_weights)
    trajectory = trajectory_of(tokens, cfg, init, code)
    found = siblings(Path(workdir).resolve(), trajectory, cfg.max_steps) if cfg.resume_across_layouts else []
    cfg = batch_for_siblings(cfg, found)  # grad_accum fitted when only the layout changed (or a refusal)
    fp = ds.fingerprint("train", {**cfg.run_key(), **init}, code, [tokens])
    run_dir = Path(workdir).resolve() / "train" / fp[:20]
    found = [s for s in found if s.global_batch == cfg.global_batch and s.run_dir != run_dir]
    ckpt_root = run_dir / "checkpoints"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".lock", "w") as lock:
        try:  # one supervisor per run directory; the OS drops the lock if this process dies
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another run_train is supervising {run_dir}") from None
        tier = memory_tier(cfg, run_dir)  # this run's in-memory checkpoint tier (a rerun of it restores from there)
        memtier.release_dead(keep=tier)  # tiers of dead runs
        latest = _start_checkpoint(ckpt_root, cfg, found, run_dir)
        prefix = anneal.stable_prefix_of(tokens, cfg, init, code)
        if (src := anneal.branch_source(Path(workdir).resolve(), prefix, cfg, run_dir)) is not None and \
                (latest is None or ckpt.step_of(src) > ckpt.step_of(latest)):
            latest = anneal.branch(src, ckpt_root, run_dir) or latest
        if latest is not None and ckpt.step_of(latest) == cfg.max_steps:
            if tier is not None:
                memtier.remove(tier)
            return _result(latest, run_dir, None, launched=False, sizing=sizing)
        resumed_from = ckpt.step_of(latest) if latest is not None else None
        if tier is not None:
            memtier.claim(tier, os.getpid())
        config_path = run_dir / "config.json"
        fs.atomic_write_json(config_path, {"train": cfg.model_dump(mode="json"), "fingerprint": fp,
                                           "trajectory": trajectory, "stable_prefix": prefix, "code_version": code,
                                           "run_dir": str(run_dir), "tokens": meta.model_dump(),
                                           "token_dataset": tokens.path, "init_weights": init_weights,
                                           "memory_tier": str(tier) if tier is not None else None, **init})
        promotions = _launch(cfg, run_dir, config_path, resumed_from, on_metrics, timing)
        restored, damaged = _restored(run_dir / "metrics.jsonl", resumed_from)
        if note := fallback_note(damaged, resumed_from, restored):  # damaged newer commits: say so on the console
            log.warning(note)
        resumed_from = restored
        final = ckpt.latest_valid(ckpt_root, max_step=cfg.max_steps)
        if final is None or ckpt.step_of(final) != cfg.max_steps:
            raise RuntimeError(f"ranks exited cleanly but {ckpt_root} has no valid commit at step {cfg.max_steps}")
        if tier is not None:
            memtier.remove(tier)  # the run is done: its memory goes back
        return _result(final, run_dir, resumed_from, launched=True, sizing=sizing, promotions=promotions)


def _check_windows(cfg: TrainConfig, meta, tokens: ds.DatasetRef) -> None:
    """Each split the run reads holds at least one window of seq_len + 1 tokens."""
    need = cfg.model.seq_len + 1
    for split in ("train", "val") if cfg.logging.eval_every else ("train",):
        if meta.num_tokens[split] < need:
            raise ValueError(f"{split} shard of {tokens.path} has {meta.num_tokens[split]} tokens, a window needs "
                             f"{need}" + (" (set train.logging.eval_every=0 or raise tokenize.val_fraction)" if split == "val" else ""))


def _start_weights(cfg: TrainConfig, init_weights: str | None) -> dict:
    """What the run starts from, for its fingerprint: a warm start's sha256, or a Hugging Face base model's files."""
    init: dict = {"init_weights_sha256": fs.sha256_file(init_weights)} if init_weights else {}
    if (base := hf_import.base_dir(cfg.init_from)) is not None:  # continue a Hugging Face checkpoint
        if init_weights:
            raise ValueError(f"train.init_from {cfg.init_from} and init_weights {init_weights} both give the start")
        files = hf_import.base_files(base)
        init = {"base_model": str(base), "base_model_files": {Path(f.path).name: f.sha256 for f in files}}
    return init


def _start_checkpoint(ckpt_root: Path, cfg: TrainConfig, found: list, run_dir: Path) -> Path | None:
    """The commit the ranks resume from: this run's newest, or a newer one of a sibling layout converted."""
    # Sizes only: the ranks verify the hashes of what they load (the disk copy's sha256, or the memory tier's
    # checksums), and a relaunch should not first read a large checkpoint here for nothing.
    latest = ckpt.latest_valid(ckpt_root, max_step=cfg.max_steps, hashes=False)
    if latest is not None and ckpt.step_of(latest) == cfg.max_steps:  # reused without a launch: hashes here
        latest = ckpt.latest_valid(ckpt_root, max_step=cfg.max_steps)
    if (newer := [s for s in found if latest is None or s.step > ckpt.step_of(latest)]) and \
            (converted := _resume_other_layout(newer, ckpt_root, cfg, run_dir)) is not None:
        latest = converted
    return latest


def _launch(cfg: TrainConfig, run_dir: Path, config_path: Path, resumed_from: int | None,
            on_metrics: Callable[[dict], None] | None, timing: dict) -> int:
    """Start the ranks (locally, or through DeepSpeed's launcher with a hostfile) and supervise them to the end;
    returns the hot-spare promotions."""
    port = cfg.launch.master_port or free_port()
    threads = rank_threads(cfg.launch.threads_per_rank, cfg.batch.num_ranks)
    module = [sys.executable, "-u", "-m", "lifecycle.tasks.train.trainer", "--config", str(config_path)]
    # the ranks watch this process (pid + start time) and die with it: see lifecycle.core.procs.watch_parent_run
    env = {**os.environ, "DS_ACCELERATOR": cfg.engine.accelerator, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           "LIFECYCLE_SUPERVISOR_PID": str(os.getpid()), "LIFECYCLE_SUPERVISOR_START": str(start_time(os.getpid()))}
    if cfg.launch.hostfile is None:  # local ranks, started here: what DeepSpeed's per-node launcher would do
        cmd, envs = module, local_rank_envs(env, cfg.batch.num_ranks, port)
        what = f"{cfg.batch.num_ranks} local ranks, MASTER_ADDR=127.0.0.1 MASTER_PORT={port}: {' '.join(cmd)}"
    else:
        cmd = [*launcher_cmd(cfg, port, run_dir, threads), "--module", "--no_local_rank", *module[3:]]
        what = " ".join(cmd)
    tail = _MetricsTail(run_dir / "metrics.jsonl", resumed_from or 0, on_metrics)
    timing["supervisor_setup"] = time.time()
    prebuild_shm_op(cfg.engine.accelerator, env)  # no rank waits on a stale build lock, nor races a build
    timing["op_build_check"] = time.time()
    owner = Ownership(port)
    owner.claim()  # and release the buffers of supervisors that died before they could
    beats = Heartbeats(run_dir, cfg.batch.num_ranks, cfg.launch.stall_s, cfg.launch.startup_s,  # clears old ones
                       last_step=cfg.max_steps)
    # ranks over ssh cannot watch this process's pid: they watch its beat (lifecycle.core.procs.watch_parent_run)
    beat = SupervisorBeat(run_dir) if cfg.launch.hostfile is not None else contextlib.nullcontext()
    with open(run_dir / "train.log", "ab") as log, beat:
        log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} resume_from={resumed_from}: {what}\n".encode())
        log.flush()
        # one process group of ours: a ^C or a SIGTERM reaches only us, and we stop the group (below);
        # SIGKILL when we die, however we die
        timing["launcher_popen"] = time.time()
        try:
            launch = (Launch.start_local(cmd, envs, run_dir, log) if cfg.launch.hostfile is None
                      else Launch.start_launcher(cmd, env, run_dir, log))
        except BaseException:
            owner.release()
            raise
        if cfg.launch.hostfile is None:
            timing["ranks_started"] = time.time()  # Popen returns once each rank's exec has succeeded
        fs.atomic_write_json(run_dir / "launch-timing.json", timing)
        promotions = Supervision(World("", launch, owner, beats), cfg, cmd, env, run_dir, log, tail).run()
    tail.poll()
    return promotions


LAYOUT_CHANGE = "layout_change.json"


def _restored(metrics: Path, expected: int | None) -> tuple[int | None, list[str]]:
    """(the step the ranks restored, the damaged commits they passed over) from the last `restore` record: rank 0
    writes one per launch, after truncating the file to that step; else (`expected`, []). The step is older than
    the supervisor's guess when that commit's hashes failed in the ranks and they fell back to the one before."""
    try:
        lines = metrics.read_bytes().splitlines()
    except OSError:
        return expected, []
    for line in reversed(lines):
        if b'"restore"' in line:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "restore":
                return int(rec["step"]), list(rec.get("damaged", []))
    return expected, []


def _resume_other_layout(newer: list[Sibling], ckpt_root: Path, cfg: TrainConfig, run_dir: Path) -> Path | None:
    """Convert the newest commit of a run of the same trajectory under another layout (`newer`, newest first) into
    this run's checkpoints; a sibling whose supervisor is running is passed over. Logs the change in train.log and
    `<run_dir>/layout_change.json` (TrainResult.layout_change, the MLflow tag). Returns the converted tag dir."""
    dst = layout_of(cfg)
    why = None
    if cfg.optimizer.name == "muon":
        why = ("a run with experts: the Muon converter does not carry the experts' state (moe_convert carries "
               "AdamW's)" if cfg.moe.num_experts else refusal(newer[0].layout, dst, "muon"))
    if why is not None:
        src = newer[0]  # refused before any sibling is touched
        raise ValueError(f"train.optimizer.name=muon: a run of this trajectory under layout {describe(src.layout)} "
                         f"committed step {src.step} ({src.tag_dir}), and no converter carries Muon's state to "
                         f"layout {describe(dst)} ({why}): rerun with that layout, or set "
                         "train.resume_across_layouts: false to start a new run")
    for src in newer:
        with open(src.run_dir / ".lock", "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.warning("run %s (layout %s) is being trained: not resuming from it", src.run_dir,
                            describe(src.layout))
                continue
            if (why := ckpt.verify(src.tag_dir)) is not None:  # `siblings` checked sizes only
                log.warning("not resuming from %s (layout %s): %s", src.tag_dir, describe(src.layout), why)
                continue
            tag_dir, _ = convert_layout(src, ckpt_root, dst, cfg.optimizer.name)
        change = f"{describe(src.layout)} -> {describe(dst)} at step {src.step}"
        line = f"layout change: {change}, converted {src.tag_dir} -> {tag_dir}"
        log.info("%s", line)
        with open(run_dir / "train.log", "a") as f:
            f.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
        fs.atomic_write_json(run_dir / LAYOUT_CHANGE, {"change": change, "from": src.layout, "to": dst,
                                                       "step": src.step, "source": str(src.tag_dir)})
        return tag_dir
    return None


def memory_tier(cfg: TrainConfig, run_dir: Path) -> Path | None:
    """The run's memory tier directory (`train.checkpoint.memory_tier`): async saves on one host only (the
    supervisor could neither claim nor clean a tier on another host), and only where /dev/shm exists."""
    c = cfg.checkpoint
    if not (c.memory_tier and c.async_save and cfg.launch.hostfile is None and memtier.ROOT.is_dir()):
        return None
    return memtier.path_for(run_dir)
