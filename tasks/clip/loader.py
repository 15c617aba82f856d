"""The image path's loader: image_preprocess's JPEG tar shards, read through `index.parquet` (each JPEG's shard,
byte offset and size: one `pread` per image), decoded and augmented in worker processes (`Loader`), or by an
NVIDIA DALI pipeline (`clip_train.loader: dali`, lifecycle.tasks.clip.dali, on the same `Reads`), in batches that
are a function of (seed, step, rank, ranks).

Sampling: the pairs not held out (`split`) are the training list; rank r owns positions p with p % ranks == r
(`cache.owner`) and walks its own samples in random epochs, one permutation per epoch drawn from
`default_rng([seed, epoch, rank])`: step s reads its positions s*B ... s*B+B-1 of that endless walk. So every
owned sample is read once per epoch, a resumed run reads what the uninterrupted one would, and a rank reads and
caches only what it owns (`NoEvictCache`).

Stall: `next(step)` returns the seconds the training loop waited in it (the reads it does itself, and the wait on
the workers' decoded batch); the trainer divides by the step's wall time (DS-Analyzer's data stall)."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from lifecycle.tasks.clip.augment import decode_batch
from lifecycle.tasks.clip.cache import NoEvictCache, owner
from lifecycle.tasks.clip.config import ClipTrainConfig, held_out
from lifecycle.tasks.clip.model import caption_tokens

INDEX = "index.parquet"  # lifecycle.tasks.data.images.preprocess.stage.INDEX


class Pairs:
    """image_preprocess's index: per image its id, shard, offset and size of its JPEG, caption tokens."""

    def __init__(self, dataset_dir: str | Path):
        self.root = Path(dataset_dir)
        t = pq.read_table(self.root / INDEX, columns=["image_id", "shard", "offset", "size", "caption", "tokens"])
        self.ids: list[str] = t.column("image_id").to_pylist()
        self.shard: list[str] = t.column("shard").to_pylist()
        self.offset: list[int] = t.column("offset").to_pylist()
        self.size: list[int] = t.column("size").to_pylist()
        self.caption: list[str] = t.column("caption").to_pylist()
        self.tokens: list[list[int]] = t.column("tokens").to_pylist()
        self._fds: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def read(self, row: int) -> bytes:
        """The JPEG bytes of row `row`, read at its offset in its shard."""
        name = self.shard[row]
        if name not in self._fds:
            self._fds[name] = os.open(self.root / name, os.O_RDONLY)
        data = os.pread(self._fds[name], self.size[row], self.offset[row])
        if len(data) != self.size[row]:
            raise ValueError(f"{self.root / name}: image {self.ids[row]} is cut short ({len(data)} of "
                             f"{self.size[row]} bytes at offset {self.offset[row]})")
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def split(ids: list[str], fraction: float) -> tuple[list[int], list[int]]:
    """(training rows, held-out rows) of the index, each in index order."""
    held = [held_out(i, fraction) for i in ids]
    return [r for r, h in enumerate(held) if not h], [r for r, h in enumerate(held) if h]


def owned_rows(train_rows: list[int], rank: int, ranks: int) -> list[int]:
    return [row for p, row in enumerate(train_rows) if owner(p, ranks) == rank]


def step_rows(owned: list[int], seed: int, step: int, rank: int, batch: int) -> list[int]:
    """The index rows rank `rank` reads at `step`: positions step*batch ... of its walk of random epochs."""
    n, out, perms = len(owned), [], {}
    for k in range(step * batch, (step + 1) * batch):
        epoch = k // n
        if epoch not in perms:
            perms[epoch] = np.random.default_rng([seed, epoch, rank]).permutation(n)
        out.append(owned[int(perms[epoch][k % n])])
    return out


class Reads:
    """What both loader backends share: the rank's owned rows, its cache, a step's rows and their encoded bytes
    (read in the training loop's process, through the cache), and the caption tokens."""

    def __init__(self, pairs: Pairs, train_rows: list[int], cfg: ClipTrainConfig, rank: int, ranks: int,
                 steps: int):
        self.pairs, self.cfg, self.rank, self.steps = pairs, cfg, rank, steps
        self.owned = owned_rows(train_rows, rank, ranks)
        if not self.owned:
            raise ValueError(f"rank {rank} of {ranks} owns no training pair ({len(train_rows)} in all)")
        self.cache = NoEvictCache(int(cfg.cache_mb * 2**20))

    def reads(self, step: int) -> tuple[list[int], list[bytes]]:
        """The index rows of `step` and their JPEG bytes."""
        rows = step_rows(self.owned, self.cfg.seed, step, self.rank, self.cfg.micro_batch)
        return rows, [self.cache.get(self.pairs.ids[r], lambda r=r: self.pairs.read(r)) for r in rows]

    def tokens(self, rows: list[int]) -> torch.Tensor:
        return caption_tokens([self.pairs.tokens[r] for r in rows], self.cfg.model)

    def close(self) -> None:
        self.pairs.close()


class Loader(Reads):
    """Batches of (images, tokens) for one rank, `prefetch` steps ahead on `workers` processes (spawned, so they
    share nothing with the rank's threads or its process group's sockets)."""

    def __init__(self, pairs: Pairs, train_rows: list[int], cfg: ClipTrainConfig, rank: int, ranks: int,
                 steps: int):
        super().__init__(pairs, train_rows, cfg, rank, ranks, steps)
        self.pool = multiprocessing.get_context("spawn").Pool(cfg.workers) if cfg.workers else None
        self.pending: dict[int, tuple[list[int], Any]] = {}

    def _job(self, step: int) -> tuple[list[int], Any]:
        rows, blobs = self.reads(step)
        job = (blobs, self.cfg.model.image_size, tuple(self.cfg.crop_scale), (self.cfg.seed, step, self.rank))
        return rows, (self.pool.apply_async(decode_batch, (job,)) if self.pool is not None else job)

    def next(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(images, tokens, seconds waited) of `step`; hands the next steps' batches to the workers."""
        t0 = time.perf_counter()
        for s in range(step, min(step + self.cfg.prefetch, self.steps)):
            if s not in self.pending:
                self.pending[s] = self._job(s)
        rows, job = self.pending.pop(step)
        images = job.get() if self.pool is not None else decode_batch(job)
        return torch.from_numpy(images), self.tokens(rows), time.perf_counter() - t0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
        super().close()
