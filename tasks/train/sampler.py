"""The batch sampler, torch-free: which token windows a training step reads.

Sequence `j` of update `step`'s global batch is the window of `seq_len + 1` tokens (inputs and shifted targets)
at (non-empty train shard `k`, start `i`), drawn from `default_rng([seed, step, j])`: a shard with probability
proportional to its usable length (its tokens minus seq_len), then a uniform start in it. Micro-batch `micro` of
data-parallel rank `dp_rank` holds j = (dp_rank·grad_accum + micro)·B ... + B-1, B the micro-batch size
(`first_sequence`). So the global batch depends on its size only, not on how dp × grad_accum × micro-batch split
it, nor on tp/sp/pp (the ranks of one group share dp_rank). The trainer (`loader.get_batch`) and the step lineage
(`lifecycle lineage step`, lifecycle.lineage.cli) both read windows from here, so what the lineage says a step
read is what it read.

A training step reads data step `data_step(step, skipped)`: loss-spike rollbacks throw data steps away.
"""

from __future__ import annotations

import bisect
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
    step `step`; `lengths`: tokens of each non-empty train shard, in order."""
    usable = np.array([n - seq_len for n in lengths], dtype=np.float64).clip(min=0)
    cum = np.cumsum(usable / usable.sum())
    out = []
    for j in range(first, first + count):
        rng = np.random.default_rng([seed, step, j])
        k = min(int(np.searchsorted(cum, rng.random(), side="right")), len(lengths) - 1)
        out.append((k, int(rng.integers(0, int(usable[k])))))
    return out


LAYOUT_SAMPLER_FIELDS = ("world_size", "micro_batch_size", "grad_accum")
"""The sampler-state fields that are layout: a resume under another layout (same global batch) may differ in them."""


def sampler_state(cfg, next_step: int, world: int, skipped: Sequence[int] = ()) -> dict:
    """The sampler's position and the settings it depends on, as a checkpoint keeps it (`cfg`: a TrainConfig).
    `skipped`: data steps thrown away by loss-spike rollbacks; step s reads data step `data_step(s, skipped)`."""
    return {"kind": "uniform_windows", "next_step": next_step, "seed": cfg.seed, "world_size": world,
            "micro_batch_size": cfg.batch.micro_batch_size, "grad_accum": cfg.batch.grad_accum,
            "seq_len": cfg.model.seq_len,
            "skipped": sorted(skipped)}
