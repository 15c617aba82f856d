"""Whether a committed checkpoint can resume this run: the same sampler (seed, sequence length, skipped data
steps), the same token dataset and the same global batch. A different layout (world size, micro-batch, grad_accum,
tp/pp/sp) with the same global batch is a layout change, not a mismatch: `get_batch` is keyed on (seed, step,
sequence index in the global batch), so the same global batch draws the same sequences under any layout.

`fallback_note` says, for the supervisor's console, why the ranks resumed from an older commit than the newest one
(a DeepSpeed `.pt` file that fails its hash is found only in the ranks, whose log is train.log)."""

from __future__ import annotations

from pathlib import Path

from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.layout import describe, layout_of
from lifecycle.tasks.train.sampler import LAYOUT_SAMPLER_FIELDS, sampler_state


def check_resume(state: dict, marker: dict, tag_dir: Path, cfg: TrainConfig, world: int,
                 dataset_sha256: str) -> dict | None:
    """Raise naming the checkpoint when its `client_state` (`state`) cannot resume `cfg` on `world` ranks over
    `dataset_sha256`; return a `layout_change` record when it was written under another layout, else None."""
    skipped = state["sampler"].get("skipped", [])
    expected = sampler_state(cfg, state["step"], world, skipped)
    saved_cfg = TrainConfig.model_validate(state["config"])
    changed = (saved := marker.get("layout", layout_of(saved_cfg))) != layout_of(cfg)
    if changed:  # the sampler's layout fields are the saved layout's; the sequences of a step are not
        expected.update({k: state["sampler"].get(k) for k in LAYOUT_SAMPLER_FIELDS})
    if state["sampler"] != expected or state["dataset_sha256"] != dataset_sha256:
        raise RuntimeError(f"checkpoint {tag_dir} was written for another sampler/dataset: {state['sampler']}")
    if saved_cfg.global_batch != cfg.global_batch:
        raise RuntimeError(f"checkpoint {tag_dir} was written with a global batch of {saved_cfg.global_batch} "
                           f"sequences ({describe(saved)}); this run's is {cfg.global_batch} "
                           f"({describe(layout_of(cfg))})")
    if not changed:
        return None
    return {"kind": "layout_change", "step": state["step"], "from": describe(saved), "to": describe(layout_of(cfg)),
            "checkpoint": str(tag_dir), "converter": marker.get("converter", "native")}


def fallback_note(damaged: list[str], newest_step: int | None, restored_step: int | None) -> str | None:
    """One line when the ranks passed over damaged commits (`damaged`, as the restore record lists them) and
    restored `restored_step` (None: nothing, from step 0) instead of `newest_step`: what is damaged and how many
    steps are trained again."""
    if not damaged or newest_step is None or (restored_step or 0) >= newest_step:
        return None
    start = f"step {restored_step}" if restored_step else "step 0 (no valid commit left)"
    return (f"damaged checkpoint {'; '.join(damaged)}: training resumed from {start} instead of step {newest_step} "
            f"and trains {newest_step - (restored_step or 0)} steps again")
