"""A standby world's rank (`train.launch.spares`): built like a training rank (imports, process group, engine, and
the checkpoint arena when there is room), then idle until the supervisor promotes its world to take over a failed
one. The trainer calls `wait()` once, before its restore; training ranks have no standby."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lifecycle.core.fs import atomic_write_json
from lifecycle.tasks.train.heartbeats import STANDBY_ENV, WORLD_ENV, ready_path

# The first save's arena is made before training only when it takes at most this share of the host's available
# memory (else the first save makes it, as it would without a prewarm): a large relaunch was OOM-killed with its
# restored tier, its engine and a prewarmed arena (docs/benchmarks.md, hot spares). A standby world asks for less:
# the training world's engine, arenas and tier are beside it.
ARENA_SHARE, STANDBY_ARENA_SHARE = 0.5, 0.25


def world_name() -> str:
    """'' for a launch's first world, 'spare<k>' for a standby world."""
    return os.environ.get(WORLD_ENV, "")


class Standby:
    """This rank's go file, set by the supervisor in a standby world's environment."""

    def __init__(self, go: Path, run_dir: Path, rank: int, world: str, say):
        self.go, self.run_dir, self.rank, self.world, self.say = go, run_dir, rank, world, say

    @classmethod
    def of_env(cls, run_dir: Path, rank: int, say) -> "Standby | None":
        go = os.environ.get(STANDBY_ENV)
        return cls(Path(go), run_dir, rank, world_name(), say) if go else None

    def wait(self, checkpointer, sizing: Path, t_start: float, poll_s: float = 0.005) -> None:
        """Make the first save's arena unless it would crowd the training world's host (then the first save makes
        it), say that this rank is built and ready (`rank<r>.ready`), and wait for the supervisor's go file. It is
        written when the training world fails; the ranks then restore its newest commit and train on. Polled (a
        stat every 5 ms costs nothing next to a step); the liveness beat goes on meanwhile, so the supervisor
        still sees a stopped or dead standby rank."""
        if prewarmed := checkpointer.prewarm(sizing, memory_share=STANDBY_ARENA_SHARE):
            self.say(prewarmed)
        self.say(f"ready after {time.time() - t_start:.1f}s; waiting to take over ({self.go})")
        atomic_write_json(ready_path(self.run_dir, self.rank, self.world), {"time": time.time(), "pid": os.getpid()})
        while not self.go.exists():
            time.sleep(poll_s)


def prewarm_first_save(checkpointer, world: str, will_train: bool, sizing: Path) -> str | None:
    """Make the first save's arena before training (returns the line saying so), unless it is made already, the
    run is done (`will_train` False), or this is a promoted standby world, which resumes training first:
    faulting a 350M arena in there is seconds of page faults before the takeover's first step."""
    if checkpointer.prewarmed:
        return None
    if world:
        return "checkpoint arena left to the first save: a promoted standby resumes training first"
    return checkpointer.prewarm(sizing, memory_share=ARENA_SHARE) if will_train else None
