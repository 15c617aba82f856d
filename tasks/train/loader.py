"""Background prefetch for the training loop, with the time the step waits for data measured.

The sampler (`lifecycle.tasks.train.sampler`, read by `trainer.get_batch`) is a pure function of (seed, data step, sequence index in the global batch), so a
prefetching thread can compute batches ahead without changing which batches the step sees: the
prefetched stream is the same sequence the step would compute itself, in the same order. The state to
checkpoint is therefore still just the position and the skipped data steps (`data_step`).

torch, pure Python otherwise; no DeepSpeed.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Hashable, Iterable, Iterator

from lifecycle.tasks.train.sampler import data_step  # noqa: F401  (re-exported: the trainer's import)


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
