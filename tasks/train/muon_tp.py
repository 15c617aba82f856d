"""Muon under tensor parallelism: Newton-Schulz of the whole matrix, where a tp rank holds a slice of it.

DeepSpeed's Muon paths (ZeRO-1/2 `get_flat_partition`, the ZeRO-0 `MuonWithAuxAdam.step`) call
`deepspeed.runtime.zero.muon.original_muon.muon_update(grad, momentum, ...)` per matrix with the rank's own
tensors, and hand it one value of the parameter's own: `is_expert_group`. `tag` sets that, on each tp-split
Muon matrix, to a `TPSplit` (truthy, as an expert group's flag is); `install` puts `tp_aware` in front of
DeepSpeed's function, which for a `TPSplit` all-gathers the tp group's slices of the gradient and the momentum,
runs DeepSpeed's own update on the whole matrix (one rank's momentum step, Newton-Schulz and aspect-ratio scale)
and keeps this rank's slice of the momentum and of the update (parallel.tp `merge_tensors` / `shard_tensor`). The
tp ranks of a group hold slices of the same shapes in the same order, so they reach each matrix's all-gather
together; the data-parallel ranks of a ZeRO partition do so within their own tp groups. Inside pipeline stages
(tp × pp) a stage's tp ranks hold the same layers, so the same holds within each stage."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lifecycle.tasks.train.parallel.tp import merge_tensors, shard_tensor, split_spec


@dataclass(frozen=True)
class TPSplit:
    """How tp splits one Muon matrix (parallel.tp `split_spec`) and the group that holds its slices."""

    spec: tuple
    group: object
    size: int
    rank: int

    def __bool__(self) -> bool:
        return True

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The whole matrix from every tp rank's slice `t`."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return merge_tensors(parts, self.spec)

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        return shard_tensor(t, self.spec, self.size, self.rank)


def tp_aware(update):
    """DeepSpeed's `muon_update` for whole matrices also where a `TPSplit` marks a tp slice."""

    def muon_update(grad, momentum, beta=0.95, ns_steps=5, nesterov=True, ns_method="gram", is_expert_group=False,
                    num_heads=None):
        split = is_expert_group
        if not isinstance(split, TPSplit):
            return update(grad, momentum, beta, ns_steps, nesterov, ns_method, is_expert_group, num_heads)
        whole = split.gather(momentum)
        out = update(split.gather(grad), whole, beta, ns_steps, nesterov, ns_method, False, num_heads)
        momentum.copy_(split.mine(whole))
        return split.mine(out)

    muon_update.tp_aware = True  # type: ignore[attr-defined]
    return muon_update


def install() -> None:
    """Put `tp_aware` in front of DeepSpeed's muon_update, where its ZeRO-0 and ZeRO-1/2 paths look it up."""
    from deepspeed.runtime.zero.muon import muon_optimizer, original_muon

    if not getattr(original_muon.muon_update, "tp_aware", False):
        original_muon.muon_update = tp_aware(original_muon.muon_update)
    muon_optimizer.muon_update = original_muon.muon_update


def tag(model) -> None:
    """Mark each tp-split Muon matrix of `model` with its `TPSplit`, and install. `model`: a TensorParallelGPT, or
    a pipeline stage split over its tp group (parallel.pp `GPTPipe`: its parameters go by their GPT names,
    `dense_names`, and its tp group is DeepSpeed's slice group of the stage)."""
    tp = model.tp
    dense = model.dense_names() if hasattr(model, "dense_names") else {}
    tagged = 0
    for name, p in model.named_parameters():
        if getattr(p, "use_muon", False) and (spec := split_spec(model.cfg, dense.get(name, name))) is not None:
            p.is_expert_group = TPSplit(spec, tp.group, tp.size, tp.rank)
            tagged += 1
    if not tagged and any(getattr(p, "use_muon", False) for p in model.parameters()):
        raise RuntimeError("muon_tp.tag: no Muon matrix of this tp model maps to a tp split (parameter names?)")
    install()
