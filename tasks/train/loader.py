"""Background prefetch for the training loop, with the time the step waits for data measured.

`get_batch` reads a micro-batch of the train shards where the sampler (`lifecycle.tasks.train.sampler`) says: a pure
function of (seed, data step, sequence index in the global batch), so a
prefetching thread can compute batches ahead without changing which batches the step sees: the
prefetched stream is the same sequence the step would compute itself, in the same order. The state to
checkpoint is therefore still just the position and the skipped data steps (`data_step`).

NumPy and torch; no DeepSpeed.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Hashable, Iterable, Iterator

import numpy as np
import torch

from lifecycle.tasks.data.tokenize.stage import TokenShards
from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.sampler import data_step  # noqa: F401  (re-exported: the trainer's import)
from lifecycle.tasks.train.sampler import first_sequence, step_windows


def get_batch(shards: TokenShards, cfg: TrainConfig, step: int, dp_rank: int, micro: int, pin: bool = False):
    """(x, y) int64 tensors (B, T) of random windows: the micro-batch `micro` of data-parallel rank `dp_rank`
    (lifecycle.tasks.train.sampler: sequence j of a step's global batch is a pure function of (seed, step, j), so
    every layout with the same global batch trains on the same sequences; `train.batch.window_starts` says where
    a window may start)."""
    T, B = cfg.model.seq_len, cfg.batch.micro_batch_size
    # We recreate np.memmap every batch to avoid a memory leak (nanoGPT): a long-lived map keeps every
    # page it ever touched accounted to the process.
    data = shards.memmap("train")
    first = first_sequence(dp_rank, micro, cfg.batch.grad_accum, B)
    wins = step_windows(cfg.batch.window_starts, data, shards.eot_id, T, cfg.seed, step, first, B)
    x = np.stack([data[k][i : i + T] for k, i in wins]).astype(np.int64)
    y = np.stack([data[k][i + 1 : i + 1 + T] for k, i in wins]).astype(np.int64)
    if pin:  # page-locked, so the step's copy to the GPU is asynchronous (the prefetch thread pays for the pinning)
        return torch.from_numpy(x).pin_memory(), torch.from_numpy(y).pin_memory()
    return torch.from_numpy(x), torch.from_numpy(y)


def val_batches(shards: TokenShards, cfg: TrainConfig, rank: int, world: int):
    """Fixed non-overlapping validation windows, a disjoint slice per data-parallel rank (`rank` of `world`
    data-parallel ranks; wrapping on a short shard)."""
    T, B = cfg.model.seq_len, cfg.batch.micro_batch_size
    data = np.concatenate(shards.memmap("val"))
    n_win = (len(data) - 1) // T
    for b in range(cfg.logging.eval_batches):
        idx = [((b * world + rank) * B + j) % n_win for j in range(B)]
        x = np.stack([data[i * T : i * T + T] for i in idx]).astype(np.int64)
        y = np.stack([data[i * T + 1 : i * T + T + 1] for i in idx]).astype(np.int64)
        yield torch.from_numpy(x), torch.from_numpy(y)


class Prefetcher:
    """Computes `load(key)` for `keys` in order on a daemon thread, up to `depth` items ahead.

    `get(key)` returns the next item (the keys must be asked for in the same order) and adds the time it
    blocked to `wait_s`. depth=0 loads synchronously in `get` (that time counts as waiting too)."""

    _END = object()

    def __init__(self, load: Callable[[Hashable], object], keys: Iterable[Hashable], depth: int):
        self.load, self.depth, self.wait_s = load, depth, 0.0
        self._keys: Iterator = iter(keys)
        self._stop = threading.Event()
        self._thread = None
        if depth > 0:
            self._q: queue.Queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            for key in self._keys:
                item = (key, self.load(key), None)
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._q.put((None, self._END, None))
        except BaseException as e:  # handed to the training thread, which re-raises it
            self._q.put((None, None, e))

    def get(self, key: Hashable):
        t0 = time.perf_counter()
        try:
            if self._thread is None:
                got, item, err = next(self._keys), None, None
                item = self.load(got)
            else:
                got, item, err = self._q.get()
        finally:
            self.wait_s += time.perf_counter() - t0
        if err is not None:
            raise RuntimeError(f"the prefetch thread failed loading after {key!r}") from err
        if item is self._END:
            raise RuntimeError(f"prefetch ran out of keys before {key!r}")
        if got != key:
            raise RuntimeError(f"prefetch order broken: asked for {key!r}, next prepared is {got!r}")
        return item

    def take_wait(self) -> float:
        """Waiting time since the last call (and reset it)."""
        w, self.wait_s = self.wait_s, 0.0
        return w

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
