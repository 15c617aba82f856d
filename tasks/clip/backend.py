"""The CLIP loader a run's `clip_train.loader` names: worker processes (lifecycle.tasks.clip.loader) or a DALI
pipeline (lifecycle.tasks.clip.dali, imported only when named: DALI is an optional dependency)."""

from __future__ import annotations

from typing import Any

from lifecycle.tasks.clip.config import ClipTrainConfig
from lifecycle.tasks.clip.loader import Loader, Pairs


def open_loader(pairs: Pairs, train_rows: list[int], cfg: ClipTrainConfig, rank: int, ranks: int, steps: int,
                device_id: int | None = None) -> Loader | Any:
    """The backend `cfg.loader` names: worker processes (`workers`) or a DALI pipeline (`dali`, on the GPU
    `device_id` when there is one)."""
    if cfg.loader == "dali":
        from lifecycle.tasks.clip.dali import DaliLoader

        return DaliLoader(pairs, train_rows, cfg, rank, ranks, steps, device_id)
    return Loader(pairs, train_rows, cfg, rank, ranks, steps)
