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
- `close()`: commits what is in flight and releases the background writer.

Every method is collective: every rank calls it at the same steps. Both write the same files (DeepSpeed's
state files, `model.safetensors`, `model_config.json`) and the same `COMMITTED.json` marker through the
protocol of `lifecycle.tasks.train.checkpoint`; a checkpoint written by one is restored by the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from lifecycle.tasks.train import checkpoint as ckpt
from lifecycle.tasks.train.config import CheckpointConfig


class Checkpointer:
    """Save, poll, restore and close over one DeepSpeed engine; subclasses decide when the files are written."""

    def __init__(self, engine, root: str | Path, keep_last: int, log: Callable[[str], None] = print):
        self.engine, self.root, self.keep_last, self.log = engine, Path(root), keep_last, log

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
        found = [ckpt.latest_valid(self.root, max_step=max_step) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return None
        tag_dir = Path(found[0])
        _, client_state = self.engine.load_checkpoint(str(self.root), tag=tag_dir.name)
        return tag_dir, client_state

    def close(self) -> None:
        self.wait()


class SyncCheckpointer(Checkpointer):
    """`checkpoint.save`: every rank writes its files, then rank 0 commits and prunes, before `save` returns."""

    def save(self, step: int, client_state: dict, model_config: Any, marker: dict, wait: bool = False) -> None:
        tag_dir = ckpt.save(self.engine, self.root, step, client_state, model_config, marker)
        if dist.get_rank() == 0:
            for gone in ckpt.prune(self.root, self.keep_last, keep=(tag_dir,)):
                self.log(f"pruned {gone}")
            self.log(f"committed {tag_dir}")


class AsyncCheckpointer(Checkpointer):
    """`async_ckpt.AsyncSaver`: `save` snapshots to host memory; a persist process per rank writes the files
    while training goes on, and `poll` commits once every rank's files are durable. One save in flight."""

    def __init__(self, engine, root: str | Path, keep_last: int, log: Callable[[str], None] = print):
        from lifecycle.tasks.train.async_ckpt import AsyncSaver  # starts nothing until built; needs deepspeed

        super().__init__(engine, root, keep_last, log)
        self.base_engine = engine.checkpoint_engine  # AsyncSaver installs its snapshot engine in its place
        self.saver = AsyncSaver(engine, self.root, keep_last, log=log)

    def save(self, step: int, client_state: dict, model_config: Any, marker: dict, wait: bool = False) -> None:
        self.saver.start(step, client_state, model_config, marker)
        if wait:
            self.saver.finish()

    def poll(self) -> None:
        self.saver.poll()

    def wait(self) -> None:
        self.saver.finish()

    def close(self) -> None:
        self.saver.finish()
        self.saver.close()
        self.engine.checkpoint_engine = self.base_engine


def make_checkpointer(cfg: CheckpointConfig, engine, root: str | Path,
                      log: Callable[[str], None] = print) -> Checkpointer:
    """The implementation `cfg.async_save` asks for."""
    kind = AsyncCheckpointer if cfg.async_save else SyncCheckpointer
    return kind(engine, root, cfg.keep_last, log)
