"""Step time of a layout (`step_time`): compute, pipeline bubble and communication, with the constants of
`Hardware`. Torch-free; the planner's layout search (lifecycle.tasks.train.layout_search) ranks layouts by it."""

from __future__ import annotations

from dataclasses import dataclass

from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.parallel.mesh import Layout
from lifecycle.tasks.train.planner import GiB, total_params
from lifecycle.tasks.train.sizing import flops_per_token, param_count
from lifecycle.tasks.train.zero_memory import PRECISIONS


@dataclass(frozen=True)
class Hardware:
    """Constants the step-time model assumes (override them on the command line). Defaults: an H100 SXM node."""

    peak_flops: float = 989e12
    """Dense bf16 FLOP/s of one GPU (H100 SXM datasheet)."""
    mfu: float = 0.45
    """Fraction of peak the matmuls reach (Megatron-LM/torchtitan report 40-55 % on H100 for 7-70B models)."""
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


def step_time(m: ModelConfig, lay: Layout, global_batch: int, hw: Hardware, precision: str = "bf16",
              seq_len: int | None = None) -> dict:
    """Seconds per optimizer step of `global_batch` sequences, by part (no overlap assumed)."""
    prec = PRECISIONS[precision]
    s, h, L = seq_len or m.seq_len, m.n_embd, m.n_layer
    n_active = param_count(m).active  # the matmul parameters a token goes through (top_k experts of an MoE)
    m_micro = global_batch // (lay.dp * lay.micro_batch)  # micro-batches per step per pipeline
    tokens = global_batch * s
    per_token = flops_per_token(m, s)  # 6·N + 12·L·h·s, forward + backward (PaLM appendix B)
    recompute = {"none": 0, "selective": 4 * L * h * s, "full": 2 * n_active + 4 * L * h * s}[lay.recompute]
    flops = tokens * (per_token + recompute)
    compute = flops / (lay.ranks * hw.peak_flops * hw.mfu)
    bubble = compute * (lay.pp - 1) / m_micro
    psi_rank = total_params(m) / (lay.tp * lay.pp)
    within_node = lay.ranks <= hw.gpus_per_node
    dp_bw = hw.intra_node_bw if within_node else hw.inter_node_bw
    nd = lay.dp * lay.sp
    ring = (nd - 1) / nd if nd > 1 else 0.0
    # ZeRO-0/1: one all-reduce per step (2(n-1)/n Ψ); ZeRO-2: a reduce-scatter per micro-batch + an all-gather;
    # ZeRO-3: all-gather in forward and backward + reduce-scatter per micro-batch.
    volume = {0: 2, 1: 2, 2: m_micro + 1, 3: 3 * m_micro}[lay.zero]
    dp_comm = volume * ring * psi_rank * prec.grad / dp_bw
    act = s / lay.sp * lay.micro_batch * h * prec.act  # one activation tensor
    tp_ar = (4 + (2 if lay.recompute == "full" else 0)) * L / lay.pp * m_micro  # all-reduces (or AG + RS) per step
    tp_comm = tp_ar * 2 * (lay.tp - 1) / lay.tp * act / hw.intra_node_bw if lay.tp > 1 else 0.0
    sp_comm = (8 * L / lay.pp * m_micro * (lay.sp - 1) / lay.sp * act / lay.tp / hw.intra_node_bw
               if lay.sp > 1 else 0.0)  # 4 all-to-alls forward, 4 backward
    pp_bw = hw.intra_node_bw if lay.tp * lay.pp * lay.sp <= hw.gpus_per_node else hw.inter_node_bw
    pp_comm = 2 * m_micro * act / lay.tp / pp_bw if lay.pp > 1 else 0.0
    offload = 0.0
    if lay.offload:
        part = psi_rank / nd
        offload = part * (prec.grad + prec.param) / hw.pcie_bw + part / hw.cpu_adam_params_per_s
    parts = {"compute_s": compute, "bubble_s": bubble, "dp_comm_s": dp_comm, "tp_comm_s": tp_comm,
             "sp_comm_s": sp_comm, "pp_comm_s": pp_comm, "offload_s": offload}
    parts["step_s"] = sum(parts.values())
    parts["mfu"] = flops / (parts["step_s"] * lay.ranks * hw.peak_flops) if parts["step_s"] else 0.0
    return parts

