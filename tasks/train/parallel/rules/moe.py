"""Mixture of experts' rules (lifecycle.tasks.train.parallel.moe)."""

from __future__ import annotations


def check(cfg) -> None:
    """What mixture of experts composes with (lifecycle.tasks.train.parallel.moe); refused with the reason. Pipeline
    stages compose (ZeRO 0/1, the pipeline engine's): each stage's layers carry their balancing loss into backward
    (moe.AuxLossCarrier) and the expert groups lie inside each stage's data-parallel group."""
    moe, pre = cfg.moe, "train.moe"
    if cfg.model.moe is not None:
        raise ValueError("train.model.moe is filled from train.moe by the trainer: set train.moe instead")
    if moe.top_k > moe.num_experts:
        raise ValueError(f"{pre}.top_k ({moe.top_k}) must not exceed {pre}.num_experts ({moe.num_experts})")
    if moe.num_experts % moe.ep:
        raise ValueError(f"{pre}.num_experts ({moe.num_experts}) must be divisible by {pre}.ep ({moe.ep}): "
                         "each expert-parallel rank holds num_experts/ep experts")
    if cfg.dp % moe.ep:
        raise ValueError(f"{pre}.ep ({moe.ep}) must divide the data-parallel degree ({cfg.dp}): DeepSpeed "
                         "carves the expert-parallel groups out of the data-parallel ranks")
    if moe.every > cfg.model.n_layer:
        raise ValueError(f"{pre}.every ({moe.every}) exceeds train.model.n_layer ({cfg.model.n_layer}): "
                         "no block would get an MoE MLP")
    if cfg.parallel.tp > 1 or cfg.parallel.sp > 1:
        raise ValueError(f"{pre}.num_experts={moe.num_experts} with train.parallel tp={cfg.parallel.tp}, "
                         f"sp={cfg.parallel.sp}: DeepSpeed's expert tensor parallelism "
                         "(enable_expert_tensor_parallelism, deepspeed/moe/layer.py) splits experts over the "
                         "groups of its own mpu (deepspeed/utils/groups.py, _create_expert_data_and_model_parallel), "
                         "not over this trainer's tp layers, and the sequence-parallel ranks are left out of the "
                         "expert-data-parallel groups; not built: use experts over dp")
    if cfg.engine.zero_stage == 3:
        raise ValueError(f"{pre}.num_experts={moe.num_experts} with train.engine.zero_stage=3: DeepSpeed's "
                         "MoE layer (deepspeed.moe.layer.MoE) is not supported under ZeRO-3 (its engine "
                         "refuses it; only its AutoEP layers are); use zero_stage 0, 1 or 2")
    if cfg.engine.zero_stage == 0 and moe.ep > 1 and cfg.optimizer.grad_clip > 0:
        raise ValueError(f"{pre}.ep={moe.ep} with train.engine.zero_stage=0 and train.optimizer.grad_clip > 0: "
                         "DeepSpeed's ZeRO-0 clips by the mean over ranks of each rank's gradient norm, which "
                         "is not the global norm when the experts are split over ranks (the run drifts from "
                         "the ep=1 trajectory); use zero_stage 1 or 2 (they compute the global norm), or "
                         "grad_clip 0")
    if cfg.engine.activation_checkpointing:
        raise ValueError(f"{pre}.num_experts={moe.num_experts} with train.engine.activation_checkpointing: "
                         "the load-balancing loss leaves each block as a side output, which the block's "
                         "recompute in backward does not cover")
    if cfg.init_from.startswith("hf:"):
        raise ValueError(f"{pre}.num_experts={moe.num_experts} with train.init_from {cfg.init_from}: a dense "
                         "Hugging Face checkpoint has no experts to load (upcycling is not implemented)")

