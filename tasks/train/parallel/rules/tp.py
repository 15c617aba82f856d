"""Tensor parallelism's rules (lifecycle.tasks.train.parallel.tp)."""

from __future__ import annotations


def check(cfg) -> None:
    """What tensor parallelism (lifecycle.tasks.train.parallel.tp) does not compose with, refused here."""
    tp, m = cfg.parallel.tp, cfg.model
    for what, n in (("n_head", m.n_head), ("key/value heads (n_kv_head)", m.kv_heads),
                    ("MLP hidden width", m.mlp_hidden)):
        if n % tp:
            raise ValueError(f"train.parallel.tp={tp} must divide train.model's {what} ({n}): each rank "
                             "keeps whole heads and whole hidden units")
    if cfg.engine.zero_stage == 3:
        raise ValueError(f"train.parallel.tp={tp} with train.engine.zero_stage=3: ZeRO-3 would partition the tp "
                         "shards again over dp and gather them by its own hooks around our tp layers; that "
                         "path, its consolidated export and its tp checkpoint conversion are not built. "
                         "Use zero_stage 1 or 2 (optimizer states and gradients partitioned over dp)")
    if cfg.engine.zero_stage == 0 and cfg.parallel.pp == 1:
        raise ValueError(f"train.parallel.tp={tp} with train.engine.zero_stage=0: the tp checkpoint converter "
                         "reads ZeRO-1/2 optimizer partitions; use zero_stage 1 or 2 (or pipeline stages: tp × pp "
                         "runs ZeRO-0 and ZeRO-1)")
    if m.dropout > 0:
        raise ValueError(f"train.parallel.tp={tp} with train.model.dropout={m.dropout}: dropout on the replicated "
                         "residual stream needs the same mask on every tp rank and attention dropout a "
                         "different one (Megatron's tp RNG tracker), which is not built; set dropout 0")
    if cfg.moe.num_experts:
        raise ValueError(f"train.parallel.tp={tp} with train.moe.num_experts={cfg.moe.num_experts}: tp splits "
                         "the dense MLP only; MoE experts are not tp-sharded")
    if cfg.parallel.sp > 1:
        raise ValueError(f"train.parallel.tp={tp} with sp={cfg.parallel.sp}: Ulysses sequence parallelism inside "
                         "a tp group is not built (its all-to-all would split each rank's n_head/tp heads again, "
                         "and nothing tests it); use tp × pp × dp, or sp × dp")
    if cfg.parallel.tp_sequence_parallel:
        if cfg.parallel.pp > 1:
            raise ValueError(f"train.parallel.tp_sequence_parallel with pp={cfg.parallel.pp}: a pipeline stage would "
                             "pass sequence slices between stages, which DeepSpeed's pipeline engine partitions "
                             "itself (pipe_partitioned); not built: use tp_sequence_parallel with tp × dp")
        if m.seq_len % tp:
            raise ValueError(f"train.parallel.tp_sequence_parallel: train.model.seq_len ({m.seq_len}) must be "
                             f"divisible by tp ({tp}): each tp rank keeps an equal slice of every sequence")
