"""Sequence parallelism, DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models").

The `sp` ranks of a group read the same micro-batches (the sampler keys on the dp coordinate only) and each keeps
a contiguous 1/sp slice of every sequence: tokens, targets (the targets are the inputs shifted by one before
slicing, so slice r's last target is slice r+1's first token) and positions (rank r's tokens sit at positions
r·T/sp ...: `GPT.seq_shard` offsets the RoPE tables or the learned position table). Everything but attention is
per token, so it runs on the slice unchanged. Document-aware attention (`attention: document`) needs the whole
window's token ids: `GPT.window_ids` all-gathers the slices' ids over the sp group (B·T integers per forward), so
every rank finds the same documents; a rank keeps its slice of the positions and hands the whole block-causal
mask to the attention, which runs over the whole sequence. Attention goes through DeepSpeed's
`deepspeed.sequence.layer.DistributedAttention`: an all-to-all turns q, k, v from (all heads, T/sp tokens) into
(H/sp heads, all T tokens), our causal SDPA runs on those heads, and a second all-to-all turns the output back.
With grouped-query attention k and v carry n_kv_head heads and are split the same way, so query heads
[r·H/sp, (r+1)·H/sp) land with their key/value heads [r·H_kv/sp, (r+1)·H_kv/sp); this needs sp to divide
n_kv_head (DeepSpeed's uneven-head path is not used).

The loss: each rank's cross-entropy is the mean over its slice; `SequenceParallel.loss` returns the mean of
those over the sp group (the full-sequence mean, as the slices are equal and training targets are never
ignored) and passes 1/sp of the gradient back to the local slice. DeepSpeed 0.19 reduces gradients over the
sequence-data-parallel group (dp × sp, `Mesh.get_sequence_data_parallel_group`) and divides by dp only
(engine `_reduce_non_expert_gradients`, ZeRO 1/2 `average_tensor`, ZeRO-3 `__avg_scatter_contiguous_grads`:
`world / sequence_parallel_size`): so the sum over the sp ranks of (1/sp)·∂(slice mean) is the gradient of the
full-sequence mean, and the update equals a single rank's on the whole batch up to the reduction order. ZeRO 1/2
partition the optimizer state over dp × sp. ZeRO-3 is refused with sp (parallel.rules.sp; see
docs/architecture.md, "Sequence parallelism").

gloo: `all_to_all_single`, the one collective DistributedAttention issues, works on torch 2.13's
ProcessGroupGloo (tests/train/test_parallel_sp.py runs the layer on gloo), so the layer is DeepSpeed's on CPU
and on NCCL alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lifecycle.tasks.train.model import GPT, causal_attention


class UlyssesAttention:
    """`CausalSelfAttention.attention` for a rank of an sp group: q, k, v (B, heads, T/sp, D) of this rank's
    slice in, the attention output of the same slice out, computed over the whole sequence.

    A plain callable, not an nn.Module: it holds no parameters, and the model's module tree (and its state
    dict, and ZeRO-3's hooks) stays the dense model's."""

    def __init__(self, group):
        from deepspeed.sequence.layer import DistributedAttention

        # batch-first layout (B, T, heads, D): scatter the heads (dim 2), gather the sequence (dim 1)
        self.layer = DistributedAttention(self._local, group, scatter_idx=2, gather_idx=1)

    @staticmethod
    def _local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Our causal (or block-causal: `mask` of the whole window) attention on (B, T, heads/sp, D): the full
        sequence, this rank's heads."""
        return causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p,
                                mask).transpose(1, 2)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.layer(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None, dropout_p=dropout_p,
                       mask=mask)
        return y.transpose(1, 2)


class _GroupMean(torch.autograd.Function):
    """Forward: the mean of a scalar over the group. Backward: 1/size of the gradient to the local input (the
    other ranks' terms are differentiated on those ranks)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.size = size
        total = local.detach().clone()
        dist.all_reduce(total, group=group)
        return total / size

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.size, None, None


class SequenceParallel:
    """This rank's part of Ulysses sequence parallelism over the sp group of a `Mesh`."""

    def __init__(self, mesh):
        self.group = mesh.get_sequence_parallel_group()
        self.rank = mesh.get_sequence_parallel_rank()
        self.size = mesh.get_sequence_parallel_world_size()

    def wrap(self, model: GPT) -> GPT:
        """Make `model` compute on this rank's slice: global positions, all-to-all attention in every block, the
        documents of the whole window (`gather`)."""
        model.seq_shard = self.rank
        model.window_ids = self.gather
        for block in model.blocks:
            block.attn.attention = UlyssesAttention(self.group)
        return model

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole windows (B, T) from this rank's slice (B, T/sp) of their token ids (collective over the sp
        group; integers, no gradient)."""
        parts = [torch.empty_like(ids) for _ in range(self.size)]
        dist.all_gather(parts, ids.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's contiguous slice of the inputs (B, T) and of their targets (the same positions)."""
        T = x.size(1)
        if T % self.size:
            raise ValueError(f"sequence length {T} is not divisible by train.parallel.sp={self.size}")
        n = T // self.size
        part = slice(self.rank * n, (self.rank + 1) * n)
        return x[:, part].contiguous(), y[:, part].contiguous()

    def loss(self, local: torch.Tensor) -> torch.Tensor:
        """The full-sequence mean loss from this rank's slice mean (collective over the sp group)."""
        return _GroupMean.apply(local, self.group, self.size)
