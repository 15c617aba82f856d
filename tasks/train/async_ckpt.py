"""Asynchronous checkpoints: snapshot to host memory in the training thread, persist in a low-priority child
process, commit only when every rank's files are durable.

DeepSpeed's `save_checkpoint` builds its state dicts on every rank and hands each file to
`engine.checkpoint_engine.save(state_dict, path)`. `SnapshotCheckpointEngine` replaces that engine: `save`
copies every tensor of the state dict into a shared-memory arena (a memcpy; the live tensors may change as
soon as training goes on) and sends the state's small skeleton, with each tensor replaced by its place in
the arena, to a persist process. That process rebuilds the state dict over the same memory and writes it
with `torch.save` to `<path>.tmp` through a hashing writer (`checkpoint.HashingWriter`: sha256 and size
of the bytes as they are written), fsyncs it, renames it into place, fsyncs the directory, and replies with
the file's digest. The training thread returns to work after the copies.

Why a process and not a thread: a thread's `torch.save` holds the GIL while it pickles and writes (the
training thread then waits between its ops), and with 2 cores a thread at nice 19 still shares the
process. The persist process runs at nice 19 with its own interpreter, so training only gives it cycles it
would not use. The arena is a memfd (no name in /dev/shm, so a SIGKILL leaks nothing) passed over a
socketpair; it is reused from one checkpoint to the next (grown when a checkpoint needs more), so staging
does not page-fault fresh memory every time. The persist process dies with its rank (PR_SET_PDEATHSIG), so a
killed rank leaves no writer behind. Its working set is one checkpoint's bytes per rank, kept for the run.
When the rank has to wait for it (the next save, the end of training), the process runs at the rank's
priority until the wait is over (`PersistProcess.wait`, where the rank may lower a nice value): on a machine
saturated by other work a nice-19 writer would otherwise get almost no CPU while training stands still.

`AsyncSaver` keeps the commit protocol of `lifecycle.tasks.train.checkpoint` (files durable on every rank, then a
marker written last by rank 0), only spread over the following steps: `poll()` is collective (every rank
calls it at the same steps); it all-reduces "my files are durable" and, once every rank says so, gathers
every rank's digests (or its error: then no rank commits, every rank raises) and rank 0 queues
`checkpoint.commit` (write COMMITTED.json atomically, with the persist processes' digests; only files no
persist process wrote, such as DeepSpeed's copy of `zero_to_fp32.py`, are hashed from disk there) on its
background thread, which then has rank 0's persist process prune (deleting a 244 MB checkpoint costs about
0.05 s of kernel time, unlinking its files and freeing their cached pages: the nice-19 process's to spend,
not the rank's). One save is in flight at a time: the next `start`
(and `finish`) wait for the last. A crash before the marker leaves a tag directory that does not exist for
resume (`latest_valid`), and the next save of that tag, or pruning, removes it.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from lifecycle.tasks.train import checkpoint as ckpt

ALIGN = 64  # arena offsets: distinct, aligned data pointers for every staged tensor


def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """`obj` with `fn` applied to every tensor / ndarray / slot leaf of its dicts, lists and tuples."""
    if isinstance(obj, (torch.Tensor, np.ndarray, _Slot)):
        return fn(obj)
    if isinstance(obj, dict):
        out = obj.__class__()  # dict, OrderedDict (torch state dicts), defaultdict (its factory is not needed)
        for k, v in obj.items():
            out[k] = _map(v, fn)
        return out
    if isinstance(obj, list):
        return [_map(v, fn) for v in obj]
    if isinstance(obj, torch.Size):  # ints only; kept a torch.Size, as DeepSpeed's own save pickles it
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map(v, fn) for v in obj)
    return obj


def snapshot(obj: Any) -> Any:
    """A copy of a state dict that shares no tensor or array memory with the live training state."""
    return _map(obj, lambda t: t.copy() if isinstance(t, np.ndarray) else t.detach().to("cpu", copy=True))


@dataclass(frozen=True)
class _Slot:
    """Where a staged tensor lives in the arena."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int


class Arena:
    """A memfd-backed buffer the persist process maps too; tensors are staged into it back to back."""

    def __init__(self, size: int):
        self.size = max(ALIGN, size)
        self.fd = os.memfd_create("lifecycle-ckpt-arena")
        os.ftruncate(self.fd, self.size)  # pages are only allocated when first written
        self.mm = mmap.mmap(self.fd, self.size)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.cursor = 0
        self.staged: dict[tuple, tuple[torch.Tensor, _Slot]] = {}  # this snapshot's copies, by source view

    def stage(self, obj: Any) -> Any:
        """Copy every non-empty tensor of `obj` into the arena; returns the skeleton with `_Slot`s in their place.
        A tensor that is the same view of the same memory as one already staged in this snapshot (`seal` ends
        it) is not copied again: its slot is reused. DeepSpeed's module state dict and rank 0's fp32 export
        are the same parameter tensors in fp32 training, so their bytes are copied once. The source tensor
        is held until `seal`, so its memory cannot be freed and reused for another tensor meanwhile."""
        def put(t):
            if isinstance(t, np.ndarray):
                return t.copy()
            t = t.detach()
            if t.numel() == 0:
                return t.to("cpu", copy=True)
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
            if (seen := self.staged.get(key)) is not None:
                return seen[1]
            n = t.numel() * t.element_size()
            self.bytes[self.cursor : self.cursor + n].view(t.dtype).view(t.shape).copy_(t)
            slot = _Slot(self.cursor, t.dtype, tuple(t.shape), t.numel())
            self.cursor += -(-n // ALIGN) * ALIGN
            self.staged[key] = (t, slot)
            return slot
        return _map(obj, put)

    def seal(self) -> None:
        """End the snapshot: later `stage` calls copy every tensor again (training may change them now)."""
        self.staged.clear()

    def close(self) -> None:
        del self.bytes
        self.mm.close()
        os.close(self.fd)


def staged_bytes(obj: Any) -> int:
    """Arena bytes `Arena.stage(obj)` needs."""
    total = [0]
    def count(t):
        if isinstance(t, torch.Tensor) and t.numel():
            total[0] += -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN
        return t
    _map(obj, count)
    return total[0]


def unstage(obj: Any, mm: mmap.mmap) -> Any:
    """The state dict over the arena's memory: every tensor its own storage (so torch.save writes each alone)."""
    return _map(obj, lambda s: torch.frombuffer(mm, dtype=s.dtype, count=s.numel, offset=s.offset).view(s.shape)
                if isinstance(s, _Slot) else s)


def persist(state: Any, path: str, zipfile: bool) -> ckpt.Digest:
    """torch.save to a temporary name, fsync, rename: the file is either absent or complete and durable.
    Returns its (sha256, bytes), hashed as it was written."""
    with ckpt.hashed_atomic_file(path) as f:
        torch.save(state, f, _use_new_zipfile_serialization=zipfile)
    return f.digest()


# --------------------------------------------------------------------------------------------------
# the persist process and its channel: length-prefixed pickles over a socketpair, the arena's fd alongside


def _send(sock: socket.socket, obj: Any, fds: tuple[int, ...] = ()) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    header = struct.pack("<Q", len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
        sock.sendall(data)
    else:
        sock.sendall(header + data)


def _recv_exact(sock: socket.socket, n: int, buf: bytes = b"") -> bytes | None:
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _recv(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """(message, fds), or None once the other side is gone."""
    first, fds, _, _ = socket.recv_fds(sock, 8, 4)
    header = _recv_exact(sock, 8, first) if first else None
    if header is None:
        return None
    data = _recv_exact(sock, struct.unpack("<Q", header)[0])
    return (pickle.loads(data), fds) if data is not None else None


# Before any import: die with the rank (PR_SET_PDEATHSIG = 1), exit if it is already gone, and go to nice 19,
# so even the process's start-up (importing torch and deepspeed) only takes cycles training leaves over.
CHILD_BOOT = """import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[2]):
    sys.exit(0)
os.nice(19)
from lifecycle.tasks.train.async_ckpt import _child_main
_child_main(int(sys.argv[1]))
"""


def _child_main(fd: int) -> None:
    """The persist process: write what the rank sends, reply per job with {path: (sha256, bytes)} of the
    files it wrote (or the traceback), exit when the rank closes the channel."""
    torch.set_num_threads(1)
    sock = socket.socket(fileno=fd)
    mm = None
    while (got := _recv(sock)) is not None:
        msg, fds = got
        if msg[0] == "arena":
            if mm is not None:
                mm.close()
            mm = mmap.mmap(fds[0], msg[1])
            os.close(fds[0])
            continue
        _, job, kind, target, skeleton, arg = msg
        try:
            if kind == "prune":  # {path: None} of the checkpoints deleted under the root `target`
                keep_last, keep = arg
                _send(sock, (job, {str(p): None for p in ckpt.prune(target, keep_last, keep)}, None))
                continue
            state = unstage(skeleton, mm)
            if kind == "states":
                digests = {target: persist(state, target, zipfile=arg)}
            else:
                digests = {os.path.join(target, name): d for name, d in ckpt.write_model(target, state, arg).items()}
            _send(sock, (job, digests, None))
        except BaseException:
            _send(sock, (job, None, traceback.format_exc()))


class PersistProcess:
    """The rank's side: an arena, the persist process, and a future per submitted file."""

    def __init__(self):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD_BOOT, str(child.fileno()), str(os.getpid())],
                                     pass_fds=[child.fileno()])
        child.close()
        self.sock, self.arena = parent, None
        self.jobs: dict[int, cf.Future] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()  # the training thread and rank 0's commit thread both send
        self.reader = threading.Thread(target=self._read, name="ckpt-persist-replies", daemon=True)
        self.reader.start()

    def reserve(self, nbytes: int) -> Arena:
        """An arena with `nbytes` free after its cursor (a larger new one when needed; the process keeps
        its mapping of the old one until it has written what was staged there)."""
        if self.arena is None or self.arena.cursor + nbytes > self.arena.size:
            old = self.arena
            self.arena = Arena(max(nbytes, 2 * old.size if old else nbytes))
            with self.send_lock:
                _send(self.sock, ("arena", self.arena.size), fds=(self.arena.fd,))
            if old is not None:
                old.close()
        return self.arena

    def submit(self, kind: str, target: str, state: Any, arg: Any) -> cf.Future:
        """Stage `state` (blocking copy) and queue its write; kind 'states' (torch.save to the file `target`) or
        'model' (`checkpoint.write_model` into the directory `target`). The future's result is {path: (sha256,
        bytes)} of the files written, once they are durable."""
        return self._queue(kind, target, lambda: self.reserve(staged_bytes(state)).stage(state), arg)

    def prune(self, root: str | Path, keep_last: int, keep: tuple[str | Path, ...]) -> cf.Future:
        """Queue `checkpoint.prune(root, keep_last, keep)` after the writes already queued; the future's result
        is {path: None} of the checkpoints deleted."""
        return self._queue("prune", str(root), lambda: None, (keep_last, tuple(str(k) for k in keep)))

    def _queue(self, kind: str, target: str, skeleton: Callable[[], Any], arg: Any) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self.lock:
            job = next(self.ids)
            self.jobs[job] = fut
        try:
            msg = ("save", job, kind, target, skeleton(), arg)
            with self.send_lock:
                _send(self.sock, msg)
        except OSError as e:  # the channel is broken: the process is gone
            with self.lock:
                self.jobs.pop(job, None)
            raise RuntimeError(f"checkpoint persist process exited (code {self.proc.poll()})") from e
        return fut

    def _read(self) -> None:
        while (got := _recv(self.sock)) is not None:
            (job, digests, error), _ = got
            with self.lock:
                fut = self.jobs.pop(job)
            if error is None:
                fut.set_result(digests)
            else:
                fut.set_exception(RuntimeError(f"checkpoint persist process failed:\n{error}"))
        with self.lock:  # the process is gone: nothing pending will complete
            for fut in self.jobs.values():
                fut.set_exception(RuntimeError(f"checkpoint persist process exited (code {self.proc.poll()})"))
            self.jobs.clear()

    def wait(self, futures: list[cf.Future]) -> None:
        """Block until `futures` are done. Meanwhile the persist process runs at the rank's priority, not
        nice 19 (priority inheritance: the rank has nothing to do but wait for it, so on a busy machine it
        should not get only a nice-19 share of a core). Lowering a nice value needs CAP_SYS_NICE or
        RLIMIT_NICE; without either the process stays at nice 19."""
        if all(f.done() for f in futures):
            return
        boosted = self._renice(os.getpriority(os.PRIO_PROCESS, 0))
        try:
            cf.wait(futures)
        finally:
            if boosted:
                self._renice(19)

    def _renice(self, nice: int) -> bool:
        try:  # its main thread, the one that writes
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, nice)
            return True
        except (PermissionError, ProcessLookupError):
            return False

    def new_checkpoint(self) -> None:
        if self.arena is not None:
            self.arena.cursor = 0
            self.arena.seal()

    def seal(self) -> None:
        """The snapshot is complete (see `Arena.stage`)."""
        if self.arena is not None:
            self.arena.seal()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)  # the process finishes what it has and exits
        self.proc.wait()
        self.reader.join()
        self.sock.close()
        if self.arena is not None:
            self.arena.close()


class SnapshotCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed checkpoint engine whose `save` stages the state and returns; the persist process writes it."""

    def __init__(self, base: TorchCheckpointEngine, writer: PersistProcess):
        self.name = "SnapshotCheckpointEngine"
        self.zipfile_serialization = getattr(base, "zipfile_serialization", False)
        self.writer, self.jobs = writer, []

    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        self.jobs.append(self.writer.submit("states", str(path), state_dict, self.zipfile_serialization))

    def commit(self, info) -> bool:
        return True


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
    """Collective async save + commit for one DeepSpeed engine (every rank builds one)."""

    def __init__(self, engine, ckpt_root: str | Path, keep_last: int, log=print):
        self.engine, self.root, self.keep_last, self.log = engine, Path(ckpt_root), keep_last, log
        self.rank = dist.get_rank()
        self.device = engine.device  # the rank's device (the CPU, or its GPU under train.engine.accelerator=cuda)
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")  # rank 0's commits
        self.writer = PersistProcess()
        self.ds_engine = SnapshotCheckpointEngine(engine.checkpoint_engine, self.writer)
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
        self.writer.new_checkpoint()  # the last one is written: its arena space is free again
        self.engine.save_checkpoint(str(self.root), tag=tag_dir.name, client_state=client_state, save_latest=False)
        module = self.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            if self.rank == 0:  # staged (copied) while ZeRO-3's gathered parameters are still there
                self.ds_engine.jobs.append(self.writer.submit("model", str(tag_dir), module.export_state(copy=False),
                                                              model_config))
        self.writer.seal()  # the snapshot is complete: training goes on and may change every tensor
        self.pending = (step, tag_dir, marker_extra)
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
        step, tag_dir, extra = self.pending
        self.pending = None
        try:
            mine: dict[str, ckpt.Digest] | str = {Path(path).relative_to(tag_dir).as_posix(): d
                                                  for j in jobs for path, d in j.result().items()}
        except Exception as e:  # a failed write: reported to every rank below, so that none commits or waits
            mine = f"rank {self.rank}: {e}"
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if failed := [r for r in ranks if isinstance(r, str)]:
            raise RuntimeError(f"checkpoint {tag_dir} not committed:\n" + "\n".join(failed))
        if self.rank == 0:
            self.commit_job = self.pool.submit(self._commit, tag_dir, step, extra, merge_digests(ranks))
        return tag_dir

    def _commit(self, tag_dir: Path, step: int, extra: dict | None, known: dict[str, ckpt.Digest]) -> Path:
        ckpt.commit(tag_dir, step, extra, known=known)
        for gone in self.writer.prune(self.root, self.keep_last, keep=(tag_dir,)).result():
            self.log(f"pruned {gone}")
        self.log(f"committed {tag_dir}")
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

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.writer.close()
