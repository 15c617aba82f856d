"""The staging arena of the async save: a buffer in shared memory that a rank copies a checkpoint's tensors into,
back to back, and that its persist process (`lifecycle.tasks.train.persist`) maps too, so the training thread
returns to work after the copies (the live tensors may change as soon as training goes on).

An `Arena` is a memfd (no name in /dev/shm, so a SIGKILL leaks nothing), or with the memory tier a file on tmpfs
(`lifecycle.tasks.train.memtier`). `Arena.stage` turns a state dict into its skeleton: the same containers, every
tensor replaced by its `Slot` (offset, dtype, shape) in the arena; `unstage` rebuilds the state dict over the
mapped memory, in the persist process or a restore.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ALIGN = 64  # arena offsets: distinct, aligned data pointers for every staged tensor


def map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """`obj` with `fn` applied to every tensor / ndarray / slot leaf of its dicts, lists and tuples."""
    if isinstance(obj, (torch.Tensor, np.ndarray, Slot)):
        return fn(obj)
    if isinstance(obj, dict):
        out = obj.__class__()  # dict, OrderedDict (torch state dicts), defaultdict (its factory is not needed)
        for k, v in obj.items():
            out[k] = map_leaves(v, fn)
        return out
    if isinstance(obj, list):
        return [map_leaves(v, fn) for v in obj]
    if isinstance(obj, torch.Size):  # ints only; kept a torch.Size, as DeepSpeed's own save pickles it
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(map_leaves(v, fn) for v in obj)
    return obj


def snapshot(obj: Any) -> Any:
    """A copy of a state dict that shares no tensor or array memory with the live training state."""
    return map_leaves(obj, lambda t: t.copy() if isinstance(t, np.ndarray) else t.detach().to("cpu", copy=True))


@dataclass(frozen=True)
class Slot:
    """Where a staged tensor lives in the arena."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def slots(skeleton: Any) -> list[Slot]:
    """The distinct slots of a skeleton (a slot reused for the same memory is listed once)."""
    found: dict[int, Slot] = {}
    map_leaves(skeleton, lambda s: found.setdefault(s.offset, s) if isinstance(s, Slot) else s)
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
        self.staged: dict[tuple, tuple[torch.Tensor, Slot]] = {}  # this snapshot's copies, by source view

    def stage(self, obj: Any) -> Any:
        """Copy every non-empty tensor of `obj` into the arena; returns the skeleton with `Slot`s in their place.
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
            slot = Slot(self.cursor, t.dtype, tuple(t.shape), t.numel())
            self.cursor += -(-n // ALIGN) * ALIGN
            self.staged[key] = (t, slot)
            return slot
        return map_leaves(obj, put)

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
    map_leaves(obj, count)
    return total[0]


def unstage(obj: Any, mm: mmap.mmap) -> Any:
    """The state dict over the arena's memory: every tensor its own storage (so torch.save writes each alone)."""
    return map_leaves(obj, lambda s: torch.frombuffer(mm, dtype=s.dtype, count=s.numel, offset=s.offset).view(s.shape)
                if isinstance(s, Slot) else s)

