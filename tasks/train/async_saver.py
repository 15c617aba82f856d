"""The async save's commit protocol: when a save starts, waits, commits and prunes. Every tensor of a checkpoint
is staged into host memory in the training thread (`lifecycle.tasks.train.arena`) and written by a low-priority
persist process per rank (`lifecycle.tasks.train.persist`); a checkpoint is committed only once every rank's
files are durable.

DeepSpeed's `save_checkpoint` builds its state dicts on every rank and hands each file to
`engine.checkpoint_engine.save(state_dict, path)`. `AsyncSaver` installs a `SnapshotCheckpointEngine` in its
place, whose `save` stages the state dict and queues its write; DeepSpeed's engine classes are built on first
use, so importing this module does not import DeepSpeed.

`AsyncSaver` keeps the commit protocol of `lifecycle.tasks.train.commit` (files durable on every rank, then a
marker written last by rank 0), only spread over the following steps: `poll()` is collective (every rank calls it
at the same steps); it all-reduces "my files are durable" and, once every rank says so, gathers every rank's
digests (or its error: then no rank commits, every rank raises) and rank 0 queues `commit.commit` (write
COMMITTED.json atomically, with the persist processes' digests; only files no persist process wrote, such as
DeepSpeed's copy of `zero_to_fp32.py`, are hashed from disk there) on its background thread, which then has rank
0's persist process prune (unlinking a checkpoint's files and freeing their cached pages costs kernel time: the
nice-19 process's to spend, not the rank's). One save is in flight at a time: the next `start` (and `finish`) wait
for the last. A crash before the marker leaves a tag directory that does not exist for resume (`latest_valid`),
and the next save of that tag, or pruning, removes it.

With the memory tier (`train.checkpoint.memory_tier`, `lifecycle.tasks.train.memtier`) the arenas are files on
tmpfs instead of memfds, consecutive checkpoints alternate between two of them (the committed one stays intact
while the next is staged), the persist process also returns a CRC-32 of every tensor it staged, each rank indexes
its files once they are durable, and rank 0 commits the tier after the disk commit. `restore_from_tier` loads the
newest commit from there when it can (`memtier.TierLoader`).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lifecycle.core.procs import mem_available
from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train import memtier
from lifecycle.tasks.train.arena import ALIGN, staged_bytes
from lifecycle.tasks.train.persist import PersistProcess


@functools.cache
def _engine_base() -> type:
    """A DeepSpeed `TorchCheckpointEngine` whose `create` and `commit` do nothing (this module commits), made on first
    use: DeepSpeed is imported by the rank only, never by the persist process (`lifecycle.tasks.train.persist`),
    where it would cost seconds of start-up before its first write (docs/benchmarks.md, issue 17)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class StagingEngine(TorchCheckpointEngine):
        def __init__(self, base):
            self.name = type(self).__name__
            self.zipfile_serialization = getattr(base, "zipfile_serialization", False)

        def create(self, info) -> None:
            pass

        def commit(self, info) -> bool:
            return True

    return StagingEngine


@functools.cache
def snapshot_engine_class() -> type:
    """DeepSpeed checkpoint engine whose `save` stages the state and returns; the persist process writes it."""

    class SnapshotCheckpointEngine(_engine_base()):
        def __init__(self, base, writer: PersistProcess):
            super().__init__(base)
            self.writer, self.jobs = writer, []

        def save(self, state_dict, path: str) -> None:
            self.jobs.append(self.writer.submit("states", str(path), state_dict, self.zipfile_serialization))

    return SnapshotCheckpointEngine


@functools.cache
def counting_engine_class() -> type:
    """A DeepSpeed checkpoint engine that writes nothing and adds up the arena bytes of what it is handed: the exact
    size of a rank's checkpoint, from DeepSpeed's own state dicts (`AsyncSaver.prewarm`)."""

    class CountingCheckpointEngine(_engine_base()):
        def __init__(self, base):
            super().__init__(base)
            self.nbytes = 0

        def save(self, state_dict, path: str) -> None:
            self.nbytes += staged_bytes(state_dict)

    return CountingCheckpointEngine


def merge_digests(ranks: list[dict[str, ckpt.Digest]]) -> dict[str, ckpt.Digest]:
    """One {path: digest} of every rank's; a path two ranks report differently is left out (so `commit`
    hashes what is on disk)."""
    merged: dict[str, ckpt.Digest] = {}
    clashes = set()
    for digests in ranks:
        for path, d in digests.items():
            if merged.setdefault(path, d) != d:
                clashes.add(path)
    return {p: d for p, d in merged.items() if p not in clashes}


class AsyncSaver:
    """Collective async save + commit for one DeepSpeed engine (every rank builds one). `tier`: the run's
    memory tier directory (`lifecycle.tasks.train.memtier`), or None."""

    def __init__(self, engine, ckpt_root: str | Path, keep_last: int, log=print, tier: Path | None = None):
        self.engine, self.root, self.keep_last, self.log = engine, Path(ckpt_root), keep_last, log
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = engine.device  # the rank's device (the CPU, or its GPU under train.engine.accelerator=cuda)
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")  # rank 0's commits
        self.tier = Path(tier) if tier is not None else None
        if self.tier is not None:
            self.tier.mkdir(mode=0o700, parents=True, exist_ok=True)  # the supervisor claims it first
            memtier.check_owner(self.tier)
            memtier.rank_dir(self.tier, self.rank).mkdir(mode=0o700, exist_ok=True)
        self.writer = PersistProcess(memtier.rank_dir(self.tier, self.rank) if self.tier is not None else None)
        self.tier_error_logged = False
        self.ds_engine = snapshot_engine_class()(engine.checkpoint_engine, self.writer)
        engine.checkpoint_engine = self.ds_engine
        self.pending: tuple[int, Path, dict | None, float] | None = None  # step, tag dir, marker extra, start time
        self.commit_job: cf.Future | None = None
        self.committed: Path | None = None
        self.checkpoint_bytes: int | None = None  # this rank's, once `prewarm` has sized it

    def prewarm(self, scratch: Path | None = None, memory_share: float | None = None) -> tuple[int, float, bool]:
        """Collective, before training: size this rank's checkpoint (DeepSpeed builds its state dicts into a
        counting engine: nothing is copied or written; rank 0 adds its fp32 model export) and have the persist
        process's arena for the first save made and faulted in. Returns (bytes, seconds, made). `scratch`: where
        DeepSpeed may write (default `<run dir>/.checkpoint-sizing`; a standby world uses its own), removed after.
        `memory_share`: make the arena only if, on every rank, it takes at most this share of the host's
        MemAvailable (a standby world beside a training one; else `made` is False and nothing is allocated)."""
        t0 = time.perf_counter()
        if self.checkpoint_bytes is None:  # sized once: a standby declined for memory asks again after its restore
            self.checkpoint_bytes = self._size(scratch)
        nbytes = self.checkpoint_bytes
        if memory_share is not None:
            fits: list[Any] = [None] * self.world
            dist.all_gather_object(fits, nbytes <= memory_share * (mem_available() or float("inf")))
            if not all(fits):
                return nbytes, time.perf_counter() - t0, False
        self.writer.prewarm(nbytes)
        return nbytes, time.perf_counter() - t0, True

    def _size(self, scratch: Path | None) -> int:
        """Collective: this rank's checkpoint bytes, its arena alignment included."""
        counter = counting_engine_class()(self.ds_engine)
        self.engine.checkpoint_engine = counter
        sizing = Path(scratch) if scratch is not None else self.root.parent / ".checkpoint-sizing"
        try:  # DeepSpeed's rank 0 copies its recovery script into the tag directory: the only file it writes
            self.engine.save_checkpoint(str(sizing), tag="sizing", client_state={}, save_latest=False)
        finally:
            self.engine.checkpoint_engine = self.ds_engine
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(sizing, ignore_errors=True)
        nbytes = counter.nbytes
        if self.rank == 0:  # the consolidated fp32 weights (model.safetensors): 4 bytes a parameter, each aligned
            seen = {id(p): p for p in self.engine.module.parameters()}.values()
            nbytes += sum(-(-(4 * getattr(p, "ds_numel", p.numel())) // ALIGN) * ALIGN for p in seen)
        return nbytes

    def start(self, step: int, client_state: dict, model_config, marker_extra: dict | None = None) -> Path:
        """Snapshot checkpoint `step` and queue its files; returns the (not yet committed) tag directory."""
        import deepspeed

        from lifecycle.tasks.train.parallel.moe import consolidated_state

        t0 = time.perf_counter()
        self.finish()  # one save in flight at a time
        t1 = time.perf_counter()
        tag_dir = self.root / ckpt.tag_name(step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tag_dir.exists():  # stale: a crash before its marker, or a damaged commit we fell back from
                ckpt.remove(tag_dir)
        dist.barrier()
        self.ds_engine.jobs = []
        self.writer.new_checkpoint()  # the last one is written: its arena space is free again
        if self.tier is not None:
            self._prune_tier()
        t2 = time.perf_counter()
        self.engine.save_checkpoint(str(self.root), tag=tag_dir.name, client_state=client_state, save_latest=False)
        t3 = time.perf_counter()
        module = self.engine.module
        if getattr(module, "collective_export", False):  # a pipeline stage or tp shard: all gather, rank 0 writes
            state = module.export_state(copy=False)
            if self.rank == 0:
                self.ds_engine.jobs.append(self.writer.submit("model", str(tag_dir), state, model_config))
        else:
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                state = consolidated_state(module, copy=False)  # collective: experts gathered over their ep group
                if self.rank == 0:  # staged (copied) while ZeRO-3's gathered parameters are still there
                    self.ds_engine.jobs.append(self.writer.submit("model", str(tag_dir), state, model_config))
        self.writer.seal()  # the snapshot is complete: training goes on and may change every tensor
        self.pending = (step, tag_dir, marker_extra, t0)
        t4 = time.perf_counter()
        # where the training thread's time went (train.log; bench.gpu_mfu reads it)
        self.log(f"save {step} blocked {t4 - t0:.3f}s: previous save {t1 - t0:.3f}s, barrier and arena {t2 - t1:.3f}s, "
                 f"DeepSpeed states staged {t3 - t2:.3f}s, model export staged {t4 - t3:.3f}s")
        return tag_dir

    def poll(self, block: bool = False) -> Path | None:
        """Collective. Once every rank's files are durable, gathers every rank's file digests and rank 0 hands
        them with the pending save to the committer; returns its tag directory on that step, else None. A
        write that failed on any rank raises on every rank, and the save is dropped uncommitted."""
        if self.pending is None:
            return None
        jobs = self.ds_engine.jobs
        if block:
            self.writer.wait(jobs)
        done = torch.tensor([int(all(j.done() for j in jobs))], device=self.device)  # NCCL: a device tensor
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if not done.item():
            return None
        step, tag_dir, extra, began = self.pending
        self.pending = None
        try:
            mine: dict[str, ckpt.Digest] | str = {Path(path).relative_to(tag_dir).as_posix(): d
                                                  for j in jobs for path, d in j.result().items()}
        except Exception as e:  # a failed write: reported to every rank below, so that none commits or waits
            mine = f"rank {self.rank}: {e}"
        indexed = self.tier is not None and isinstance(mine, dict) and self._index(step, tag_dir, jobs)
        ranks: list[Any] = [None] * self.world
        dist.all_gather_object(ranks, (mine, indexed))
        if failed := [r for r, _ in ranks if isinstance(r, str)]:
            raise RuntimeError(f"checkpoint {tag_dir} not committed:\n" + "\n".join(failed))
        if self.rank == 0:
            self.commit_job = self.pool.submit(self._commit, tag_dir, step, extra, merge_digests([r for r, _ in ranks]),
                                               all(ok for _, ok in ranks), began)
        return tag_dir

    def _index(self, step: int, tag_dir: Path, jobs: list[Any]) -> bool:  # Futures with `staged` and `tier`
        """Write this rank's tier index of checkpoint `step`; False (and the tier is not committed) when the
        tier could not hold it."""
        if self.writer.tier_error is not None:
            if not self.tier_error_logged:
                print(f"rank {self.rank}: {self.writer.tier_error}", flush=True)
                self.tier_error_logged = True
            return False
        staged = [j for j in jobs if j.staged is not None]
        if any(j.tier is None for j in staged):
            return False
        files = {Path(j.staged.target).relative_to(tag_dir).as_posix(): (j.staged.arena, j.staged.skeleton)
                 for j in staged}
        ranges = [(j.staged.arena, j.staged.start, j.staged.end, j.tier) for j in staged]
        try:
            memtier.write_index(self.tier, self.rank, step, files, ranges)
        except OSError as e:
            print(f"rank {self.rank}: memory tier index of step {step} not written ({e})", flush=True)
            return False
        return True

    def _prune_tier(self) -> None:
        """Keep, of this rank's tier files, the live arenas and the committed checkpoint's index and arenas (a
        dead process's, until this process commits one)."""
        keep = self.writer.arena_names() | memtier.live_arenas(self.tier, self.rank, os.getpid())
        if (step := memtier.committed_step(self.tier)) is not None:
            keep.add(memtier.index_path(self.tier, self.rank, step).name)
            try:
                keep |= {name for name, *_ in memtier.read_index(self.tier, self.rank, step)["ranges"]}
            except Exception:  # noqa: BLE001 - no usable index: nothing more to keep
                pass
        memtier.prune_rank(self.tier, self.rank, keep)

    def _commit(self, tag_dir: Path, step: int, extra: dict | None, known: dict[str, ckpt.Digest],
                indexed: bool, began: float) -> Path:
        if self.tier is not None and not indexed:
            memtier.uncommit(self.tier)
        ckpt.commit(tag_dir, step, extra, known=known)
        if self.tier is not None and indexed:
            memtier.commit(self.tier, step, self.world)
        for gone in self.writer.prune(self.root, self.keep_last, keep=(tag_dir,)).result():
            self.log(f"pruned {gone}")
        self.log(f"committed {tag_dir}, {time.perf_counter() - began:.3f}s after its save began")
        self.committed = tag_dir
        return tag_dir

    def finish(self) -> None:
        """Collective. Block until the in-flight save is persisted on every rank and committed."""
        self.poll(block=True)
        if self.commit_job is not None:
            self.writer.wait([self.commit_job])  # its pruning runs in the persist process: lend it our priority
            self.commit_job.result()
            self.commit_job = None
        dist.barrier()

    def restore_from_tier(self, max_step: int | None) -> tuple[tuple[Path, dict] | None, str | None]:
        """Collective. ((tag directory, client_state), None) when the newest commit on disk (at most
        `max_step`) was loaded from the memory tier; ((tag directory, client_state), why) when some files of it
        were read from disk instead (their tensors failed the tier's checksums); (None, why not) when the disk
        has to be read instead."""
        if self.tier is None:
            return None, "memory tier off"
        decision: list[Any] = list(self._tier_candidate(max_step)) if self.rank == 0 else [None, None]
        dist.broadcast_object_list(decision, src=0)
        step, why = decision
        if step is None:
            return None, why
        mine = memtier.verify_rank(self.tier, self.rank, step, self.world)
        reasons: list[Any] = [None] * self.world
        dist.all_gather_object(reasons, mine)
        if bad := [r for r in reasons if r is not None]:
            return None, "; ".join(bad)
        tag_dir = self.root / ckpt.tag_name(step)
        loader = memtier.TierLoader(self.tier, step, self.world, tag_dir, self.ds_engine, torch.get_num_threads())
        self.engine.checkpoint_engine = loader
        try:
            _, client_state = self.engine.load_checkpoint(str(self.root), tag=tag_dir.name)
        finally:
            self.engine.checkpoint_engine = self.ds_engine
            loader.close()
        if not loader.from_memory:
            raise RuntimeError(f"memory tier of step {step} verified, but DeepSpeed read no file from it")
        fell_back: list[Any] = [None] * self.world
        dist.all_gather_object(fell_back, loader.from_disk)
        if damaged := [why for rank in fell_back for why in rank]:
            memtier.uncommit(self.tier)  # a later relaunch reads the disk until the next commit
            return (tag_dir, client_state), "read from disk instead: " + "; ".join(damaged)
        return (tag_dir, client_state), None

    def _tier_candidate(self, max_step: int | None) -> tuple[int | None, str | None]:
        """Rank 0: (step, None) when the tier holds the newest commit on disk and that commit's files are all
        there with their sizes; else (None, why not)."""
        committed = [(s, p) for s, p in ckpt.list_committed(self.root) if max_step is None or s <= max_step]
        if not committed:
            return None, "nothing committed"
        newest, tag_dir = committed[-1]
        have = memtier.committed_step(self.tier)
        if have is None:
            return None, f"no committed snapshot in {self.tier}"
        if have != newest:
            return None, f"memory holds step {have}, the newest commit on disk is step {newest}"
        try:
            files = ckpt.read_marker(tag_dir)["files"]
        except (OSError, ValueError, KeyError) as e:
            return None, f"unreadable marker of {tag_dir} ({e})"
        for f in files:  # sizes only: the tier's own checksums stand for the bytes
            p = tag_dir / f["path"]
            if not p.is_file() or p.stat().st_size != f["bytes"]:
                return None, f"{tag_dir}/{f['path']} is missing or not {f['bytes']} bytes"
        return newest, None

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.writer.close()
