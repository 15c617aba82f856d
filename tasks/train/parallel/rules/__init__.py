"""What each parallelism composes with, checked when the config is built (torch-free): one module per strategy
(`tp`, `pp`, `sp`, `moe`), each with `check(cfg)` raising ValueError with the reason, and naming DeepSpeed's
limit where that is the reason. `TrainConfig` runs `check` after its fields validate; the planner's layout
search asks `refusal` so that it never proposes a layout the trainer refuses."""

from __future__ import annotations

from lifecycle.tasks.train.parallel.rules import moe, pp, sp, tp


def check(cfg) -> None:
    """Every rule of the strategies the config turns on (a degree above 1, or experts)."""
    par = cfg.parallel
    if cfg.batch.num_ranks % par.model_parallel:
        raise ValueError(f"train.batch.num_ranks ({cfg.batch.num_ranks}) must be a multiple of train.parallel "
                         f"tp·pp·sp ({par.tp}·{par.pp}·{par.sp} = {par.model_parallel})")
    if par.sp > 1:
        sp.check(cfg)
    if par.tp > 1:
        tp.check(cfg)
    elif par.tp_sequence_parallel:
        raise ValueError("train.parallel.tp_sequence_parallel needs train.parallel.tp > 1 (it splits the sequence "
                         "inside a tensor-parallel group)")
    if par.pp > 1:
        pp.check(cfg)
    if cfg.moe.num_experts:
        moe.check(cfg)


def refusal(cfg) -> str | None:
    """Why the trainer refuses `cfg`'s layout (None: it runs it)."""
    try:
        check(cfg)
    except ValueError as e:
        return str(e)
    return None
