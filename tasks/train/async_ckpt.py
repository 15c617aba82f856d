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

With the memory tier (`train.checkpoint.memory_tier`, `lifecycle.tasks.train.memtier`) the arenas are files on
tmpfs instead of memfds, consecutive checkpoints alternate between two of them (the committed one stays intact
while the next is staged), the persist process also returns a CRC-32 of every tensor it staged, each
rank indexes its files once they are durable, and rank 0 commits the tier after the disk commit.
`restore_from_tier` loads the newest commit from there when it can.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import itertools
import mmap
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from lifecycle.core.fs import sha256_file
from lifecycle.core.procs import mem_available
from lifecycle.tasks.train import checkpoint as ckpt
from lifecycle.tasks.train import memtier

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

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def slots(skeleton: Any) -> list[_Slot]:
    """The distinct slots of a skeleton (a slot reused for the same memory is listed once)."""
    found: dict[int, _Slot] = {}
    _map(skeleton, lambda s: found.setdefault(s.offset, s) if isinstance(s, _Slot) else s)
    return list(found.values())


class Arena:
    """A buffer the persist process maps too; tensors are staged into it back to back. A memfd (no name: a
    SIGKILL leaks nothing), or with `path` a file on tmpfs that outlives the rank (the memory tier,
    `lifecycle.tasks.train.memtier`): its pages are allocated up front, so a full tmpfs fails here with
    ENOSPC instead of a SIGBUS when a page is first written."""

    def __init__(self, size: int, path: Path | None = None):
        self.size = max(ALIGN, size)
        self.path = path
        if path is None:
            self.fd = os.memfd_create("lifecycle-ckpt-arena")
            os.ftruncate(self.fd, self.size)  # pages are only allocated when first written
        else:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(self.fd, 0, self.size)
            except OSError:
                os.close(self.fd)
                path.unlink(missing_ok=True)
                raise
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

    def close(self, unlink: bool = False) -> None:
        del self.bytes
        self.mm.close()
        os.close(self.fd)
        if unlink and self.path is not None:
            self.path.unlink(missing_ok=True)


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
    from lifecycle.tasks.train import memtier

    sock = socket.socket(fileno=fd)
    maps: dict[int, mmap.mmap] = {}  # arena id -> mapping
    while (got := _recv(sock)) is not None:
        msg, fds = got
        if msg[0] == "arena":  # ("arena", id, size) with its fd
            maps[msg[1]] = mmap.mmap(fds[0], msg[2])
            os.close(fds[0])
            continue
        if msg[0] == "drop":  # ("drop", id): the rank has let that arena go
            if (mm := maps.pop(msg[1], None)) is not None:
                mm.close()
            continue
        _, job, kind, target, skeleton, arg, arena, staged = msg
        try:
            if kind == "prune":  # {path: None} of the checkpoints deleted under the root `target`
                keep_last, keep = arg
                _send(sock, (job, {str(p): None for p in ckpt.prune(target, keep_last, keep)}, None, None))
                continue
            state = unstage(skeleton, maps[arena])
            if kind == "states":
                digests = {target: persist(state, target, zipfile=arg)}
            else:
                digests = {os.path.join(target, name): d for name, d in ckpt.write_model(target, state, arg).items()}
            del state  # no view of the arena outlives the job (a dropped map can be closed)
            # the memory tier's checksums of what was staged for this file, after it is durable on disk
            tier = {slot.offset: memtier.checksum(maps[arena], slot.offset, slot.offset + slot.nbytes)
                    for slot in slots(skeleton)} if staged is not None else None
            _send(sock, (job, digests, None, tier))
        except BaseException:
            _send(sock, (job, None, traceback.format_exc(), None))


@dataclass
class Staged:
    """One file's snapshot in the memory tier: where its state was staged."""

    target: str
    arena: str  # the arena's file name
    skeleton: Any
    start: int  # the arena range this file's tensors were copied to
    end: int


class PersistProcess:
    """The rank's side: the arenas, the persist process, and a future per submitted file.

    `tier_dir` (this rank's directory of the memory tier, or None): arenas are files there, and consecutive
    checkpoints alternate between two arena slots, so the slot of the last committed checkpoint is left
    alone while the next one is staged. A slot keeps every arena its checkpoint used until it is reused."""

    def __init__(self, tier_dir: Path | None = None):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD_BOOT, str(child.fileno()), str(os.getpid())],
                                     pass_fds=[child.fileno()])
        child.close()
        self.sock, self.tier_dir = parent, tier_dir
        self.slots: list[list[tuple[int, Arena]]] = [[], []] if tier_dir is not None else [[]]
        self.slot = 0
        self.tier_error: str | None = None  # why the tier was turned off (tmpfs full), once it is
        self.staged_total = self.last_total = 0  # arena bytes of this checkpoint / of the largest one so far
        self.jobs: dict[int, cf.Future] = {}
        self.ids = itertools.count()
        self.arena_ids = itertools.count()
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()  # the training thread and rank 0's commit thread both send
        self.reader = threading.Thread(target=self._read, name="ckpt-persist-replies", daemon=True)
        self.reader.start()

    @property
    def arena(self) -> Arena | None:
        """The arena staging goes to (the newest of the current slot)."""
        return self.slots[self.slot][-1][1] if self.slots[self.slot] else None

    def reserve(self, nbytes: int) -> tuple[int, Arena]:
        """(id, arena) with `nbytes` free after its cursor: a new one when needed (the old one stays mapped, in
        its slot, until the slot is reused). A memfd arena doubles (its pages cost nothing until written); a
        tier arena on tmpfs is allocated up front, so it is sized to what this checkpoint still needs (the
        largest checkpoint's bytes so far, less what is staged; just `nbytes` on the first one): doubling
        took 12.1 GB of tmpfs for the 6.1 GB first checkpoint of a 300M-parameter run."""
        old = self.arena
        if old is None or old.cursor + nbytes > old.size:
            if self.tier_dir is None:
                size = max(nbytes, 2 * old.size if old else self.last_total)
            else:
                size = max(nbytes, self.last_total - self.staged_total)
            aid = next(self.arena_ids)
            path = self.tier_dir / f"arena-{os.getpid()}-{aid}" if self.tier_dir is not None else None
            try:
                arena = Arena(size, path)
            except OSError as e:
                if path is None:
                    raise
                self.tier_error = f"cannot allocate {size} bytes for {path} ({e.strerror}); memory tier off"
                self.tier_dir, arena = None, Arena(size)
            self.slots[self.slot].append((aid, arena))
            with self.send_lock:
                _send(self.sock, ("arena", aid, arena.size), fds=(arena.fd,))
            if old is not None:
                old.seal()
        return self.slots[self.slot][-1]

    def prewarm(self, nbytes: int) -> None:
        """Before training: the arena the first checkpoint stages into, created at `nbytes` and every page
        written once, so the first save copies into memory that is already there instead of faulting in a
        checkpoint's worth of fresh pages inside the save (1.70 s of the first save's stall against 0.33 s for
        later ones, one H100, 1.6 GB). The first save goes to the next slot (`new_checkpoint`), so that is the one
        warmed; with the memory tier the other slot is made at the second save (both now would hold a third
        checkpoint's worth of tmpfs beside a restored commit)."""
        if nbytes <= 0:
            return
        first = (self.slot + 1) % len(self.slots)
        current, self.slot = self.slot, first
        try:
            _, arena = self.reserve(nbytes)
            arena.bytes[:: mmap.PAGESIZE] = 0  # one write a page: the kernel backs them all now
            self.last_total = max(self.last_total, arena.size)  # kept by new_checkpoint for the first save
        finally:
            self.slot = current

    def submit(self, kind: str, target: str, state: Any, arg: Any) -> cf.Future:
        """Stage `state` (blocking copy) and queue its write; kind 'states' (torch.save to the file `target`) or
        'model' (`checkpoint.write_model` into the directory `target`). The future's result is {path: (sha256,
        bytes)} of the files written, once they are durable; with the memory tier, a 'states' file's future
        also gets `tier`: the CRC-32 of every tensor it staged, by arena offset (`memtier.checksum`)."""
        def stage():
            aid, arena = self.reserve(staged_bytes(state))
            start = arena.cursor
            skeleton = arena.stage(state)
            self.staged_total += arena.cursor - start
            staged = Staged(target, arena.path.name, skeleton, start, arena.cursor) \
                if arena.path is not None and kind == "states" else None
            return skeleton, aid, staged
        return self._queue(kind, target, stage, arg)

    def prune(self, root: str | Path, keep_last: int, keep: tuple[str | Path, ...]) -> cf.Future:
        """Queue `checkpoint.prune(root, keep_last, keep)` after the writes already queued; the future's result
        is {path: None} of the checkpoints deleted."""
        return self._queue("prune", str(root), lambda: (None, None, None), (keep_last, tuple(str(k) for k in keep)))

    def _queue(self, kind: str, target: str, stage: Callable[[], tuple], arg: Any) -> cf.Future:
        fut: cf.Future = cf.Future()
        fut.tier = None  # the staged tensors' checksums, from the process (memory tier only)
        skeleton, aid, fut.staged = stage()
        with self.lock:
            job = next(self.ids)
            self.jobs[job] = fut
        try:
            span = (fut.staged.start, fut.staged.end) if fut.staged is not None else None
            msg = ("save", job, kind, target, skeleton, arg, aid, span)
            with self.send_lock:
                _send(self.sock, msg)
        except OSError as e:  # the channel is broken: the process is gone
            with self.lock:
                self.jobs.pop(job, None)
            raise RuntimeError(f"checkpoint persist process exited (code {self.proc.poll()})") from e
        return fut

    def _read(self) -> None:
        while (got := _recv(self.sock)) is not None:
            (job, digests, error, tier), _ = got
            with self.lock:
                fut = self.jobs.pop(job)
            if error is None:
                fut.tier = tier
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
        """The last checkpoint is written: move to the other slot (with the tier; else the one slot), whose
        checkpoint is older than the last committed one, and reuse its newest arena from the start."""
        self.slot = (self.slot + 1) % len(self.slots)
        self.last_total, self.staged_total = max(self.last_total, self.staged_total), 0
        arenas = self.slots[self.slot]
        keep = 1 if arenas and arenas[-1][1].size >= self.last_total else 0  # one arena that holds a checkpoint
        for aid, arena in arenas[: len(arenas) - keep]:
            with self.send_lock:
                _send(self.sock, ("drop", aid))
            arena.close(unlink=True)
        del arenas[: len(arenas) - keep]
        if arenas:
            arenas[-1][1].cursor = 0
            arenas[-1][1].seal()

    def arena_names(self) -> set[str]:
        """File names of the live tier arenas."""
        return {a.path.name for slot in self.slots for _, a in slot if a.path is not None}

    def seal(self) -> None:
        """The snapshot is complete (see `Arena.stage`)."""
        if self.arena is not None:
            self.arena.seal()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)  # the process finishes what it has and exits
        self.proc.wait()
        self.reader.join()
        self.sock.close()
        for slot in self.slots:
            for _, arena in slot:
                arena.close()  # tier files stay: they are the committed checkpoint a relaunch restores


@functools.cache
def _engine_base() -> type:
    """A DeepSpeed `TorchCheckpointEngine` whose `create` and `commit` do nothing (this module commits), made on first
    use: this module is also the persist process's, which must not import DeepSpeed (seconds of start-up before its
    first write: the first commit waited 3 s for it on the CPU, 6-9 s on a GPU host)."""
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

    def _index(self, step: int, tag_dir: Path, jobs: list[cf.Future]) -> bool:
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
        loader = TierLoader(self.tier, step, self.world, tag_dir, self.ds_engine, torch.get_num_threads())
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


class TierLoader:
    """A DeepSpeed checkpoint engine for `engine.load_checkpoint` whose `load(path)` returns the state of a file of
    tag directory `tag_dir` from the tier: the skeleton with every tensor read out of the arena into memory of
    its own, its CRC-32 checked on the way (`memtier.read_checked`), in up to `threads` threads. A file no
    index lists is read from disk by `base`; so is a file with a tensor whose checksum does not match, after its
    sha256 is checked against the commit marker (`from_disk` says which and why)."""

    def __init__(self, tier: Path, step: int, world: int, tag_dir: Path, base, threads: int = 1):
        self.tier, self.tag_dir, self.base, self.threads = tier, Path(tag_dir), base, max(1, threads)
        self.files: dict[str, tuple[Path, Any]] = {}
        self.sums: dict[tuple[Path, int], str] = {}
        for r in range(world):
            index = memtier.read_index(tier, r, step)
            for rel, (name, skeleton) in index["files"].items():
                self.files[rel] = (memtier.rank_dir(tier, r) / name, skeleton)
            for name, _start, _end, sums in index["ranges"]:
                self.sums.update({(memtier.rank_dir(tier, r) / name, off): crc for off, crc in sums.items()})
        self.fds: dict[Path, int] = {}
        self.from_memory: list[str] = []
        self.from_disk: list[str] = []
        self.last: tuple[str, Any] | None = None

    def _fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def load(self, path, map_location=None):
        try:
            rel = Path(path).resolve().relative_to(self.tag_dir.resolve()).as_posix()
        except ValueError:
            rel = None
        if rel not in self.files:
            return self.base.load(path, map_location=map_location)
        if self.last is not None and self.last[0] == rel:
            # DeepSpeed loads the model states file twice in a row (SDLoaderFactory's check_ckpt_list reads
            # mp_world_size from a first load, then `load` loads it again): the same tensors, new containers
            return _map(self.last[1], lambda t: t)
        self.last = None  # not held while another file is read (DeepSpeed has copied the module's weights by now)
        arena, skeleton = self.files[rel]
        fd = self._fd(arena)
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        jobs: list[tuple[_Slot, torch.Tensor]] = []
        def own(s):  # a fresh tensor for a slot (filled below); a copy of anything else the skeleton holds
            if isinstance(s, _Slot):
                t = torch.empty(s.numel, dtype=s.dtype)
                jobs.append((s, t))
                return t.view(s.shape)
            return s.copy() if isinstance(s, np.ndarray) else s.clone()
        state = _map(skeleton, own)
        def read(job) -> bool:
            s, t = job
            want = self.sums.get((arena, s.offset))
            return want is not None and memtier.read_checked(fd, t.view(torch.uint8).numpy(), s.offset, want)
        if self.threads > 1 and len(jobs) > 1:
            with cf.ThreadPoolExecutor(max_workers=self.threads) as pool:
                ok = all(list(pool.map(read, sorted(jobs, key=lambda j: -j[0].nbytes))))
        else:
            ok = all(read(j) for j in jobs)
        if not ok:
            del state, jobs
            return self._from_disk(rel, path, map_location)
        if device is not None and torch.device(device).type != "cpu":
            state = _map(state, lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)
        self.from_memory.append(rel)
        self.last = (rel, state)
        return state

    def _from_disk(self, rel: str, path, map_location):
        """The disk copy of `rel`, once its sha256 matches the commit marker."""
        want = {f["path"]: f["sha256"] for f in ckpt.read_marker(self.tag_dir)["files"]}.get(rel)
        if want is None or sha256_file(path) != want:
            raise RuntimeError(f"{rel} of {self.tag_dir}: the memory tier's copy fails its checksum and the disk "
                               f"copy its sha256 (or the marker lists no sha256 for it)")
        self.from_disk.append(f"{rel}: a tensor in the memory tier does not match its checksum")
        return self.base.load(path, map_location=map_location)

    def close(self) -> None:
        # Nothing points into the arenas (every tensor was read into memory of its own): no gc.collect() is
        # needed to free views before an unmap (it walked torch's and DeepSpeed's heap: 0.19 s per rank on the
        # demo, five times the rest of its restore).
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.last = None
