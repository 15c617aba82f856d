"""The batch sampler, torch-free: which token windows a training step reads.

Sequence `j` of update `step`'s global batch is the window of `seq_len + 1` tokens (inputs and shifted targets)
at (non-empty train shard `k`, start `i`), drawn from `default_rng([seed, step, j])`. Where a window may start is
`train.batch.window_starts`:
- `anywhere`: a shard with probability proportional to its usable length (its tokens minus seq_len), then a
  uniform start in it (`windows`).
- `documents`: a start among the shard's `chunk_starts` (each document's first token, and every seq_len past it
  inside a longer document), a shard with probability proportional to its number of them (`document_windows`).
  Most windows begin at a document boundary and no token is dropped: a long document's tail starts a later chunk.
Micro-batch `micro` of data-parallel rank `dp_rank` holds j = (dp_rank·grad_accum + micro)·B ... + B-1, B the
micro-batch size (`first_sequence`). So the global batch depends on its size only, not on how dp × grad_accum ×
micro-batch split it, nor on tp/sp/pp (the ranks of one group share dp_rank). The trainer (`loader.get_batch`) and
the step lineage (`lifecycle lineage step`, lifecycle.lineage.steps) both read windows from `step_windows`, so what
the lineage says a step read is what it read.

A training step reads data step `data_step(step, skipped)`: loss-spike rollbacks throw data steps away.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Sequence

import numpy as np


def data_step(step: int, skipped: Iterable[int]) -> int:
    """The data step that training step `step` reads: the step-th natural number not in `skipped`
    (the data steps a loss-spike rollback threw away; see lifecycle.tasks.train.trainer.Trainer.rollback)."""
    skipped = sorted(set(skipped))
    d = step
    # d = step + #{k in skipped : k <= d}, found by a fixed point (skipped is finite)
    while True:
        nd = step + bisect.bisect_right(skipped, d)
        if nd == d:
            return d
        d = nd


def first_sequence(dp_rank: int, micro: int, grad_accum: int, micro_batch: int) -> int:
    """Index in the global batch of the first sequence of micro-batch `micro` of data-parallel rank `dp_rank`."""
    return (dp_rank * grad_accum + micro) * micro_batch


def windows(lengths: Sequence[int], seq_len: int, seed: int, step: int, first: int, count: int) -> list[tuple[int, int]]:
    """(shard index among the non-empty train shards, start token) of sequences first..first+count-1 of data
    step `step`, starting anywhere; `lengths`: tokens of each non-empty train shard, in order."""
    usable = np.array([n - seq_len for n in lengths], dtype=np.float64).clip(min=0)
    cum = np.cumsum(usable / usable.sum())
    out = []
    for j in range(first, first + count):
        rng = np.random.default_rng([seed, step, j])
        k = min(int(np.searchsorted(cum, rng.random(), side="right")), len(lengths) - 1)
        out.append((k, int(rng.integers(0, int(usable[k])))))
    return out


def chunk_starts(tokens: np.ndarray, eot: int, seq_len: int) -> np.ndarray:
    """Sorted int64 starts a `documents` window may take in one shard: each document's first token (the shard's
    first, and each one after an end-of-text id `eot`) and every seq_len past it inside the same document, each
    clamped to the shard's last whole window (len - seq_len - 1), so the windows at these starts cover every token.
    Empty when the shard is shorter than one window of seq_len + 1 tokens."""
    n, last = len(tokens), len(tokens) - seq_len - 1
    if last < 0:
        return np.empty(0, dtype=np.int64)
    docs = np.flatnonzero(np.asarray(tokens) == eot) + 1
    docs = np.concatenate(([0], docs[docs < n])).astype(np.int64)
    chunks = -(-(np.append(docs[1:], n) - docs) // seq_len)  # ceil(document length / seq_len), >= 1
    offset = np.arange(int(chunks.sum()), dtype=np.int64) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    starts = np.minimum(np.repeat(docs, chunks) + offset * seq_len, last)  # non-decreasing
    return starts[np.concatenate(([True], starts[1:] != starts[:-1]))]


_STARTS: dict[tuple, np.ndarray] = {}
"""`chunk_starts` of each shard file this process read, keyed by (path, size, mtime, eot, seq_len)."""


def shard_starts(shard: np.ndarray, eot: int, seq_len: int) -> np.ndarray:
    """`chunk_starts` of a shard, computed once per process for a memory-mapped file (`np.memmap`)."""
    path = getattr(shard, "filename", None)
    if path is None:
        return chunk_starts(shard, eot, seq_len)
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns, eot, seq_len)
    if (hit := _STARTS.get(key)) is None:
        hit = _STARTS[key] = chunk_starts(shard, eot, seq_len)
    return hit


def document_windows(starts: Sequence[np.ndarray], seed: int, step: int, first: int, count: int
                     ) -> list[tuple[int, int]]:
    """(shard index, start token) of sequences first..first+count-1 of data step `step`, at a start drawn
    uniformly from all shards' `starts` (each shard's `chunk_starts`, in order)."""
    sizes = np.array([len(s) for s in starts], dtype=np.float64)
    if not sizes.sum():
        raise ValueError("no train shard holds a window of seq_len + 1 tokens")
    cum, last = np.cumsum(sizes / sizes.sum()), int(np.flatnonzero(sizes)[-1])
    out = []
    for j in range(first, first + count):
        rng = np.random.default_rng([seed, step, j])
        k = min(int(np.searchsorted(cum, rng.random(), side="right")), last)
        out.append((k, int(starts[k][rng.integers(0, len(starts[k]))])))
    return out


def step_windows(mode: str, shards: Sequence[np.ndarray], eot: int, seq_len: int, seed: int, step: int,
                 first: int, count: int) -> list[tuple[int, int]]:
    """The windows of `windows` (mode `anywhere`) or `document_windows` (`documents`) over the non-empty train
    `shards` (memory maps, in order): what the trainer reads and the step lineage reports."""
    if mode == "anywhere":
        return windows([len(d) for d in shards], seq_len, seed, step, first, count)
    return document_windows([shard_starts(d, eot, seq_len) for d in shards], seed, step, first, count)


def window_mode(train: dict) -> str:
    """A run's `train.batch.window_starts` from its config.json's `train` section: `anywhere` when the file
    predates the field (a run started before document-aligned windows existed resumes as it was trained)."""
    return (train.get("batch") or {}).get("window_starts", "anywhere")


LAYOUT_SAMPLER_FIELDS = ("world_size", "micro_batch_size", "grad_accum")
"""The sampler-state fields that are layout: a resume under another layout (same global batch) may differ in them."""


def sampler_state(cfg, next_step: int, world: int, skipped: Sequence[int] = ()) -> dict:
    """The sampler's position and the settings it depends on, as a checkpoint keeps it (`cfg`: a TrainConfig).
    `skipped`: data steps thrown away by loss-spike rollbacks; step s reads data step `data_step(s, skipped)`.
    The kind names where windows start (`uniform_windows`: anywhere, as every checkpoint before the field)."""
    kind = "uniform_windows" if cfg.batch.window_starts == "anywhere" else "document_windows"
    return {"kind": kind, "next_step": next_step, "seed": cfg.seed, "world_size": world,
            "micro_batch_size": cfg.batch.micro_batch_size, "grad_accum": cfg.batch.grad_accum,
            "seq_len": cfg.model.seq_len,
            "skipped": sorted(skipped)}
