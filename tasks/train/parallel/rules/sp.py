"""Ulysses sequence parallelism's rules (lifecycle.tasks.train.parallel.sp)."""

from __future__ import annotations


def check(cfg) -> None:
    """What Ulysses sequence parallelism (lifecycle.tasks.train.parallel.sp) needs, refused with the reason.
    ZeRO 0-2 compose with it: DeepSpeed 0.19 reduces gradients and partitions optimizer state over dp × sp."""
    par, m = cfg.parallel, cfg.model
    if cfg.engine.zero_stage == 3:
        raise ValueError(f"train.parallel.sp={par.sp} with train.engine.zero_stage=3: under DeepSpeed 0.19 the sp=2 "
                         "loss curve leaves the single-rank one (1 % in 20 steps; ZeRO 0-2 stay within 2e-7), "
                         "so ZeRO-3 is refused with sequence parallelism; use ZeRO 0-2")
    heads = par.tp * par.sp  # tp splits the heads first, then the all-to-all splits each rank's heads by sp
    if m.n_head % heads:
        raise ValueError(f"train.parallel.sp={par.sp}: model.n_head ({m.n_head}) must be divisible by tp·sp "
                         f"({par.tp}·{par.sp}): the all-to-all hands each sp rank n_head/(tp·sp) whole heads")
    if m.kv_heads % heads:
        raise ValueError(f"train.parallel.sp={par.sp}: model.n_kv_head ({m.kv_heads}) must be divisible by tp·sp "
                         f"({par.tp}·{par.sp}): each sp rank takes the key/value heads of its query heads (the "
                         "uneven-head split of DeepSpeed's layer is not used)")
    if m.seq_len % par.sp:
        raise ValueError(f"model.seq_len ({m.seq_len}) must be divisible by train.parallel.sp ({par.sp}): each sp "
                         "rank holds an equal contiguous slice of every sequence")
    if par.pp > 1:
        raise ValueError(f"train.parallel.sp={par.sp} with pp={par.pp}: DeepSpeed 0.19's pipeline engine averages "
                         "gradients over the data-parallel group only (engine._reduce_non_expert_gradients), "
                         "not over the sequence-parallel ranks that hold the other slices")
    if cfg.moe.num_experts:
        raise ValueError(f"train.parallel.sp={par.sp} with moe.num_experts={cfg.moe.num_experts}: DeepSpeed 0.19 "
                         "builds the expert-data-parallel groups from the data-parallel group, without the sequence-"
                         "parallel ranks (utils.groups._create_expert_data_and_model_parallel), so expert "
                         "gradients of the other slices would be left out")


