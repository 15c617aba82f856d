"""A pipeline checkpoint (tp inside its stages or not) as a dense one: `to_dense` writes the ZeRO-0 DeepSpeed
state a single rank resumes from (weights, Adam moments merged over stages and tp slices, step, LR schedule,
sampler position), `dense_reason` says when it cannot. The layout-change mechanism (lifecycle.tasks.train.layout)
plugs it in as the `pipeline-to-dense` converter; the file names are DeepSpeed's pipeline engine's
(lifecycle.tasks.train.parallel.pp)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.model import GPT
from lifecycle.tasks.train.parallel.pp import layer_prefix, stage_param_names


def dense_reason(src: dict, dst: dict) -> str | None:
    """Why `to_dense` cannot convert a checkpoint of layout `src` into one for `dst` (None: it can). Layouts
    are `lifecycle.tasks.train.layout.layout_of` dicts ({dp, zero, micro, accum, pp?, tp?, ...})."""
    if src.get("pp", 1) == 1:
        return "the source is not a pipeline checkpoint (pp=1)"
    if any(layout.get(axis, 1) != 1 for layout in (src, dst) for axis in ("sp", "ep")) or \
            any(dst.get(axis, 1) != 1 for axis in ("pp", "tp")):
        return "converts pipeline (pp > 1, tp ≥ 1, sp = ep = 1) checkpoints to a dense layout (pp = tp = 1) only"
    if src["zero"] not in (0, 1):
        return f"a pipeline checkpoint has ZeRO-0 or ZeRO-1 state, not ZeRO-{src['zero']}"
    if dst["zero"] != 0:
        return ("writes the dense ZeRO-0 engine state (a torch AdamW state dict); a ZeRO-1/2/3 destination needs "
                "ZeRO partitions (convert to ZeRO-0, or through DeepSpeed's universal checkpoint)")
    if src["micro"] * src["accum"] * src["dp"] != dst["micro"] * dst["accum"] * dst["dp"]:
        return "the global batch differs between the layouts"
    return None


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _local_to_dense(cfg: ModelConfig, local: str) -> str:
    """A PipelineModule parameter name (`3.attn.qkv.weight`, `tied_modules.wte.wte.weight`) as GPT's."""
    head, _, rest = local.partition(".")
    if head == "tied_modules":
        return rest.partition(".")[2]
    return layer_prefix(cfg, int(head)) + rest


def _stage_moments_zero0(cfg: ModelConfig, state: dict, names: list[str], shapes: dict) -> dict:
    """{GPT name: (step, exp_avg, exp_avg_sq)} from a ZeRO-0 stage's torch optimizer state dict (groups:
    the trainer's decay (dim >= 2) then no-decay parameters, each in the stage's parameter order)."""
    order = [n for n in names if len(shapes[n]) >= 2] + [n for n in names if len(shapes[n]) < 2]
    opt = state["optimizer"]
    ids = [i for g in opt["param_groups"] for i in g["params"]]
    if len(ids) != len(order):
        raise ValueError(f"optimizer state lists {len(ids)} parameters, the stage has {len(order)}")
    out = {}
    for i, name in zip(ids, order):
        s = opt["state"].get(i)
        if s is not None:
            out[name] = (float(s["step"]), s["exp_avg"].float(), s["exp_avg_sq"].float())
    return out


def _stage_moments_zero1(cfg: ModelConfig, tag: Path, stage: int, dp: int, param_shapes: list) -> tuple[dict, dict]:
    """({GPT name: (step, exp_avg, exp_avg_sq)}, {GPT name: fp32 master weight}) from a ZeRO-1 stage's optimizer
    partitions (`zero_pp_rank_<d>_mp_rank_<stage>_optim_states.pt`, d over the data-parallel ranks): each group
    is one flat buffer split across the dp ranks in order, padding at the end; `param_shapes` (DeepSpeed's, from
    the model-states file) names its parameters in flat order."""
    parts = [_load(tag / f"zero_pp_rank_{d}_mp_rank_{stage:02d}_optim_states.pt")["optimizer_state_dict"]
             for d in range(dp)]
    moments, weights = {}, {}
    for g, shapes in enumerate(param_shapes):
        fp32 = torch.cat([p["single_partition_of_fp32_groups"][g].float() for p in parts])
        flat = {}
        for key in ("exp_avg", "exp_avg_sq"):
            pieces = []
            for p in parts:
                base = p["base_optimizer_state"]
                st = base[g] if isinstance(base, list) else base["state"][g]
                pieces.append(st[key].float())
            flat[key] = torch.cat(pieces)
        base0 = parts[0]["base_optimizer_state"]
        st0 = base0[g] if isinstance(base0, list) else base0["state"][g]
        step = float(st0["step"]) if "step" in st0 else float(parts[0]["base_optimizer_state_step"])
        offset = 0
        for local, shape in shapes.items():
            n = math.prod(shape)
            name = _local_to_dense(cfg, local)
            weights[name] = fp32[offset:offset + n].view(tuple(shape)).clone()
            moments[name] = (step, *(flat[k][offset:offset + n].view(tuple(shape)).clone() for k in ("exp_avg", "exp_avg_sq")))
            offset += n
    return moments, weights


def _merged_state(cfg: ModelConfig, src_tag: Path, src: dict, stages: list[dict], shapes: dict) -> tuple[dict, dict]:
    """({GPT name: (step, exp_avg, exp_avg_sq)}, {GPT name: fp32 master weight}; empty under ZeRO-0, whose module
    weights are the consolidated file's) of every stage, its tp slices merged. The files of stage s, tp rank t
    are DeepSpeed's model-parallel rank s·tp + t (its pp × tp group, pipe-major)."""
    from lifecycle.tasks.train.parallel.tp import merge_tensors, split_spec

    pp, tp, dp = src["pp"], src.get("tp", 1), src["dp"]
    moments, weights = {}, {}
    for s in reversed(range(pp)):  # the first stage's copy of a tied table wins
        parts = []
        for t in range(tp):
            m = s * tp + t
            if src["zero"] == 0:
                parts.append((_stage_moments_zero0(cfg, stages[m], stage_param_names(cfg, pp, s), shapes), {}))
            else:
                parts.append(_stage_moments_zero1(cfg, src_tag, m, dp, stages[m]["param_shapes"]))
        for name in parts[0][0]:
            spec = split_spec(cfg, name) if tp > 1 else None
            step = parts[0][0][name][0]
            moments[name] = (step, *(merge_tensors([p[0][name][i] for p in parts], spec) if spec
                                     else parts[0][0][name][i] for i in (1, 2)))
        for name in parts[0][1]:
            spec = split_spec(cfg, name) if tp > 1 else None
            weights[name] = merge_tensors([p[1][name] for p in parts], spec) if spec else parts[0][1][name]
    return moments, weights


def _dense_adamw_state(train, shapes: dict, moments: dict, sched: dict) -> dict:
    """The dense trainer's torch AdamW state dict: groups [decay (dim >= 2), no decay], each in GPT's parameter
    order, with the schedule's current learning rates and every parameter's (step, exp_avg, exp_avg_sq)."""
    opt = train.optimizer
    order = [n for n in shapes if len(shapes[n]) >= 2] + [n for n in shapes if len(shapes[n]) < 2]
    n_decay = sum(len(shapes[n]) >= 2 for n in shapes)
    dummy = [torch.nn.Parameter(torch.zeros(1)) for _ in order]
    groups = torch.optim.AdamW([{"params": dummy[:n_decay], "weight_decay": opt.weight_decay},
                                {"params": dummy[n_decay:], "weight_decay": 0.0}],
                               lr=opt.lr, betas=opt.betas).state_dict()["param_groups"]
    for g, lr in zip(groups, sched["_last_lr"]):
        g.update(lr=lr, initial_lr=opt.lr)
    optimizer: dict = {"param_groups": groups, "state": {}}
    for i, name in enumerate(order):
        if name in moments:
            step, m, v = moments[name]
            optimizer["state"][i] = {"step": torch.tensor(step), "exp_avg": m.contiguous(), "exp_avg_sq": v.contiguous()}
    return optimizer


def to_dense(src_tag: Path, dst_tag: Path, src: dict, dst: dict) -> dict:
    """Convert the committed pipeline checkpoint `src_tag` (layout `src`) into a dense ZeRO-0 DeepSpeed checkpoint
    in the empty directory `dst_tag` (layout `dst`, pp = 1): `mp_rank_00_model_states.pt` with GPT's state dict,
    the torch AdamW state (fp32 Adam moments and step count of every parameter, from the stage that owns it: the
    token table from the first stage, whose tied copy on the last stage holds the same values), the LR schedule,
    the engine counters and the client_state (sampler state rewritten for the destination's ranks, micro-batch
    and grad_accum; RNG states of ranks the destination has). `model.safetensors` and `model_config.json` are
    copied. Returns the marker fields: {"format": "deepspeed"} (loaded by `engine.load_checkpoint`).

    The `Converter` signature of lifecycle.tasks.train.layout: plugs in there as
    `Converter("pipeline-to-dense", pp_convert.dense_reason, pp_convert.to_dense)`."""
    import shutil

    from lifecycle.tasks.train import commit as ckpt
    from lifecycle.tasks.train.config import TrainConfig

    if (why := dense_reason(src, dst)) is not None:
        raise ValueError(f"{src_tag}: {why}")
    src_tag, dst_tag = Path(src_tag), Path(dst_tag)
    cfg = ModelConfig.model_validate_json((src_tag / ckpt.MODEL_CONFIG).read_text())
    if cfg.moe is not None:  # DeepSpeed saves a stage with MoE layers as one module file plus a file per expert
        raise ValueError(f"{src_tag}: a pipeline run with experts (DeepSpeed's MoE checkpoint layout, no "
                         "per-layer files) is not converted; resume it under the same pp, tp and ep")
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in GPT(cfg).named_parameters()}
    stages = [_load(src_tag / f"mp_rank_{m:02d}_model_states.pt") for m in range(src["pp"] * src.get("tp", 1))]
    train = TrainConfig.model_validate(stages[0]["config"])
    if train.engine.precision != "fp32":
        raise ValueError(f"{src_tag}: {train.engine.precision} run; this converter writes the fp32 ZeRO-0 engine "
                         "state (a bf16 ZeRO-0 engine keeps its fp32 masters in DeepSpeed's BF16_Optimizer format)")
    moments, weights = _merged_state(cfg, src_tag, src, stages, shapes)
    if src["zero"] == 0:  # fp32 module weights: the consolidated file holds them
        from safetensors.torch import load_file

        weights = load_file(str(src_tag / ckpt.WEIGHTS))
    if set(weights) != set(shapes):
        raise ValueError(f"{src_tag}: weights for {sorted(set(weights) ^ set(shapes))} missing or unexpected")

    optimizer = _dense_adamw_state(train, shapes, moments, stages[0]["lr_scheduler"])
    module = {name: weights[name].float().contiguous() for name in shapes}
    if cfg.tie_embeddings:
        module["lm_head.weight"] = module["wte.weight"]

    state = dict(stages[0])
    world = dst["dp"]
    state.update(module=module, optimizer=optimizer, param_shapes=None, shared_params=None, frozen_param_shapes=None,
                 frozen_param_fragments=None, dp_world_size=world, mp_world_size=1)
    state["sampler"] = {**state["sampler"], "world_size": world, "micro_batch_size": dst["micro"],
                        "grad_accum": dst["accum"]}
    state["rng"] = [state["rng"][r % len(state["rng"])] for r in range(world)]
    with ckpt.hashed_atomic_file(dst_tag / "mp_rank_00_model_states.pt") as w:
        torch.save(state, w)
    for name in (ckpt.WEIGHTS, ckpt.MODEL_CONFIG):
        shutil.copy2(src_tag / name, dst_tag / name)
    return {"format": "deepspeed"}
