"""Datasheet peak FLOP/s of a GPU, the MFU denominator (torch-free: the bench and the CLI import it too).

MFU is counted as nanoGPT's `estimate_mfu` and the PaLM paper (appendix B) count it: training FLOPs per token
6·N + 12·L·H·Q·T (N the matmul parameters, L layers, H heads of width Q, T the sequence length), times tokens
per second, over the device's *datasheet dense* peak for the precision the matmuls run in. That is how llm.c,
nanoGPT, torchtitan and llm-foundry report it, so a figure here compares with theirs. A matmul measured at
start-up is a second, labelled figure (`mfu_measured` in metrics.jsonl), never the MFU: it is lower than the
datasheet (an H100's 8192³ bf16 matmul runs at ~800 of its 989 TFLOP/s), so it flatters.

The table holds dense (not 2:4 sparse) Tensor Core peaks from NVIDIA's datasheets, per GPU, keyed by a
substring of `torch.cuda.get_device_name()`; the first match wins, so the more specific names come first.
`fp32` is the TF32 Tensor Core peak: the trainer turns TF32 matmuls on for CUDA fp32 runs. A device not
listed has no datasheet peak: set `train.logging.peak_flops_per_rank`, or the measured matmul peak is used and
the train log says so.
"""

from __future__ import annotations

# (substring of the device name, bf16 dense FLOP/s, TF32 dense FLOP/s)
DATASHEET: tuple[tuple[str, float, float], ...] = (
    ("GH200", 989.4e12, 494.7e12),
    ("H200", 989.4e12, 494.7e12),  # H200 SXM: same Tensor Cores as H100 SXM
    ("H100 NVL", 835.5e12, 417.5e12),
    ("H100 PCIe", 756.5e12, 378.0e12),
    ("H100", 989.4e12, 494.7e12),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 989.4e12, 494.7e12),
    ("A100", 312.0e12, 156.0e12),  # SXM and PCIe alike
    ("A800", 312.0e12, 156.0e12),
    ("L40S", 362.05e12, 183.0e12),
    ("L4", 121.0e12, 60.0e12),
    ("A10G", 70.0e12, 35.0e12),
    ("A10", 125.0e12, 62.5e12),
)


def datasheet_peak(device_name: str, precision: str) -> tuple[float, str] | None:
    """(peak FLOP/s, where it comes from) for a CUDA device name and `train.engine.precision` ('bf16' or
    'fp32'), or None for a device the table does not list."""
    for key, bf16, tf32 in DATASHEET:
        if key in device_name:
            peak = bf16 if precision == "bf16" else tf32
            kind = "bf16" if precision == "bf16" else "TF32"
            return peak, f"datasheet {kind} dense peak of {device_name} ({peak / 1e12:.1f} TFLOP/s, table entry {key!r})"
    return None


def mfu_basis(flops_per_token: int, n_matmul: int, n_layer: int, n_embd: int, seq_len: int, peak: float,
              source: str) -> str:
    """The formula and the peak behind a run's MFU, as one line for its log."""
    return (f"MFU = {flops_per_token:,} FLOPs/token (6·N + 12·L·H·Q·T: N={n_matmul:,}, L={n_layer}, H·Q={n_embd}, "
            f"T={seq_len}) × tokens/s / {peak / 1e12:.1f} TFLOP/s per rank, the {source}")


def mfu_peak(cfg, device_name: str | None, measured: float | None) -> tuple[float, str]:
    """(peak FLOP/s per rank, where it comes from) for a TrainConfig `cfg`: `logging.peak_flops_per_rank`, else
    the datasheet peak of the CUDA device `device_name` for the precision, else the `measured` matmul peak."""
    if cfg.logging.peak_flops_per_rank:
        return cfg.logging.peak_flops_per_rank, "peak set in train.logging.peak_flops_per_rank"
    if device_name is not None and (found := datasheet_peak(device_name, cfg.engine.precision)):
        return found
    kind = "cuda" if device_name is not None else "cpu"
    return measured, (f"peak of a {cfg.engine.precision} matmul measured on this rank at start-up (no datasheet "
                      f"peak for {kind} devices of this name)")
