"""A rank's launch timeline for the launch-overhead benchmark: (phase, time it ended), from the interpreter's start
to the first step, and the start and end of loading DeepSpeed's CPU shared-memory op. It records nothing unless
the benchmark asks (`LIFECYCLE_TIMELINE=1`, set by bench/launch_overhead.py); then rank r writes
`<run_dir>/launch-timing-rank<r>.json` after its first step. Training never reads it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lifecycle.core.fs import atomic_write_json

ENV = "LIFECYCLE_TIMELINE"


class Timeline:
    def __init__(self, t_start: float, enabled: bool | None = None):
        self.enabled = os.environ.get(ENV) == "1" if enabled is None else enabled
        self.phases: list[tuple[str, float]] = [("interpreter ready", t_start), ("imports", time.time())]
        self.op_load: list[float] = []

    def phase(self, name: str) -> None:
        if self.enabled:
            self.phases.append((name, time.time()))

    def time_shm_op(self, ds_comm) -> None:
        """Time DeepSpeed's CPU comm op load, which happens inside the process group's creation."""
        if not self.enabled:
            return
        build = ds_comm.build_shm_op

        def timed_build():
            self.op_load.append(time.time())
            op = build()
            self.op_load.append(time.time())
            return op

        ds_comm.build_shm_op = timed_build

    def write(self, path: Path) -> None:
        if self.enabled:
            import psutil

            atomic_write_json(path, {"process_created": psutil.Process().create_time(), "phases": self.phases,
                                     "op_load": self.op_load})
