"""Asynchronous checkpoints: snapshot to host memory in the training thread, persist in the background, commit
only when every rank's files are durable.

DeepSpeed's `save_checkpoint` builds its state dicts on every rank and hands each file to
`engine.checkpoint_engine.save(state_dict, path)`. `SnapshotCheckpointEngine` replaces that engine: `save`
copies every tensor of the state dict (a memcpy to host memory; the live tensors may change as soon as
training goes on) and queues the copy for a background thread, which writes it to `<path>.tmp`, fsyncs
it and renames it into place. The training thread returns to work after the copies.

`AsyncSaver` keeps the commit protocol of `tasks.checkpoint` (files durable on every rank, then a
marker written last by rank 0), only spread over the following steps: `poll()` is collective (every rank
calls it at the same steps); it all-reduces "my files are durable" and, once every rank says so, rank 0
queues `checkpoint.commit` (hash every file, write COMMITTED.json atomically) and pruning on its
background thread. One save is in flight at a time: the next `start` (and `finish`) wait for the last.
A crash before the marker leaves a tag directory that does not exist for resume (`latest_valid`), and
the next save of that tag, or pruning, removes it.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from lifecycle.dataset import fsync_dir
from tasks import checkpoint as ckpt


def snapshot(obj: Any) -> Any:
    """A copy of a state dict that shares no tensor or array memory with the live training state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)  # on GPU: a device-to-host copy (pin it for speed)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        out = obj.__class__()  # dict, OrderedDict (torch state dicts), defaultdict (its factory is not needed)
        for k, v in obj.items():
            out[k] = snapshot(v)
        return out
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(snapshot(v) for v in obj)
    return obj


def persist(state: Any, path: str, zipfile: bool) -> str:
    """torch.save to a temporary name, fsync, rename: the file is either absent or complete."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f, _use_new_zipfile_serialization=zipfile)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(Path(path).parent)
    return path


def _lower_priority() -> None:
    """Run the persist thread at nice 19: on a busy CPU it takes the cycles training leaves over instead of
    competing with the training thread (Linux sets niceness per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class SnapshotCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed checkpoint engine whose `save` snapshots and returns; a thread persists the snapshot."""

    def __init__(self, base: TorchCheckpointEngine, pool: cf.ThreadPoolExecutor):
        self.name = "SnapshotCheckpointEngine"
        self.zipfile_serialization = getattr(base, "zipfile_serialization", False)
        self.pool, self.jobs = pool, []
        self.snapshot_s = 0.0

    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        t0 = time.perf_counter()
        snap = snapshot(state_dict)
        self.snapshot_s += time.perf_counter() - t0
        self.jobs.append(self.pool.submit(persist, snap, path, self.zipfile_serialization))

    def commit(self, info) -> bool:
        return True


class AsyncSaver:
    """Collective async save + commit for one DeepSpeed engine (every rank builds one)."""

    def __init__(self, engine, ckpt_root: str | Path, keep_last: int, log=print):
        self.engine, self.root, self.keep_last, self.log = engine, Path(ckpt_root), keep_last, log
        self.rank = dist.get_rank()
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-persist", initializer=_lower_priority)
        self.ds_engine = SnapshotCheckpointEngine(engine.checkpoint_engine, self.pool)
        engine.checkpoint_engine = self.ds_engine
        self.pending: tuple[int, Path, dict | None] | None = None
        self.commit_job: cf.Future | None = None
        self.committed: Path | None = None

    def start(self, step: int, client_state: dict, model_config, marker_extra: dict | None = None) -> Path:
        """Snapshot checkpoint `step` and queue its files; returns the (not yet committed) tag directory."""
        import deepspeed

        self.finish()  # one save in flight at a time
        tag_dir = self.root / ckpt.tag_name(step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tag_dir.exists():  # stale: a crash before its marker, or a damaged commit we fell back from
                ckpt.remove(tag_dir)
        dist.barrier()
        self.ds_engine.jobs = []
        self.engine.save_checkpoint(str(self.root), tag=tag_dir.name, client_state=client_state, save_latest=False)
        module = self.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = module.export_state() if self.rank == 0 else None  # export_state copies (fp32 clones)
        if self.rank == 0:
            self.ds_engine.jobs.append(self.pool.submit(ckpt.write_model, tag_dir, state, model_config))
        self.pending = (step, tag_dir, marker_extra)
        return tag_dir

    def poll(self, block: bool = False) -> Path | None:
        """Collective. Commits the pending save once every rank's files are durable; returns its tag
        directory on the step it is handed to the committer, else None."""
        if self.pending is None:
            return None
        jobs = self.ds_engine.jobs
        if block:
            cf.wait(jobs)
        done = torch.tensor([int(all(j.done() for j in jobs))])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if not done.item():
            return None
        for j in jobs:
            j.result()  # a failed write raises here, on the rank that failed
        step, tag_dir, extra = self.pending
        self.pending = None
        if self.rank == 0:
            self.commit_job = self.pool.submit(self._commit, tag_dir, step, extra)
        return tag_dir

    def _commit(self, tag_dir: Path, step: int, extra: dict | None) -> Path:
        ckpt.commit(tag_dir, step, extra)
        for gone in ckpt.prune(self.root, self.keep_last, keep=(tag_dir,)):
            self.log(f"pruned {gone}")
        self.log(f"committed {tag_dir}")
        self.committed = tag_dir
        return tag_dir

    def finish(self) -> None:
        """Collective. Block until the in-flight save is persisted on every rank and committed."""
        self.poll(block=True)
        if self.commit_job is not None:
            self.commit_job.result()
            self.commit_job = None
        dist.barrier()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
