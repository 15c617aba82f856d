"""What the DeepSpeed engine we pin (0.19.8, constraints.txt) holds per rank for the model: parameters, gradients,
optimizer states and its own gradient buffers, at the two moments that bound the peak (torch-free;
lifecycle.tasks.train.planner adds activations, ZeRO-3's gathered parameters and the rest).

Read in deepspeed/runtime/zero/stage_1_and_2.py, zero/stage3.py, fp16/unfused_optimizer.py and engine.py, and
measured storage by storage with 2 CPU ranks by `python -m bench.zero_states` (every term below is a tensor it
finds, under the attribute named). Ψ parameters over N ZeRO ranks, p and g bytes per parameter and gradient
element (2 in bf16/fp16, 4 in fp32), B = reduce_bucket_size elements.

Model states (`model_states`; the accounting of Rajbhandari et al. 2020, "ZeRO", section 3.1), as held at the end
of backward:
- parameters pΨ: stage 0 the model's own, stages 1-2 one flat buffer (`bit16_groups_flat`, whole on every rank),
  stage 3 the rank's partition pΨ/N (`fp16_partitioned_groups_flat`);
- gradients: stages 0-1 every parameter's, gΨ (stage 1 reduces them only at the end of backward); stage 2 the
  rank's partition gΨ/N (`grads_in_partition`, filled as backward goes); stage 3 the same, allocated once for
  good (`grad_partitions_flat_buffer`);
- optimizer: AdamW's two fp32 moments, 8Ψ (8Ψ/N under ZeRO), and fp32 master weights 4Ψ/N under ZeRO (stages
  1-2 `single_partition_of_fp32_groups`, stage 3 `fp32_partitioned_groups_flat`: a clone even when the weights
  are fp32 already); at stage 0 in 16 bits the engine's FP16_UnfusedOptimizer keeps them whole, 4Ψ
  (`fp32_groups`); at stage 0 in fp32 there are none (torch AdamW steps the model's parameters).
So K = 12 bytes of optimizer state per parameter, 8 at stage 0 in fp32: the paper's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N
and 16Ψ/N in 16 bits.

Buffers (`engine_buffers`):
- backward: stages 1-2 a gradient bucket of B elements (`ipg_buckets[dtype].buffer`), allocated at backward's
  first gradient and released at its end (two with overlap_comm); stage 3 one, for good; stage 0 flattened copies
  of up to 5e8 elements (engine.py `allreduce_bucket`, MEMORY_OPT_ALLREDUCE_SIZE) while it all-reduces. Stages
  2-3 also hold the gradient autograd has just made for a parameter until its hook copies it into the bucket:
  at most the largest tensor, g·largest (the output head's, first in backward, while every activation is alive).
- step: the gradient partition converted to fp32, 4Ψ/N whatever p is (stages 1-2 `flat_grad_partition.to(fp32)`
  as `single_partition_of_fp32_groups[i].grad`, stage 3 `fp32_partitioned_groups_flat[i].grad`); at stage 0 in 16
  bits the fp32 gradient of every parameter, 4Ψ (`fp32_groups[i].grad`); none at stage 0 in fp32. Stage 1 enters
  the step with its partition of the gradients only (`averaged_gradients`, gΨ/N): the rest, g(Ψ - Ψ/N), was
  released at the end of backward.

The peak is the larger of backward (states + buckets + one gradient) and step (states - released + the fp32
gradients + stage 3's bucket). In 16 bits at stage 2 that is the step's 2Ψ + (2 + 4 + 8 + 4)Ψ/N = 2Ψ + 18Ψ/N:
DeepSpeed 0.19.8's own `estimate_zero2_model_states_mem_needs` (stage_1_and_2.py); the 4Ψ + 16Ψ/N of its
docs/code-docs/source/memory.rst is not what this version allocates (it keeps the 16-bit gradient partition, not
every gradient). Not counted: the last partition's alignment padding and, at stages 1-2, the part of a parameter
that straddles two ranks' partitions, whose whole gradient the rank keeps (measured: a few % on bench's
4.3M-parameter model, whose 1M-element embedding straddles; one tensor in Ψ/N on a large model).
"""

from __future__ import annotations

from dataclasses import dataclass

GRAD_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size (zero/config.py), elements
ALLREDUCE_BUCKET = 500_000_000  # stage 0's flattened all-reduce copies (engine.py MEMORY_OPT_ALLREDUCE_SIZE), elements
FP32 = 4  # bytes of the master weights, the moments and the step's gradients, whatever the training precision


@dataclass(frozen=True)
class Precision:
    name: str
    param: int
    grad: int
    act: int
    """Bytes per activation element."""
    master: int = FP32
    """Bytes per master weight and per element of the gradient the step reads (bf16 with
    `train.engine.optimizer_states: bf16`: DeepSpeed's bf16_master_weights_and_grads)."""
    moment: int = FP32
    """Bytes per element of each Adam moment (bf16: bf16_optimizer_states)."""

    def optimizer(self, zero: int) -> int:
        """K: optimizer bytes per parameter: two moments and the master weights, none at stage 0 in fp32; 12 in
        fp32 states, 6 with bf16 states."""
        return 2 * self.moment + (self.master if zero >= 1 or self.param < FP32 else 0)


PRECISIONS = {"bf16": Precision("bf16", 2, 2, 2), "fp16": Precision("fp16", 2, 2, 2), "fp32": Precision("fp32", 4, 4, 4),
              "bf16-states": Precision("bf16-states", 2, 2, 2, master=2, moment=2)}
"""`bf16-states`: bf16 weights with bf16 master weights, gradients and Adam moments (ZeRO 1-3)."""


def model_states(psi: float, zero: int, nd: int, prec: Precision, offload: bool = False, muon: float = 0.0) -> dict:
    """Per-rank bytes of parameters, gradients and optimizer states for Ψ parameters over nd ZeRO ranks, as held
    at the end of backward (see the module docstring). `muon`: how many of the Ψ DeepSpeed's Muon steps
    (`muon_states`); AdamW steps the rest."""
    p, g, k = prec.param * psi, prec.grad * psi, prec.optimizer(zero) * (psi - muon)
    if zero >= 1:
        k /= nd
    if zero >= 2:
        g /= nd
    if zero >= 3:
        p /= nd
    k += muon_states(muon, zero, nd, prec)
    if offload:
        k, g = 0.0, (0.0 if zero >= 2 else g)  # the partition's gradients and the states live on the CPU
    return {"params": p, "grads": g, "optimizer": k}


def muon_states(psi: float, zero: int, nd: int, prec: Precision) -> float:
    """Bytes per rank of DeepSpeed's MuonWithAuxAdam for the Ψ parameters it steps with Muon (the blocks'
    matrices; `train.optimizer.name: muon`): one momentum buffer where AdamW keeps two moments, and the master
    weights as for AdamW. Stage 0: the momentum in fp32 beside the master weights (none in fp32). Stages 1-2
    (stage_1_and_2.py `_muon_momentum_buffer`, `_muon_staging_momentum`): the momentum of the parameters in the
    rank's partition, in the gradients' dtype, twice (the committed buffer and the step's staging copy, which
    a skipped step discards). Stage 3 (stage3.py `_create_momentum_buffer`): a partition in the gradients' dtype
    (measured: 4 bytes in fp32, 2 in bf16; bench.zero_states)."""
    if zero == 0:
        return (FP32 + (prec.master if prec.param < FP32 else 0)) * psi
    if zero in (1, 2):
        return (prec.master + 2 * prec.grad) * psi / nd
    return (prec.master + prec.grad) * psi / nd


def engine_buffers(psi: float, zero: int, nd: int, prec: Precision, largest: float, offload: bool = False,
                   device: str = "cuda", reduce_bucket: float = GRAD_BUCKET, overlap_comm: bool | None = None) -> dict:
    """DeepSpeed's buffers beside the model states, bytes per rank (see the module docstring): `grad_bucket` and
    `pending_grad` in backward; `step_fp32_grads` in the step, which `step_grads_released` (stage 1) enters
    without. `largest`: elements of the largest parameter tensor on the rank. `device` "cuda": a buffer counts
    whole, as the caching allocator hands it out; "cpu": only the pages gradients write, min(Ψ, bucket)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, not {device!r}")
    g = prec.grad
    if zero == 0:
        bucket = min(psi, ALLREDUCE_BUCKET) * g
    else:
        copies = 2 if (zero == 3 if overlap_comm is None else overlap_comm) and zero in (1, 2) else 1
        bucket = copies * (reduce_bucket if device == "cuda" else min(psi, reduce_bucket)) * g
    if offload:  # the partition's fp32 gradients are on the CPU
        fp32_grads = 0.0
    elif zero == 0:
        fp32_grads = FP32 * psi if prec.param < FP32 else 0.0
    else:
        fp32_grads = prec.master * psi / nd
    return {"grad_bucket": bucket, "pending_grad": largest * g if zero >= 2 else 0.0,
            "step_fp32_grads": fp32_grads, "step_grads_released": g * (psi - psi / nd) if zero == 1 else 0.0}


MUON_GATHER_ENTRY = 64 * 2**20  # bytes: DeepSpeed's _muon_allgather_max_buffer_bytes (zero/stage3.py)
MUON_GATHER_CACHE = 256 * 2**20  # bytes: its _muon_allgather_max_cached_bytes


def muon_gather_cache(numels: list[int], nd: int, elem: int = FP32) -> float:
    """ZeRO-3 under Muon: the all-gather buffers DeepSpeed caches to rebuild each Muon matrix's whole gradient
    for Newton-Schulz (stage3.py `_muon_all_gather_partitions`), bytes per rank, held for good. One cache entry
    per distinct partition size, i.e. per distinct matrix size in `numels`: a local and a gathered buffer,
    (nd + 1)·ceil(numel / nd) elements of `elem` bytes (the gradients'), at most MUON_GATHER_ENTRY each and
    MUON_GATHER_CACHE in all."""
    entries = [min(MUON_GATHER_ENTRY, (nd + 1) * -(-n // nd) * elem) for n in set(numels)]
    return min(MUON_GATHER_CACHE, float(sum(entries)))


def muon_tp_gather(numels: list[int], tp: int, zero: int, prec: Precision) -> float:
    """Tensor parallelism under Muon (lifecycle.tasks.train.muon_tp): to orthogonalise a tp-split matrix whole, a
    rank all-gathers its tp group's slices of the gradient and of the momentum into whole matrices for the one
    update, then keeps its slices: the largest matrix's gradient and momentum, whole, bytes per rank, transient
    during the step (one matrix at a time). Their dtype: the gradients' at ZeRO-1/2 (the momentum is kept in it,
    `muon_states`), fp32 at ZeRO-0 (the step's fp32 gradients, the fp32 momentum). `numels`: the whole (dense)
    sizes of the Muon matrices, every one of which tp splits (the blocks' q/k/v, o, MLP matrices)."""
    if tp <= 1 or not numels:
        return 0.0
    return 2.0 * max(numels) * (FP32 if zero == 0 else prec.grad)


def muon_buffers(numels: list[int], zero: int, nd: int, prec: Precision, psi: float, muon: float,
                 tp: int = 1) -> dict:
    """DeepSpeed's buffers under Muon beside its states, bytes per rank: ZeRO-3's `gather_cache`
    (`muon_gather_cache`, held for good) and, at ZeRO-2, the gradients beyond the rank's partition, `whole_grads`:
    Newton-Schulz needs whole matrices, so the gradients are whole once backward ends (`averaged_gradients`;
    measured, bench.zero_states). Stage 3 makes the step's fp32 gradients one sub-group at a time, and Muon's
    matrices are a group of their own: `step_grads_not_made` is what the larger of the two leaves out. Under
    tensor parallelism the step gathers one whole matrix's gradient and momentum (`tp_gather`, `muon_tp_gather`).
    `numels`: the sizes of the Muon matrices (their distinct sizes matter); `muon`: how many of the rank's Ψ
    they hold."""
    if not muon:
        return {"gather_cache": 0.0, "whole_grads": 0.0, "step_grads_not_made": 0.0, "tp_gather": 0.0}
    return {"gather_cache": muon_gather_cache(numels, nd, prec.grad) if zero == 3 else 0.0,
            "whole_grads": prec.grad * (psi - psi / nd) if zero == 2 else 0.0,
            "step_grads_not_made": prec.master * (psi - max(muon, psi - muon)) / nd if zero == 3 else 0.0,
            "tp_gather": muon_tp_gather(numels, tp, zero, prec)}


def engine_bytes(psi: float, zero: int, nd: int, prec: Precision, largest: float, **kw) -> dict:
    """Model states plus DeepSpeed's buffers at backward's peak and at the step's, and the larger: what
    `bench.zero_states` measures (activations and ZeRO-3's gathered parameters are not in it). `muon`: the
    parameters Muon steps; `muon_numels`: their matrices' sizes (ZeRO-3's gather cache)."""
    muon = kw.pop("muon", 0.0)
    extra = muon_buffers(kw.pop("muon_numels", []), zero, nd, prec, psi, muon)
    states = sum(model_states(psi, zero, nd, prec, kw.get("offload", False), muon).values()) + extra["gather_cache"]
    buf = engine_buffers(psi, zero, nd, prec, largest, **kw)
    backward = max(states + buf["grad_bucket"] + buf["pending_grad"], states + extra["whole_grads"])
    step = states - buf["step_grads_released"] + buf["step_fp32_grads"] + (buf["grad_bucket"] if zero == 3 else 0.0)
    step -= extra["step_grads_not_made"]
    return {"states": states, "backward": backward, "step": step, "total": max(backward, step)}
