"""One checkpointer interface for the train loop, with a synchronous and an asynchronous implementation.

torchtitan's `CheckpointManager` makes sync and async saving a mode, not a second code path; here the
`Trainer` holds one `Checkpointer` (chosen by `train.checkpoint.async_save`) and calls the same four methods
whatever it is:

- `save(step, client_state, model_config, marker, wait)`: write checkpoint `step` and commit it (marker last).
  `SyncCheckpointer` returns once it is committed; `AsyncCheckpointer` once it is snapshotted to host memory
  (`wait=True`, the final save: once it is committed).
- `poll()`: after every step; commits a background save whose files are durable on every rank.
- `restore(max_step)`: the in-flight save is committed first, then every rank loads the newest committed
  checkpoint (at most `max_step`) whose hashes verify; returns (tag directory, client_state) or None.
  `AsyncCheckpointer` with the memory tier (`lifecycle.tasks.train.memtier`) loads it from host memory when
  the tier holds that commit and its checksums match. `last_restore` says which tier was read, in how
  long, and why not the memory tier.
- `close()`: commits what is in flight and releases the background writer.

Every method is collective: every rank calls it at the same steps. Both write the same files (DeepSpeed's
state files, `model.safetensors`, `model_config.json`) and the same `COMMITTED.json` marker through the
protocol of `lifecycle.tasks.train.commit`; a checkpoint written by one is restored by the other.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train.config import CheckpointConfig


class Checkpointer:
    """Save, poll, restore and close over one DeepSpeed engine; subclasses decide when the files are written."""

    def __init__(self, engine, root: str | Path, keep_last: int, log: Callable[[str], None] = print):
        self.engine, self.root, self.keep_last, self.log = engine, Path(root), keep_last, log
        self.prewarmed = False  # whether `prewarm` made the first save's memory
        self.last_restore: dict = {}
        """{"tier": "memory" | "disk" | "memory+disk", "seconds": restore time, "reason": why not (all) from
        memory; "memory+disk": a file whose tensors failed their checksums in memory was read from disk}"""

    def save(self, step: int, client_state: dict, model_config: Any, marker: dict, wait: bool = False) -> None:
        raise NotImplementedError

    def poll(self) -> None:
        """Nothing runs in the background here."""

    def wait(self) -> None:
        """Block until no save is in flight (every save is committed by the time `save` returns here)."""

    def restore(self, max_step: int | None = None) -> tuple[Path, dict] | None:
        """(tag directory, client_state) of the newest committed checkpoint (at most `max_step`) whose files
        verify, loaded into the engine on every rank (rank 0 picks it); None when there is none."""
        self.wait()
        return self._from_disk(max_step, time.perf_counter(), "memory tier off")

    def _from_disk(self, max_step: int | None, t0: float, reason: str) -> tuple[Path, dict] | None:
        damaged: list[str] = []  # newer commits passed over (rank 0 checks): the restore record names them
        found = [ckpt.latest_valid(self.root, max_step=max_step, damaged=damaged) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return None
        tag_dir = Path(found[0])
        if ckpt.read_marker(tag_dir).get("format") == "universal":  # converted from another layout
            client_state = load_universal(self.engine, self.root, tag_dir.name)
        else:
            _, client_state = self.engine.load_checkpoint(str(self.root), tag=tag_dir.name)
        self.last_restore = {"tier": "disk", "seconds": time.perf_counter() - t0, "reason": reason,
                             **({"damaged": damaged} if damaged else {})}
        return tag_dir, client_state

    def prewarm(self, scratch: Path | None = None, memory_share: float | None = None) -> str | None:
        """Collective, before training: get the first save's memory ready (`prewarmed` says whether it was); a
        line for the log, or None. `scratch`: a directory it may use and remove (one per world of ranks).
        `memory_share`: only if that takes at most this share of the host's available memory."""
        return None

    def close(self) -> None:
        self.wait()


def load_universal(engine, root: Path, tag: str) -> dict:
    """Load a DeepSpeed universal checkpoint (lifecycle.tasks.train.layout converted it from another layout) into
    `engine`; returns its client_state. DeepSpeed reads `load_universal_checkpoint` from the engine's config at
    load time, so it is switched on for this load only. Its ZeRO-3 loader copies the hyperparameters of the
    first parameter group into every group (deepspeed/runtime/zero/stage3.py,
    `load_hp_checkpoint_state_from_checkpoint_dir_stage3`): the no-decay group (norms, biases) would get the
    decay group's weight decay. They come from the config, not the checkpoint, so every group gets its own back;
    the learning rate is the checkpoint's (the same in every group: one schedule)."""
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in engine.optimizer.param_groups]
    engine._config.load_universal_checkpoint = True
    try:
        _, client_state = engine.load_checkpoint(str(root), tag=tag)
    finally:
        engine._config.load_universal_checkpoint = False
    for group, hyper in zip(engine.optimizer.param_groups, groups):
        group.update(hyper)
    # The ZeRO-3 loader gives every parameter group's state one shared `step` tensor, which torch's Adam
    # increments in place once per group: the second group's bias correction would run a step ahead.
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
    return client_state


class SyncCheckpointer(Checkpointer):
    """`commit.save`: every rank writes its files, then rank 0 commits and prunes, before `save` returns."""

    def save(self, step: int, client_state: dict, model_config: Any, marker: dict, wait: bool = False) -> None:
        tag_dir = ckpt.save(self.engine, self.root, step, client_state, model_config, marker)
        if dist.get_rank() == 0:
            for gone in ckpt.prune(self.root, self.keep_last, keep=(tag_dir,)):
                self.log(f"pruned {gone}")
            self.log(f"committed {tag_dir}")


class AsyncCheckpointer(Checkpointer):
    """`async_saver.AsyncSaver`: `save` snapshots to host memory; a persist process per rank writes the files
    while training goes on, and `poll` commits once every rank's files are durable. One save in flight."""

    def __init__(self, engine, root: str | Path, keep_last: int, log: Callable[[str], None] = print,
                 tier: Path | None = None):
        from lifecycle.tasks.train.async_saver import AsyncSaver  # starts nothing until built; needs deepspeed

        super().__init__(engine, root, keep_last, log)
        self.base_engine = engine.checkpoint_engine  # AsyncSaver installs its snapshot engine in its place
        self.saver = AsyncSaver(engine, self.root, keep_last, log=log, tier=tier)

    def restore(self, max_step: int | None = None) -> tuple[Path, dict] | None:
        self.wait()
        t0 = time.perf_counter()
        got, why = self.saver.restore_from_tier(max_step)
        if got is None:
            return self._from_disk(max_step, t0, why)
        self.last_restore = {"tier": "memory" if why is None else "memory+disk", "seconds": time.perf_counter() - t0,
                             "reason": why}
        return got

    def save(self, step: int, client_state: dict, model_config: Any, marker: dict, wait: bool = False) -> None:
        self.saver.start(step, client_state, model_config, marker)
        if wait:
            self.saver.finish()

    def poll(self) -> None:
        self.saver.poll()

    def prewarm(self, scratch: Path | None = None, memory_share: float | None = None) -> str | None:
        nbytes, seconds, self.prewarmed = self.saver.prewarm(scratch, memory_share)
        if not self.prewarmed:
            return (f"checkpoint arena of {nbytes / 2**20:,.1f} MiB not made before training: it would take more "
                    f"than {memory_share:.0%} of this host's available memory on some rank (the first save makes it)")
        return f"checkpoint arena of {nbytes / 2**20:,.1f} MiB made and faulted in before training ({seconds:.3f}s)"

    def wait(self) -> None:
        self.saver.finish()

    def close(self) -> None:
        self.saver.finish()
        self.saver.close()
        self.engine.checkpoint_engine = self.base_engine


def make_checkpointer(cfg: CheckpointConfig, engine, root: str | Path,
                      log: Callable[[str], None] = print, tier: str | Path | None = None) -> Checkpointer:
    """The implementation `cfg.async_save` asks for; `tier`: the run's memory tier directory (async only)."""
    if not cfg.async_save:
        return SyncCheckpointer(engine, root, cfg.keep_last, log)
    return AsyncCheckpointer(engine, root, cfg.keep_last, log, tier=Path(tier) if tier else None)


class SaveSchedule:
    """Which steps commit a checkpoint: every `checkpoint.every` steps, or under `every: auto` an interval
    chosen so that saving costs at most `auto_overhead` of training time (CheckFreq).

    Auto: the first save of a launch comes `PROBE` steps in; each save's stall (the time it held the
    training thread, which includes waiting for the previous save's persist) and the median step time so
    far give interval = ceil(median stall / (auto_overhead x median step)); the numbers are the slowest
    rank's (`observe` takes them all-reduced), so every rank picks the same steps. The interval never
    changes what is trained, only which steps are committed; max_steps always commits (the caller's rule)."""

    PROBE = 5

    def __init__(self, cfg: CheckpointConfig, first_step: int):
        self.every, self.share = cfg.every, cfg.auto_overhead
        self.next = first_step + self.PROBE
        self.step_times: list[float] = []
        self.stalls: list[float] = []
        self.interval: int | None = None if self.every == "auto" else int(self.every)

    @property
    def auto(self) -> bool:
        return self.every == "auto"

    def due(self, step: int) -> bool:
        return step >= self.next if self.auto else step % int(self.every) == 0

    def step_time(self, seconds: float) -> None:
        """A training step's time (the first of a launch is left out by the caller: it warms up)."""
        self.step_times.append(seconds)

    def median_step(self) -> float:
        return statistics.median(self.step_times) if self.step_times else 0.0

    def choose(self, step: int, stall: float, device) -> dict:
        """`every: auto`, after the save at `step` (collective): the next interval from the slowest rank's stall
        and median step time, as a metrics record."""
        worst = torch.tensor([stall, self.median_step()], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank then picks the same next save
        stall, step_time = worst.tolist()
        return {"kind": "checkpoint_interval", "step": step, "interval": self.observe(step, stall, step_time),
                "stall": stall, "step_time": step_time, "overhead": self.share}

    def observe(self, step: int, stall: float, step_time: float) -> int:
        """After the save at `step`: its stall and the median step time (both the max over ranks); returns
        the interval to the next save."""
        self.stalls.append(stall)
        median_stall = statistics.median(self.stalls)
        self.interval = max(1, math.ceil(median_stall / (self.share * step_time))) if step_time > 0 else 1
        self.next = step + self.interval
        return self.interval
