"""Fault injection for tests and benchmarks only: `LIFECYCLE_FAULT_NAN_DATA_STEPS="17,40"` makes the loss of those
data steps NaN, so that a run's rollback path can be exercised on real ranks. Unset, it does nothing."""

from __future__ import annotations

import os

ENV = "LIFECYCLE_FAULT_NAN_DATA_STEPS"


class Faults:
    def __init__(self, nan_data_steps: set[int]):
        self.nan_data_steps = nan_data_steps

    @classmethod
    def from_env(cls) -> "Faults":
        return cls({int(x) for x in os.environ.get(ENV, "").split(",") if x.strip()})

    def poisons(self, data_step: int) -> bool:
        """Whether this data step's loss is to be made NaN."""
        return data_step in self.nan_data_steps
