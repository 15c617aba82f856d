"""A pipeline checkpoint (tp or experts inside its stages or not) as a dense one: `to_dense` writes the ZeRO-0
DeepSpeed state a single rank resumes from (weights, Adam moments merged over stages and tp slices, step, LR schedule,
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
    if any(layout.get("sp", 1) != 1 for layout in (src, dst)) or \
            any(dst.get(axis, 1) != 1 for axis in ("pp", "tp", "ep")):
        return ("converts pipeline (pp > 1, tp ≥ 1 or ep ≥ 1, sp = 1) checkpoints to a dense layout (pp = tp = 1, "
                "experts, if any, all on every rank: ep = 1) only")
    if src.get("ep", 1) != 1 and src.get("tp", 1) != 1:
        return "experts with tp > 1 are not trained (TrainConfig refuses them), so there is no such checkpoint"
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


def local_to_dense(cfg: ModelConfig, local: str) -> str:
    """A PipelineModule parameter name (`3.attn.qkv.weight`, `tied_modules.wte.wte.weight`) as GPT's."""
    head, _, rest = local.partition(".")
    if head == "tied_modules":
        return rest.partition(".")[2]
    return layer_prefix(cfg, int(head)) + rest


def optimizer_order(names: list[str], shapes: dict) -> list[str]:
    """`names` (one rank's parameters, model order) in the order of the trainer's optimizer state: decay
    (dim >= 2) then no-decay parameters, the experts' after the others' in groups of their own (moe.param_groups)."""
    from lifecycle.tasks.train.parallel.moe_convert import expert_id

    return [n for expert in (False, True) for decay in (True, False) for n in names
            if (expert_id(n) is not None) == expert and (len(shapes[n]) >= 2) == decay]


def states_by_name(opt: dict, order: list[str]) -> dict:
    """{name: state} from a ZeRO-0 rank's torch optimizer state dict `opt` whose parameters are `order` (the
    rank's parameters in the order of its optimizer groups; AdamW's or MuonWithAuxAdam's)."""
    ids = [i for g in opt["param_groups"] for i in g["params"]]
    if len(ids) != len(order):
        raise ValueError(f"optimizer state lists {len(ids)} parameters, the stage has {len(order)}")
    return {name: dict(opt["state"][i]) for i, name in zip(ids, order) if i in opt["state"]}


def _moments_zero0(opt: dict, names: list[str], shapes: dict) -> dict:
    """{GPT name: (step, exp_avg, exp_avg_sq)} from a ZeRO-0 rank's torch optimizer state dict `opt` over the
    parameters `names` (in the rank's parameter order)."""
    return {name: (float(s["step"]), s["exp_avg"].float(), s["exp_avg_sq"].float())
            for name, s in states_by_name(opt, optimizer_order(names, shapes)).items()}


def _stage_moments_zero0(cfg: ModelConfig, src_tag: Path, src: dict, stage_state: dict, m: int, shapes: dict) -> dict:
    """The moments of model-parallel rank `m` (stage m // tp) under ZeRO-0: its model-states file's optimizer
    state, or with experts each expert-parallel rank's file (moe_convert.optim_file: the shared parameters and
    that rank's experts, ep_rank·L .. ep_rank·L + L - 1)."""
    from lifecycle.tasks.train.parallel.moe_convert import expert_id, optim_file

    names = stage_param_names(cfg, src["pp"], m // src.get("tp", 1))
    if cfg.moe is None:
        return _moments_zero0(stage_state["optimizer"], names, shapes)
    ep = src.get("ep", 1)
    local = cfg.moe.num_experts // ep
    moments: dict = {}
    for e in range(ep):
        opt = _load(src_tag / optim_file(e, m))["optimizer"]
        mine = [n for n in names if expert_id(n) is None or expert_id(n) // local == e]
        moments.update(_moments_zero0(opt, mine, shapes))
    return moments


def _stage_moments_zero1(cfg: ModelConfig, tag: Path, src: dict, m: int, param_shapes: list) -> tuple[dict, dict]:
    """({GPT name: (step, exp_avg, exp_avg_sq)}, {GPT name: fp32 master weight}) from the ZeRO-1 optimizer
    partitions of model-parallel rank `m` (`zero_pp_rank_<d>_mp_rank_<m>_optim_states.pt`, d over the dp ranks).
    Each group is one flat buffer split over its `partition_count` ranks in order, padding at the end: every dp
    rank for the shared parameters; for an expert group, the expert-data-parallel ranks d = j·k + r (j < count,
    k = dp / count the expert-parallel degree) of each expert-parallel rank r, whose buffer holds its own experts
    (local ids, global r·L + id). `param_shapes` (DeepSpeed's, from the model-states file) names a buffer's
    parameters in flat order."""
    dp = src["dp"]
    parts = [_load(tag / f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt")["optimizer_state_dict"]
             for d in range(dp)]
    moments, weights = {}, {}
    for g, shapes in enumerate(param_shapes):
        count = parts[0]["partition_count"][g]
        k = dp // count
        if k not in (1, src.get("ep", 1)) or k * count != dp:
            raise ValueError(f"{tag}: group {g} of stage file {m} is split over {count} of {dp} ranks")
        for r in range(k):
            holders = [parts[j * k + r] for j in range(count)]
            local = cfg.moe.num_experts // k if cfg.moe is not None else 1
            _unflatten(cfg, holders, g, shapes, r, local, moments, weights)
    return moments, weights


def _unflatten(cfg: ModelConfig, parts: list, g: int, shapes: dict, ep_rank: int, local: int, moments: dict,
               weights: dict) -> None:
    """Group `g`'s flat fp32 weights and moments, concatenated over its partitions `parts`, cut into the
    parameters `shapes` names (local names of expert-parallel rank `ep_rank`, `local` experts each)."""
    from lifecycle.tasks.train.parallel.moe_convert import dense_name

    def state(p):
        base = p["base_optimizer_state"]
        return base[g] if isinstance(base, list) else base["state"][g]

    fp32 = torch.cat([p["single_partition_of_fp32_groups"][g].float() for p in parts])
    flat = {key: torch.cat([state(p)[key].float() for p in parts]) for key in ("exp_avg", "exp_avg_sq")}
    st0 = state(parts[0])
    step = float(st0["step"]) if "step" in st0 else float(parts[0]["base_optimizer_state_step"])
    offset = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        name = dense_name(local_to_dense(cfg, name), ep_rank, local)
        weights[name] = fp32[offset:offset + n].view(tuple(shape)).clone()
        moments[name] = (step, *(flat[k][offset:offset + n].view(tuple(shape)).clone() for k in ("exp_avg", "exp_avg_sq")))
        offset += n


def _merged_state(cfg: ModelConfig, src_tag: Path, src: dict, stages: list[dict], shapes: dict) -> tuple[dict, dict]:
    """({GPT name: (step, exp_avg, exp_avg_sq)}, {GPT name: fp32 master weight}; empty under ZeRO-0, whose module
    weights are the consolidated file's) of every stage, its tp slices merged. The files of stage s, tp rank t
    are DeepSpeed's model-parallel rank s·tp + t (its pp × tp group, pipe-major)."""
    from lifecycle.tasks.train.parallel.tp import merge_tensors, split_spec

    pp, tp = src["pp"], src.get("tp", 1)
    moments, weights = {}, {}
    for s in reversed(range(pp)):  # the first stage's copy of a tied table wins
        parts = []
        for t in range(tp):
            m = s * tp + t
            if src["zero"] == 0:
                parts.append((_stage_moments_zero0(cfg, src_tag, src, stages[m], m, shapes), {}))
            else:
                parts.append(_stage_moments_zero1(cfg, src_tag, src, m, stages[m]["param_shapes"]))
        for name in parts[0][0]:
            spec = split_spec(cfg, name) if tp > 1 else None
            step = parts[0][0][name][0]
            moments[name] = (step, *(merge_tensors([p[0][name][i] for p in parts], spec) if spec
                                     else parts[0][0][name][i] for i in (1, 2)))
        for name in parts[0][1]:
            spec = split_spec(cfg, name) if tp > 1 else None
            weights[name] = merge_tensors([p[1][name] for p in parts], spec) if spec else parts[0][1][name]
    return moments, weights


def _dense_adamw_state(train, shapes: dict, moments: dict, sched: dict) -> tuple[dict, dict]:
    """(the dense trainer's torch AdamW state dict, its LR scheduler state): the trainer's groups over GPT's
    parameters (decay (dim >= 2), no decay; experts split off as moe.param_groups does, ep = 1), each in GPT's
    parameter order, with every parameter's (step, exp_avg, exp_avg_sq); the schedule's position and learning
    rate (one schedule: every group's rate is the same) for that many groups."""
    from lifecycle.tasks.train.parallel.moe_convert import mark_experts

    opt = train.optimizer
    dummy = {n: torch.nn.Parameter(torch.zeros(1)) for n in shapes}
    groups = [{"params": [dummy[n] for n in shapes if len(shapes[n]) >= 2], "weight_decay": opt.weight_decay},
              {"params": [dummy[n] for n in shapes if len(shapes[n]) < 2], "weight_decay": 0.0}]
    if mark_experts(dummy):
        from lifecycle.tasks.train.parallel.moe import param_groups

        groups = param_groups(groups)
    names = {id(p): n for n, p in dummy.items()}
    order = [names[id(p)] for g in groups for p in g["params"]]
    state = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas).state_dict()
    if len(set(sched["_last_lr"])) != 1:
        raise ValueError(f"the source's parameter groups have different learning rates: {sched['_last_lr']}")
    n = len(state["param_groups"])
    sched = {**sched, "base_lrs": [sched["base_lrs"][0]] * n, "_last_lr": [sched["_last_lr"][0]] * n,
             "lr_lambdas": [None] * n}
    for g in state["param_groups"]:
        g.update(lr=sched["_last_lr"][0], initial_lr=opt.lr)
    optimizer: dict = {"param_groups": state["param_groups"], "state": {}}
    for i, name in enumerate(order):
        if name in moments:
            step, m, v = moments[name]
            optimizer["state"][i] = {"step": torch.tensor(step), "exp_avg": m.contiguous(), "exp_avg_sq": v.contiguous()}
    return optimizer, sched


def to_dense(src_tag: Path, dst_tag: Path, src: dict, dst: dict) -> dict:
    """Convert the committed pipeline checkpoint `src_tag` (layout `src`) into a dense ZeRO-0 DeepSpeed checkpoint
    in the empty directory `dst_tag` (layout `dst`, pp = 1): `mp_rank_00_model_states.pt` with GPT's state dict,
    the torch AdamW state (fp32 Adam moments and step count of every parameter, from the stage that owns it: the
    token table from the first stage, whose tied copy on the last stage holds the same values), the LR schedule,
    the engine counters and the client_state (sampler state rewritten for the destination's ranks, micro-batch
    and grad_accum; RNG states of ranks the destination has). A model with experts is laid out as DeepSpeed's
    single-rank MoE engine (ep = 1) saves it (lifecycle.tasks.train.parallel.moe_convert): the experts in a file
    each, the optimizer state in the expert-parallel rank's file. `model.safetensors` and `model_config.json`
    are copied. Returns the marker fields: {"format": "deepspeed"} (loaded by `engine.load_checkpoint`).

    The `Converter` signature of lifecycle.tasks.train.layout: plugs in there as
    `Converter("pipeline-to-dense", pp_convert.dense_reason, pp_convert.to_dense)`."""
    from lifecycle.tasks.train import commit as ckpt

    if (why := dense_reason(src, dst)) is not None:
        raise ValueError(f"{src_tag}: {why}")
    src_tag, dst_tag = Path(src_tag), Path(dst_tag)
    cfg = ModelConfig.model_validate_json((src_tag / ckpt.MODEL_CONFIG).read_text())
    state, files = _dense_state(cfg, src_tag, src, dst)
    return write_converted(src_tag, dst_tag, {"mp_rank_00_model_states.pt": state, **files})


def write_converted(src_tag: Path, dst_tag: Path, files: dict[str, dict]) -> dict:
    """Save each of `files` ({name: content}) in `dst_tag` (hashed as written), copy the source's consolidated
    weights and architecture beside them (evaluate and export read those), and return the marker fields of a
    checkpoint the engine's own `load_checkpoint` reads: {"format": "deepspeed"}."""
    import shutil

    from lifecycle.tasks.train import commit as ckpt

    for name, content in files.items():
        with ckpt.hashed_atomic_file(dst_tag / name) as w:
            torch.save(content, w)
    for name in (ckpt.WEIGHTS, ckpt.MODEL_CONFIG):
        shutil.copy2(src_tag / name, dst_tag / name)
    return {"format": "deepspeed"}


def _dense_state(cfg: ModelConfig, src_tag: Path, src: dict, dst: dict) -> tuple[dict, dict[str, dict]]:
    """(the dense model-states file's content, {file name: content} of the MoE files beside it) of `to_dense`."""
    from lifecycle.tasks.train import commit as ckpt
    from lifecycle.tasks.train.config import TrainConfig
    from lifecycle.tasks.train.parallel import moe_convert

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

    optimizer, sched = _dense_adamw_state(train, shapes, moments, stages[0]["lr_scheduler"])
    module = {name: weights[name].float().contiguous() for name in shapes}
    files: dict[str, dict] = {}
    if cfg.moe is not None:
        module, files = moe_convert.single_rank_files(cfg, module)
        files[moe_convert.optim_file(0, 0)] = {"optimizer": optimizer}
    if cfg.tie_embeddings:
        module["lm_head.weight"] = module["wte.weight"]

    state = dense_model_states(stages[0], module, optimizer, sched, dst)
    if cfg.moe is not None:  # one entry per MoE layer (a list: DeepSpeed's current MoE file layout)
        state["num_experts"] = [cfg.moe.num_experts] * len(moe_convert.moe_layers(cfg))
    return state, files


def dense_model_states(base: dict, module: dict, optimizer: dict, sched: dict, dst: dict) -> dict:
    """The ZeRO-0 model-states file of layout `dst` (pp = tp = 1): the source's model-states file `base` with
    GPT's state dict `module`, the torch optimizer and LR scheduler states, no ZeRO shapes, the world sizes, and
    the client_state's sampler rewritten for the destination's ranks, micro-batch and grad_accum (RNG states of
    ranks the destination has)."""
    state = dict(base)
    world = dst["dp"]
    state.update(module=module, optimizer=optimizer, lr_scheduler=sched, param_shapes=None, shared_params=None,
                 frozen_param_shapes=None, frozen_param_fragments=None, dp_world_size=world, mp_world_size=1)
    if "checkpoint_parallel_dimensions" in state:
        state["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": 1}
    state["sampler"] = {**state["sampler"], "world_size": world, "micro_batch_size": dst["micro"],
                        "grad_accum": dst["accum"]}
    state["rng"] = [state["rng"][r % len(state["rng"])] for r in range(world)]
    return state
