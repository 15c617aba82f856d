"""What every rank needs of torch.distributed and its device: the device and backend, a measured matmul peak,
RNG states (DeepSpeed saves none), means over ranks, and a scalar read without stalling the device."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from lifecycle.tasks.train.config import TrainConfig


def select_device(cfg: TrainConfig) -> tuple[torch.device, str]:
    """(device, process-group backend) for `train.engine.accelerator`: the CPU with gloo, or this rank's GPU
    (LOCAL_RANK, set by the launcher) with NCCL."""
    if cfg.engine.accelerator == "cpu":
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        raise RuntimeError("train.engine.accelerator=cuda, but torch sees no CUDA device on this host "
                           f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use accelerator: cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    # fp32 matmuls and convolutions on the Tensor Cores (TF32), as nanoGPT and torchtitan train; the MFU of an
    # fp32 run is then counted against the TF32 peak (lifecycle.tasks.train.hardware)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return device, "nccl"


def measure_peak_flops(device: torch.device, seconds: float = 0.3, n: int = 512,
                       dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n×n matmul in `dtype` on `device` (on the CPU, this process's threads): the MFU
    denominator when none is configured."""
    if device.type == "cuda":
        n = max(n, 4096)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up
    sync()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def rng_state(device: torch.device) -> dict:
    """This process's Python, NumPy and torch RNG states (and `device`'s, on a GPU): DeepSpeed saves none."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_rng(world: int, device: torch.device) -> list[dict]:
    """Every rank's `rng_state`, in rank order (collective)."""
    states: list = [None] * world
    dist.all_gather_object(states, rng_state(device))
    return states


def mean_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


class DeviceValue:
    """A scalar the device is still computing, read without stalling the device: on a GPU the value is copied
    to page-locked host memory behind the work that produces it, and `get()` waits for that copy only, not
    for the kernels queued after it (a plain `.item()` waits for everything queued on the stream). So the
    training thread can queue step s+1 before it looks at step s's loss."""

    def __init__(self, t: torch.Tensor):
        self.t, self.event = t, None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def get(self) -> float:
        if self.event is None:
            return self.t.item()
        self.event.synchronize()
        return self.host.item()


def mean_over_ranks_async(t: torch.Tensor) -> DeviceValue:
    """The mean of a float64 scalar tensor over every rank, queued (no host synchronisation)."""
    t = t.reshape(1)
    dist.all_reduce(t)
    return DeviceValue(t / dist.get_world_size())
