"""One training step under torch.profiler, for benchmarks only: `LIFECYCLE_PROFILE_STEP=25` makes rank 0 write
`<run_dir>/profile-step25.json` (its top kernels, the step's wall time and the share of it no kernel ran in).
On CUDA only; unset, nothing is profiled."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from lifecycle.core.fs import atomic_write_json

ENV = "LIFECYCLE_PROFILE_STEP"


def profile_step() -> int | None:
    """The step to profile, from the environment (None: none)."""
    raw = os.environ.get(ENV, "")
    return int(raw) if raw.strip() else None


def kernel_summary(prof, wall_s: float, top: int = 15) -> dict:
    """Top device kernels of a profiled step by total time, and the share of the step no kernel ran in."""
    events = [e for e in prof.key_averages() if getattr(e, "device_type", None) is not None
              and str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
    total_us = sum(e.self_device_time_total for e in events)
    rows = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    return {"wall_s": wall_s, "kernel_s": total_us / 1e6, "outside_kernels_frac": max(0.0, 1 - total_us / 1e6 / wall_s),
            "top": [{"name": e.key[:120], "calls": e.count, "ms": e.self_device_time_total / 1e3,
                     "share": e.self_device_time_total / max(total_us, 1)} for e in rows]}


def profiled(step_fn, out: Path | None) -> None:
    """Run `step_fn()` under torch.profiler between two device synchronisations; write the summary to `out`
    (None: not this rank's to write)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step_fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if out is not None:
        try:
            summary = kernel_summary(prof, wall)
        except Exception as e:  # noqa: BLE001 - a benchmark's extra: never the run's failure
            summary = {"wall_s": wall, "error": f"{type(e).__name__}: {e}"}
        atomic_write_json(out, summary)
