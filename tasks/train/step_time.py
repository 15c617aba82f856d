"""Step time of a layout (`step_time`): compute, pipeline bubble and communication, with the constants of
`Hardware`. Torch-free; the layout search (lifecycle.tasks.train.layout_search) ranks layouts by it.

Compute is not a flat fraction of peak. Each matmul of a block runs at a rate that depends on its shape
(`gemm_seconds`): a tile grid of 128 × 128 output tiles spread in waves over the GPU's SMs (a last, partly empty
wave and partly filled edge tiles waste their share), a short reduction dimension that cannot hide its prologue
(k / (k + 128)), and the roofline (a matmul that moves more bytes than its FLOPs can cover runs at the memory's
pace), under a ceiling (`gemm_efficiency`) that large matmuls reach. Backward is two matmuls per forward one:
the input gradient (m·n·k with n and k swapped) and the weight gradient (its reduction over the tokens). The
attention kernel runs at `attention_efficiency` of peak on the FLOPs PaLM's formula counts (12·L·h·s per token,
forward and backward), and the elementwise work (norms, residual adds, activation function, RoPE) at the memory
bandwidth. So small widths, thin tensor-parallel slices and short micro-batches cost what they cost on the
hardware, and the predicted MFU moves with the layout (docs/benchmarks.md checks it against published runs).

Communication: data-parallel traffic overlaps the backward pass (ZeRO 0-2: gradient buckets reduced while
backward goes on; ZeRO-3: the all-gathers also prefetch in forward); what does not fit under it shows. Tensor-,
sequence- and pipeline-parallel traffic is on the critical path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.parallel.mesh import Layout
from lifecycle.tasks.train.planner import GiB, params_per_rank
from lifecycle.tasks.train.sizing import flops_per_token
from lifecycle.tasks.train.zero_memory import PRECISIONS

TILE = 128  # output tile edge of a tensor-core matmul kernel (CUTLASS/cuBLAS on Hopper and Ampere)


@dataclass(frozen=True)
class Hardware:
    """Constants the step-time model assumes (override them on the command line). Defaults: an H100 SXM node."""

    peak_flops: float = 989e12
    """Dense bf16 FLOP/s of one GPU (H100 SXM datasheet)."""
    gemm_efficiency: float = 0.55
    """Fraction of peak a large bf16 matmul sustains inside a training step. Set from two published runs
    (llm-foundry's MPT 1B and 7B on 8 H100s, seq 2048, no recomputation: `python -m bench.planner_published`),
    and checked on the others; below what cuBLAS reaches alone, since a step also pays for launches, copies
    and synchronisation between its matmuls."""
    attention_efficiency: float = 0.35
    """Fraction of peak a fused attention kernel reaches on the FLOPs the 12·L·h·s term counts, forward and
    backward (set with `gemm_efficiency`; causal masking skips half of those FLOPs, which this absorbs)."""
    memory_bw: float = 3.35e12
    """Bytes/s of the GPU's memory (H100 SXM HBM3), for the elementwise work and memory-bound matmuls."""
    sms: int = 132
    """Streaming multiprocessors: the matmul tiles of one wave."""
    mfu: float | None = None
    """A flat fraction of peak for all compute instead of the shape model (the CPU's `train.layout: auto`)."""
    gpus_per_node: int = 8
    intra_node_bw: float = 360e9
    """Bytes/s one GPU moves in a ring inside a node (NVLink 4: 450 GB/s per direction, ~80 % achieved)."""
    inter_node_bw: float = 40e9
    """Bytes/s per GPU between nodes (one 400 Gb/s NDR InfiniBand NIC per GPU, ~80 % achieved)."""
    pcie_bw: float = 25e9
    """Bytes/s host<->device per GPU for ZeRO-Offload (PCIe 5 x16, about half its peak as measured in practice)."""
    cpu_adam_params_per_s: float = 1e9
    """Parameters per second the CPU Adam of ZeRO-Offload updates for one GPU (its share of the host's cores)."""
    reserve_bytes: float = 2 * GiB
    """Memory per GPU not available to training: CUDA context, NCCL buffers, allocator fragmentation."""


def gemm_seconds(m: float, n: float, k: float, hw: Hardware, elem_bytes: int = 2) -> float:
    """Seconds of one (m × k) @ (k × n) matmul (see the module docstring)."""
    flops = 2 * m * n * k
    if hw.mfu is not None:
        return flops / (hw.peak_flops * hw.mfu)
    tiles_m, tiles_n = math.ceil(m / TILE), math.ceil(n / TILE)
    tiles = tiles_m * tiles_n
    waves = math.ceil(tiles / hw.sms)
    fill = (m * n) / (tiles_m * tiles_n * TILE * TILE) * tiles / (waves * hw.sms)
    rate = hw.peak_flops * hw.gemm_efficiency * fill * k / (k + TILE)
    memory = elem_bytes * (m * k + k * n + m * n) / hw.memory_bw
    return max(flops / rate, memory)


def _train_gemms(m: float, n: float, k: float, hw: Hardware, e: int) -> tuple[float, float]:
    """(forward, backward) seconds of a weight matmul: forward m·k·n; backward the input gradient (m·n·k) and
    the weight gradient (k·m·n, reduced over the m tokens)."""
    return gemm_seconds(m, n, k, hw, e), gemm_seconds(m, k, n, hw, e) + gemm_seconds(k, n, m, hw, e)


def block_seconds(m: ModelConfig, lay: Layout, hw: Hardware, e: int, s: int) -> dict:
    """Seconds of one block for one micro-batch on one rank: matmuls forward and backward, the attention
    kernel, the elementwise work; plus the recomputation `lay.recompute` adds."""
    t, tokens, h = lay.tp, lay.micro_batch * s / lay.sp, m.n_embd
    kv, hid = m.kv_heads * m.head_dim, m.mlp_hidden
    up = hid * (2 if m.mlp == "swiglu" else 1)
    shapes = [(tokens, (h + 2 * kv) / t, h), (tokens, h, h / t), (tokens, up / t, h), (tokens, h, hid / t)]
    fwd_bwd = [_train_gemms(*shape, hw, e) for shape in shapes]
    gemm_f, gemm_b = sum(f for f, _ in fwd_bwd), sum(b for _, b in fwd_bwd)
    attn_flops = 12 * tokens * h * s / t  # PaLM: forward 4·s·h, backward 8·s·h per token (s: the whole sequence)
    attn_f = attn_flops / 3 / (hw.peak_flops * (hw.mfu or hw.attention_efficiency))
    # norms (read, write), two residual adds, the activation function over the hidden width, RoPE on q and k:
    # elements moved per token in forward; backward moves about twice as many
    elems = 2 * 2 * h + 2 * 3 * h / t + 3 * hid / t + 4 * (h + kv) / t
    elem_f = 0.0 if hw.mfu is not None else tokens * elems * e / hw.memory_bw
    forward = gemm_f + attn_f + elem_f
    out = {"forward": forward, "backward": gemm_b + 2 * attn_f + 2 * elem_f}
    if lay.recompute == "full":
        out["recompute"] = forward - fwd_bwd[-1][0]  # torch stops before the last matmul (nothing needs it)
    elif lay.recompute == "selective":
        out["recompute"] = fwd_bwd[1][0] + elem_f  # the output projection and the elementwise ops
    else:
        out["recompute"] = 0.0
    return out


def dp_bandwidth(lay: Layout, hw: Hardware) -> float:
    """Bytes/s per rank of the data-parallel (dp × sp) collectives. Inside one node, NVLink. Across nodes NCCL runs
    one ring per NIC, so a node's dp ranks move the cross-node share over as many NICs as the node holds dp
    ranks: when tp fills the node there is one of them, and one NIC (the reason tp goes inside a node and dp
    across). The grid puts tp, then sp, then dp on consecutive ranks (lifecycle.tasks.train.parallel.mesh)."""
    inner = lay.tp * lay.sp
    if lay.dp * inner <= hw.gpus_per_node:
        return hw.intra_node_bw
    per_node = max(1, min(lay.dp, hw.gpus_per_node // inner))
    return min(hw.intra_node_bw, per_node * hw.inter_node_bw)


def step_time(m: ModelConfig, lay: Layout, global_batch: int, hw: Hardware, precision: str = "bf16",
              seq_len: int | None = None) -> dict:
    """Seconds per optimizer step of `global_batch` sequences, by part, and the MFU it implies."""
    prec = PRECISIONS[precision]
    e = prec.act
    s, h, L = seq_len or m.seq_len, m.n_embd, m.n_layer
    m_micro = global_batch // (lay.dp * lay.micro_batch)  # micro-batches per step per pipeline
    blk = block_seconds(m, lay, hw, e, s)
    tokens = lay.micro_batch * s / lay.sp
    head_f, head_b = _train_gemms(tokens, m.vocab_size, h, hw, e)  # replicated over tp (no vocab-parallel head)
    per_micro = -(-L // lay.pp) * (blk["forward"] + blk["backward"] + blk["recompute"]) + (head_f + head_b) / lay.pp
    compute = per_micro * m_micro
    bubble = per_micro * (lay.pp - 1)
    psi_rank = params_per_rank(m, lay)
    nd = lay.dp * lay.sp
    dp_bw = dp_bandwidth(lay, hw)
    ring = (nd - 1) / nd if nd > 1 else 0.0
    # ZeRO-0/1: one all-reduce per step (2(n-1)/n Ψ); ZeRO-2: a reduce-scatter per micro-batch + an all-gather;
    # ZeRO-3: all-gather in forward and backward + reduce-scatter per micro-batch.
    volume = {0: 2, 1: 2, 2: m_micro + 1, 3: 3 * m_micro}[lay.zero]
    dp_comm = volume * ring * psi_rank * prec.grad / dp_bw
    overlap = compute * (0.9 if lay.zero == 3 else 2 / 3)  # forward too at ZeRO-3 (prefetched all-gathers)
    dp_exposed = max(dp_comm - overlap, dp_comm / max(1, L))  # the last layer's share never hides
    act = tokens * h * prec.act  # one activation tensor
    tp_ar = (4 + (2 if lay.recompute == "full" else 0)) * -(-L // lay.pp) * m_micro  # all-reduces (or AG + RS) per step
    tp_comm = tp_ar * 2 * (lay.tp - 1) / lay.tp * act / hw.intra_node_bw if lay.tp > 1 else 0.0
    sp_comm = (8 * -(-L // lay.pp) * m_micro * (lay.sp - 1) / lay.sp * act / lay.tp / hw.intra_node_bw
               if lay.sp > 1 else 0.0)  # 4 all-to-alls forward, 4 backward
    pp_bw = hw.intra_node_bw if lay.tp * lay.pp * lay.sp <= hw.gpus_per_node else hw.inter_node_bw
    pp_comm = 2 * m_micro * act / lay.tp / pp_bw if lay.pp > 1 else 0.0
    offload = 0.0
    if lay.offload:
        part = psi_rank / nd
        offload = part * (prec.grad + prec.param) / hw.pcie_bw + part / hw.cpu_adam_params_per_s
    parts = {"compute_s": compute, "bubble_s": bubble, "dp_comm_s": dp_exposed, "tp_comm_s": tp_comm,
             "sp_comm_s": sp_comm, "pp_comm_s": pp_comm, "offload_s": offload}
    parts["step_s"] = sum(parts.values())
    parts["dp_comm_total_s"] = dp_comm
    flops = global_batch * s * flops_per_token(m, s)
    parts["mfu"] = flops / (parts["step_s"] * lay.ranks * hw.peak_flops) if parts["step_s"] else 0.0
    return parts

