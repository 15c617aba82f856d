"""Muon's optimizer state across a layout change (`train.optimizer.name: muon`): `read_state` gathers, from a
committed checkpoint of any layout the trainer runs Muon under (data parallel at ZeRO 0-3, pipeline stages at
ZeRO-0/1, Ulysses sequence parallelism at ZeRO 0-2), every parameter's state by GPT name: the Muon momentum
(`momentum_buffer`) of the blocks' 2-D weights and the AdamW half's step, exp_avg and exp_avg_sq; `convert`
writes it as the ZeRO-0, ZeRO-1 or ZeRO-2 state the trainer loads on any number of data-parallel ranks. The
layout-change mechanism (lifecycle.tasks.train.layout) plugs it in as the `muon` converter.

Where DeepSpeed keeps it (0.19.8, the client optimizer `MuonWithAuxAdam`, which sorts each Muon group's
parameters by shape, largest first, stable): ZeRO-0 a torch state dict per parameter; ZeRO-1/2 one state per
flat group, the AdamW moments as the flat fp32 partition, but Muon's momentum as the *whole* momentum of every
parameter that reaches into the rank's partition, concatenated (stage_1_and_2.py `_muon_momentum_buffer`: a
parameter cut by a partition boundary is whole on both ranks, which all-reduce its gradient); ZeRO-3 the
momentum partitioned like the fp32 weights (stage3.py `_create_momentum_buffer`). DeepSpeed's own
`ds_to_universal` reads exp_avg and exp_avg_sq only, so it cannot carry Muon."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lifecycle.tasks.train.config import ModelConfig, TrainConfig
from lifecycle.tasks.train.sizing import uses_muon


def group_names(names: list[str], shapes: dict) -> list[list[str]]:
    """engine.muon_optimizer's groups over `names` (GPT names, in the model's parameter order), each in the order
    of MuonWithAuxAdam's state: Muon (sorted by shape, largest first, as DeepSpeed sorts them), the other 2-D
    weights (AdamW with decay), the rest (AdamW without); empty groups dropped, as there."""
    hidden = sorted((n for n in names if uses_muon(n, shapes[n])), key=lambda n: tuple(shapes[n]), reverse=True)
    groups = [hidden, [n for n in names if not uses_muon(n, shapes[n]) and len(shapes[n]) >= 2],
              [n for n in names if len(shapes[n]) < 2]]
    return [g for g in groups if g]


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _zero12_partition(count: int, numels: list[int], pads: list[int], d: int) -> list[int]:
    """Indices of the parameters that reach into rank `d`'s partition of a flat group of `numels` (with
    DeepSpeed's per-parameter alignment `pads`, the flat padded to 2·count), as get_partition_info finds them."""
    total = sum(numels) + sum(pads)
    size = math.ceil(total / (2 * count)) * 2 * count // count
    start, end, at, mine = size * d, size * (d + 1), 0, []
    for i, (n, pad) in enumerate(zip(numels, pads)):
        if start <= at < end or at < start < at + n:
            mine.append(i)
        at += n + pad
    return mine


def _from_zero12(parts: list[dict], shapes: list[dict], names) -> dict:
    """{name: state} from the ZeRO-1/2 optimizer files `parts` (one per rank of the group, in order) of one
    model-parallel rank; `shapes` its model-states file's param_shapes, `names` maps their names to GPT's."""
    out: dict = {}
    for g, group in enumerate(shapes):
        local = list(group)
        numels = [math.prod(group[n]) for n in local]
        pads = parts[0]["param_alignment_paddings"][g] if "param_alignment_paddings" in parts[0] else [0] * len(local)
        states = [p["base_optimizer_state"]["state"][g] for p in parts]
        if "momentum_buffer" in states[0]:
            for d, state in enumerate(states):
                at = 0
                for i in _zero12_partition(len(parts), numels, pads, d):
                    out.setdefault(names(local[i]), {"momentum_buffer": state["momentum_buffer"][at:at + numels[i]]
                                                     .view(tuple(group[local[i]])).clone()})
                    at += numels[i]
            continue
        flat = {k: torch.cat([s[k].float() for s in states]) for k in ("exp_avg", "exp_avg_sq")}
        at = 0
        for i, name in enumerate(local):
            out[names(name)] = {"step": states[0]["step"], **{k: v[at:at + numels[i]].view(tuple(group[name])).clone()
                                                               for k, v in flat.items()}}
            at += numels[i] + pads[i]
    return out


def _from_zero3(parts: list[dict], shapes: list[dict]) -> dict:
    """{name: state} from ZeRO-3 optimizer files (one per rank): each parameter split in ceil(numel / ranks)
    pieces, a rank's sub-group the concatenation of its pieces; the momentum laid out as the fp32 weights."""
    out: dict = {}
    world = len(parts)
    for g, group in enumerate(shapes):
        states = [p["optimizer_state_dict"]["state"][g] for p in parts]
        keys = [k for k in ("momentum_buffer", "exp_avg", "exp_avg_sq") if k in states[0]]
        at = 0
        for name, shape in group.items():
            n = math.prod(shape)
            piece = math.ceil(n / world)
            out[name] = {k: torch.cat([s[k][at:at + piece].float() for s in states])[:n].view(tuple(shape)).clone()
                         for k in keys}
            if "step" in states[0]:
                out[name]["step"] = states[0]["step"]
            at += piece
    return out


def _model_states_files(src_tag: Path, src: dict) -> list[Path]:
    """The model-states file of each model-parallel rank (pipeline stage), the first data-parallel rank's."""
    if src["zero"] == 3:
        return [src_tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    return [src_tag / f"mp_rank_{m:02d}_model_states.pt" for m in range(src.get("pp", 1))]


def read_state(cfg: ModelConfig, src_tag: Path, src: dict, shapes: dict) -> tuple[dict, list[dict]]:
    """({GPT name: Muon or AdamW state}, the model-states file of each stage) of the committed Muon checkpoint
    `src_tag` (layout `src`; `shapes`: GPT's parameter shapes). Tied copies: the first stage's wins."""
    from lifecycle.tasks.train.parallel.pp import stage_param_names
    from lifecycle.tasks.train.parallel.pp_convert import local_to_dense, states_by_name

    stages = [_load(f) for f in _model_states_files(src_tag, src)]
    pp, out = src.get("pp", 1), {}
    for m in reversed(range(len(stages))):
        names = stage_param_names(cfg, pp, m) if pp > 1 else list(shapes)
        if src["zero"] == 0:
            order = [n for g in group_names(names, shapes) for n in g]
            out.update(states_by_name(stages[m]["optimizer"], order))
            continue
        files = sorted(src_tag.glob(f"zero_pp_rank_*_mp_rank_{m:02d}_optim_states.pt"),
                       key=lambda f: int(f.name.split("_")[3]))
        parts = [_load(f)["optimizer_state_dict"] for f in files]
        if src["zero"] == 3:
            out.update(_from_zero3(parts, stages[m]["param_shapes"]))
        else:
            out.update(_from_zero12(parts, stages[m]["param_shapes"],
                                    (lambda n: local_to_dense(cfg, n)) if pp > 1 else (lambda n: n)))
    return out, stages


def reason(src: dict, dst: dict) -> str | None:
    """Why `convert` cannot take a Muon checkpoint of layout `src` to layout `dst` (None: it can)."""
    if any(layout.get(axis, 1) != 1 for layout in (src, dst) for axis in ("tp", "ep")):
        return ("a tp checkpoint's Muon momentum is sliced per tp rank (tasks/train/muon_tp), and an ep one's "
                "experts are spread over the ep ranks: this converter neither merges nor splits them")
    if any(dst.get(axis, 1) != 1 for axis in ("pp", "sp")):
        return ("writes plain data-parallel state (pp = sp = 1); a pipeline or sequence-parallel destination "
                "lays the state out per stage or over dp × sp")
    if dst["zero"] == 3:
        return ("writes ZeRO-0 (MuonWithAuxAdam's torch state dict) or ZeRO-1/2 partitions; ZeRO-3's per-parameter "
                "partitions and model-states files per rank are not written: resume under "
                "train.engine.zero_stage: 0, 1 or 2")
    if src["micro"] * src["accum"] * src["dp"] != dst["micro"] * dst["accum"] * dst["dp"]:
        return "the global batch differs between the layouts"
    return None


def dense_optimizer(train: TrainConfig, shapes: dict, state: dict, sched: dict) -> tuple[dict, dict]:
    """(the ZeRO-0 trainer's MuonWithAuxAdam state dict over GPT's parameters, its LR scheduler state): the groups
    engine.muon_optimizer builds (DeepSpeed's own MuonWithAuxAdam, on the meta device, gives their order and
    hyperparameters), each parameter's state from `state`, the schedule's position from the source's `sched`."""
    from lifecycle.tasks.train.engine import muon_optimizer
    from lifecycle.tasks.train.model import GPT

    with torch.device("meta"):
        model = GPT(train.model_arch)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = muon_optimizer(train, model)
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    saved = opt.state_dict()
    factor = train.lr_at(sched["last_epoch"]) / train.optimizer.lr  # LambdaLR's factor, as the engine computes it
    base = [g["lr"] for g in saved["param_groups"]]
    for g, lr in zip(saved["param_groups"], base):
        g.update(lr=lr * factor, initial_lr=lr)
    missing = sorted(set(order) - set(state))
    if missing:
        raise ValueError(f"the source checkpoint has no optimizer state for {missing}")
    saved["state"] = {i: {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in state[n].items()}
                      for i, n in enumerate(order)}
    n = len(base)
    sched = {**sched, "base_lrs": base, "_last_lr": [lr * factor for lr in base], "lr_lambdas": [None] * n}
    return saved, sched


def _zero12_files(groups: list[list[str]], shapes: dict, state: dict, weights: dict, opt: dict, count: int) -> list:
    """The optimizer-states file content of each of `count` ZeRO-1/2 ranks (DeepSpeed's rigid layout, as
    stage_1_and_2.py `state_dict` writes it): each group's flat fp32 weights and AdamW moments padded to
    2·count and cut in equal partitions (the fp32 one without its padding), and Muon's momentum as the whole
    momentum of each parameter reaching into the partition; `state` by GPT name, `opt` the ZeRO-0 state dict (its
    groups' hyperparameters)."""
    import deepspeed
    from deepspeed.runtime.zero.config import ZeroStageEnum

    files = []
    for d in range(count):
        fp32, paddings, states = [], [], {}
        for g, names in enumerate(groups):
            numels = [math.prod(shapes[n]) for n in names]
            total = sum(numels)
            size = math.ceil(total / (2 * count)) * 2
            padding = min(size, max(0, size * (d + 1) - total))

            def part(tensors):
                flat = torch.cat([t.float().flatten() for t in tensors] + [torch.zeros(size * count - total)])
                return flat[size * d:size * (d + 1)].clone()

            fp32.append(part([weights[n] for n in names])[:size - padding])
            paddings.append(padding)
            if "momentum_buffer" in state[names[0]]:
                mine = _zero12_partition(count, numels, [0] * len(names), d)
                states[g] = {"momentum_buffer": torch.cat([state[names[i]]["momentum_buffer"].flatten() for i in mine])}
            else:
                states[g] = {"step": state[names[0]]["step"],
                             **{k: part([state[n][k] for n in names]) for k in ("exp_avg", "exp_avg_sq")}}
        groups_sd = [{**{k: v for k, v in pg.items() if k != "params"}, "params": [g]}
                     for g, pg in enumerate(opt["param_groups"])]
        files.append({"optimizer_state_dict": {
            "dynamic_loss_scale": False, "overflow": False, "clip_grad": 0.0,
            "base_optimizer_state": {"state": states, "param_groups": groups_sd},
            "single_partition_of_fp32_groups": fp32, "zero_stage": ZeroStageEnum.optimizer_states,
            "group_paddings": paddings, "param_alignment_paddings": [[0] * len(g) for g in groups],
            "partition_count": [count] * len(groups), "ds_version": deepspeed.__version__},
            "ds_version": deepspeed.__version__})
    return files


def convert(src_tag: Path, dst_tag: Path, src: dict, dst: dict) -> dict:
    """Convert the committed Muon checkpoint `src_tag` (layout `src`) into the DeepSpeed checkpoint of layout
    `dst` (ZeRO 0-2, data parallel) in the empty `dst_tag`: `mp_rank_00_model_states.pt` with GPT's fp32
    weights (the consolidated `model.safetensors`: fp32 runs, whose module weights are the master weights), the
    LR schedule, the engine counters and the client_state (pp_convert.dense_model_states), and MuonWithAuxAdam's
    state (every Muon momentum, every AdamW step and moments): in that file at ZeRO-0, in one ZeRO-1/2
    optimizer-states file per rank above it. Returns the marker fields: {"format": "deepspeed"}."""
    from safetensors.torch import load_file

    from lifecycle.tasks.train import commit as ckpt
    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.parallel.pp_convert import dense_model_states, write_converted

    if (why := reason(src, dst)) is not None:
        raise ValueError(f"{src_tag}: {why}")
    cfg = ModelConfig.model_validate_json((src_tag / ckpt.MODEL_CONFIG).read_text())
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in GPT(cfg).named_parameters()}
    state, stages = read_state(cfg, src_tag, src, shapes)
    train = TrainConfig.model_validate(stages[0]["config"])
    if train.engine.precision != "fp32":
        raise ValueError(f"{src_tag}: a {train.engine.precision} run; this converter writes fp32 engine state (its "
                         "weights are the consolidated fp32 model.safetensors)")
    optimizer, sched = dense_optimizer(train, shapes, state, stages[0]["lr_scheduler"])
    weights = load_file(str(src_tag / ckpt.WEIGHTS))
    module = {name: weights[name].float().contiguous() for name in shapes}
    if cfg.tie_embeddings:
        module["lm_head.weight"] = module["wte.weight"]
    files = {}
    model_states = dense_model_states(stages[0], module, optimizer, sched, dst)
    if dst["zero"] > 0:
        groups = group_names(list(shapes), shapes)
        model_states.update(optimizer=None, param_shapes=[{n: torch.Size(shapes[n]) for n in g} for g in groups],
                            shared_params={"lm_head.weight": "wte.weight"} if cfg.tie_embeddings else {})
        for d, content in enumerate(_zero12_files(groups, shapes, state, module, optimizer, dst["dp"])):
            files[f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt"] = content
    files["mp_rank_00_model_states.pt"] = model_states
    return write_converted(src_tag, dst_tag, files)
