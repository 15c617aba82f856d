"""The persist process of the async save: one child per rank that writes the checkpoint files from the staging
arenas (`lifecycle.tasks.train.arena`) while the rank trains on.

The rank sends it each file's skeleton (every tensor replaced by its place in an arena) over a socketpair, with
each arena's fd passed alongside once. The process rebuilds the state dict over the same memory and writes it
with `torch.save` to `<path>.tmp` through a hashing writer (`commit.HashingWriter`: sha256 and size of the bytes
as they are written), fsyncs it, renames it into place, fsyncs the directory, and replies with the file's digest.

Why a process and not a thread: a thread's `torch.save` holds the GIL while it pickles and writes (the training
thread then waits between its ops), and with few cores a thread at nice 19 still shares the process. The persist
process runs at nice 19 with its own interpreter, so training only gives it cycles it would not use. Its arenas are
reused from one checkpoint to the next (grown when a checkpoint needs more), so staging does not page-fault fresh
memory every time. It dies with its rank (PR_SET_PDEATHSIG), so a killed rank leaves no writer behind. When the
rank has to wait for it (the next save, the end of training), it runs at the rank's priority until the wait is
over (`PersistProcess.wait`): on a machine saturated by other work a nice-19 writer would otherwise get almost no
CPU while training stands still. It imports torch but not DeepSpeed (`async_saver` builds DeepSpeed's engine
classes in the rank only).
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

import torch

from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train import memtier
from lifecycle.tasks.train.arena import Arena, slots, staged_bytes, unstage


def persist(state: Any, path: str, zipfile: bool) -> ckpt.Digest:
    """torch.save to a temporary name, fsync, rename: the file is either absent or complete and durable.
    Returns its (sha256, bytes), hashed as it was written."""
    with ckpt.hashed_atomic_file(path) as f:
        torch.save(state, f, _use_new_zipfile_serialization=zipfile)
    return f.digest()


# the channel: length-prefixed pickles over a socketpair, an arena's fd alongside


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
from lifecycle.tasks.train.persist import child_main
child_main(int(sys.argv[1]))
"""


def child_main(fd: int) -> None:
    """The persist process: write what the rank sends, reply per job with {path: (sha256, bytes)} of the
    files it wrote (or the traceback), exit when the rank closes the channel."""
    torch.set_num_threads(1)
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
        held about twice a checkpoint's bytes of tmpfs (docs/benchmarks.md, "Recovery from memory")."""
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
        checkpoint's worth of fresh pages inside the save (most of the first save's stall: docs/benchmarks.md,
        issue 17). The first save goes to the next slot (`new_checkpoint`), so that is the one warmed; with the
        memory tier the other slot is made at the second save (both now would hold a third checkpoint's worth of
        tmpfs beside a restored commit)."""
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
        'model' (`commit.write_model` into the directory `target`). The future's result is {path: (sha256,
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
        """Queue `commit.prune(root, keep_last, keep)` after the writes already queued; the future's result
        is {path: None} of the checkpoints deleted."""
        return self._queue("prune", str(root), lambda: (None, None, None), (keep_last, tuple(str(k) for k in keep)))

    def _queue(self, kind: str, target: str, stage: Callable[[], tuple], arg: Any) -> cf.Future:
        fut: Any = cf.Future()  # a Future that also carries the save's `staged` span and `tier` checksums
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
                fut: Any = self.jobs.pop(job)  # the Future `submit` returned, with its `tier`
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
