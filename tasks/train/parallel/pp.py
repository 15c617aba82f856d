"""Pipeline parallelism (`train.parallel.pp`): our GPT as a DeepSpeed `PipelineModule`, trained with its 1F1B schedule.

The model is a list of layer specs, each stage a contiguous run of them (`layer_specs`):

    0  EmbedPipe   token table (`TiedLayerSpec("wte")` when the head is tied, a plain `LayerSpec` otherwise)
    1  InputPipe   learned positions (GPT-2 recipe) and embedding dropout
    2… BlockPipe   one transformer block each; RoPE tables are recomputed in each block from the sequence length
                   (fp32, the same values the dense model computes once per forward: `model.rope_tables`)
    L+2 NormPipe   final norm
    L+3 head       `TiedLayerSpec("wte", forward_fn=tied_head)`: x @ wteᵀ with the first stage's table (DeepSpeed
                   all-reduces the two copies' gradients and counts the copy once in the gradient norm), or a
                   `HeadPipe` (lm_head) when the embeddings are untied

Blocks are partitioned evenly: `partition_method="type:BlockPipe"` balances the number of blocks per stage
(the embedding, input and head layers add no block). 'parameters' would count the token table (the largest
matrix at demo scale) and leave the first stage with almost no blocks; 'uniform' counts the four non-block
layers as blocks. Each layer's state dict keys are the dense model's names (blocks add `blocks.<j>.`), so
`dense_names` maps a stage's parameters to `GPT` names and back.

Initial weights: every rank builds the dense `GPT` from the run seed (as every other layout does) and its stage
copies its layers out of it (`GPTPipe.load_dense`), so a pipeline run starts from exactly the weights of a
single-rank run, a warm start or a Hugging Face base model. The dense copy is dropped once the stage has its
layers; at the sizes pipelining is for, that one dense copy per rank at start-up is the limit of this design.

DeepSpeed runs ZeRO-0 and ZeRO-1 under a pipeline only (PipelineEngine asserts it): `TrainConfig` refuses
ZeRO-2/3 with pp > 1 when the config is built (lifecycle.tasks.train.config). ZeRO-0's gradient clipping (`deepspeed.runtime.utils.clip_grad_norm_`)
counts only the parameters of the first stage unless they are marked model-parallel, so every stage's own
parameters are marked (`model_parallel = True`) and the tied copy on the last stage is not: the norm is the
dense model's (ZeRO-1's norm already counts every stage).

The train step (`forward_backward`) hands the step's grad_accum micro-batches of this rank's data shard to
`engine.train_batch`, which runs them through the 1F1B schedule, reduces the gradients over dp and the tied
copies, and steps the optimizer. Only the first stage reads the inputs and only the last the labels; every
stage draws the same micro-batches from the sampler (same dp coordinate). The loss is computed on the last stage,
averaged over the micro-batches and the data-parallel ranks there, and DeepSpeed broadcasts it to every stage
of the pipeline (`PipelineEngine._aggregate_total_loss`): every rank returns the same value, so the spike
guard, the rollback and the metrics agree without a further reduction.

Checkpoints: DeepSpeed writes one file per layer (`layer_<i>-model_states.pt`, from data-parallel rank 0 of each
stage) and one `mp_rank_<stage>_model_states.pt` per stage (the ZeRO-0 optimizer state, scheduler and our
client_state) or ZeRO-1 optimizer partitions `zero_pp_rank_<dp>_mp_rank_<stage>_optim_states.pt`. The commit
protocol's consolidated `model.safetensors` is gathered from the stages to rank 0 under the dense names
(`GPTPipe.export_state`, collective), so evaluate and `lifecycle export hf` read it unchanged.
`to_dense` converts a pipeline checkpoint (weights and Adam moments) into a dense ZeRO-0 DeepSpeed checkpoint
(pp=2 -> pp=1).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology
from deepspeed.runtime.utils import partition_balanced

from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.model import GPT, Block, make_norm, recompute_fn, rope_tables
from lifecycle.tasks.train.parallel.mesh import Grid

PARTITION_METHOD = "type:BlockPipe"
TIE_KEY = "wte"


# --------------------------------------------------------------------------------------------------
# the layers


class EmbedPipe(nn.Module):
    """The token table; on the last stage of a tied model the same module (a tied copy) is the output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx)


def tied_head(embed: EmbedPipe, x: torch.Tensor) -> torch.Tensor:
    """The tied output head: logits = x @ wteᵀ (GPT's lm_head shares wte's weight)."""
    return F.linear(x, embed.wte.weight)


class InputPipe(nn.Module):
    """Learned positions (when `pos: learned`) and the embedding dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(x.shape[1], device=x.device))
        return self.drop(x)


class BlockPipe(Block):
    """A block that takes only the activations (a pipeline passes one tensor between layers): its RoPE tables
    are computed here from the sequence length."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rope = None if self.cfg.pos == "learned" else rope_tables(self.cfg, x.shape[1], x.device)
        return super().forward(x, rope)


class NormPipe(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_f = make_norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_f(x)


class HeadPipe(nn.Module):
    """The untied output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT.forward's loss: mean cross-entropy in fp32, targets of -1 ignored."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def layer_specs(cfg: ModelConfig) -> list:
    """The DeepSpeed layer specs of GPT(cfg), in forward order (see the module docstring)."""
    if cfg.tie_embeddings:
        embed = TiedLayerSpec(TIE_KEY, EmbedPipe, cfg, tied_weight_attr="wte.weight")
        head = TiedLayerSpec(TIE_KEY, EmbedPipe, cfg, forward_fn=tied_head, tied_weight_attr="wte.weight")
    else:
        embed, head = LayerSpec(EmbedPipe, cfg), LayerSpec(HeadPipe, cfg)
    return [embed, LayerSpec(InputPipe, cfg), *(LayerSpec(BlockPipe, cfg) for _ in range(cfg.n_layer)),
            LayerSpec(NormPipe, cfg), head]


def layer_prefix(cfg: ModelConfig, idx: int) -> str:
    """The prefix that turns layer `idx`'s state dict keys into GPT's names ('' outside the blocks)."""
    return f"blocks.{idx - 2}." if 2 <= idx < 2 + cfg.n_layer else ""


def partition(cfg: ModelConfig, pp: int) -> list[int]:
    """Stage boundaries over the layer specs (stage s holds layers parts[s]:parts[s+1]), as
    PipelineModule computes them for PARTITION_METHOD: blocks balanced, the others where they fall."""
    weights = [0, 0] + [1] * cfg.n_layer + [0, 0]
    return partition_balanced(weights=weights, num_parts=pp)


def stage_param_names(cfg: ModelConfig, pp: int, stage: int) -> list[str]:
    """GPT names of stage `stage`'s parameters in the order its PipelineModule lists them (and so in the order
    of its optimizer state): tied modules first (DeepSpeed registers `tied_modules` before the layers; a tied
    copy of the token table is `wte.weight` too), then the layers in order. Built on the meta device."""
    parts, specs = partition(cfg, pp), layer_specs(cfg)
    tied, layers = [], []
    with torch.device("meta"):
        for idx in range(parts[stage], parts[stage + 1]):
            spec = specs[idx]
            if isinstance(spec, TiedLayerSpec):
                if not tied:
                    tied = [name for name, _ in spec.build().named_parameters()]
            else:
                layers += [layer_prefix(cfg, idx) + name for name, _ in spec.build().named_parameters()]
    return tied + layers


# --------------------------------------------------------------------------------------------------
# the module


def pipeline_module(model: GPT, pp: int, dp: int, activation_checkpointing: bool | str, tp: int = 1):
    """This rank's stage of `model` as a DeepSpeed PipelineModule (grid pp × dp × tp: DeepSpeed's
    PipeModelDataParallelTopology lays ranks out as pipe, data, model, the lifecycle Grid's order with sp = 1),
    holding `model`'s weights for its layers, its blocks split over the tp group when tp > 1. Collective."""
    cfg = model.cfg
    kwargs = {}
    if activation_checkpointing:  # each block recomputed in backward, whole or per op (model.recompute_fn)
        kwargs = {"activation_checkpoint_interval": 1, "checkpointable_layers": ["BlockPipe"],
                  "activation_checkpoint_func": recompute_fn(activation_checkpointing)}
    # without tp, the topology (and so the layer files' names, `layer_XX-model_states.pt`) of pipelines before tp
    topology = (PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp) if tp > 1
                else PipeDataParallelTopology(num_pp=pp, num_dp=dp))
    pipe = GPTPipe(cfg, layer_specs(cfg), topology=topology, loss_fn=lm_loss, partition_method=PARTITION_METHOD,
                   **kwargs)
    rank = dist.get_rank()
    coord = pipe._topo.get_coord(rank)
    if Grid(pp=pp, dp=dp, tp=tp).coords(rank) != {"pp": coord.pipe, "dp": coord.data, "sp": 0, "tp": getattr(coord, "model", 0)}:
        raise RuntimeError(f"DeepSpeed's pipeline topology puts rank {rank} at {coord}, the lifecycle Grid elsewhere")
    pipe.load_dense(model.export_state(copy=False))
    if tp > 1:
        pipe.shard_blocks()
    tp_rank = pipe._grid.get_slice_parallel_rank()
    for p in pipe.parameters():  # the gradient norm: see "Gradient norm" in the module docstring
        p.model_parallel = getattr(p, "tensor_model_parallel", False) or (
            tp_rank == 0 and not getattr(p, "ds_pipe_replicated", False))
    return pipe


class GPTPipe(PipelineModule):
    """GPT's layers of one pipeline stage, with dense-name export and import."""

    collective_export = True  # export_state is called on every rank (checkpoint.gathered_export)

    def __init__(self, cfg: ModelConfig, specs, **kwargs):
        super().__init__(specs, **kwargs)
        self.cfg = cfg

    def dense_names(self) -> dict[str, str]:
        """{this stage's parameter name: GPT name} for the parameters this stage exports: the tied copy
        of the token table on the last stage is left out (the first stage exports it)."""
        out = {}
        for local, _ in self.named_parameters():
            head, _, rest = local.partition(".")
            if head == "tied_modules":
                key, _, rest = rest.partition(".")
                idx = next(i for i, s in enumerate(self._layer_specs) if getattr(s, "key", None) == key)
                if not self._local_start <= idx < self._local_stop:
                    continue  # the tied copy of a layer another stage owns
                out[local] = rest
            else:
                out[local] = layer_prefix(self.cfg, int(head)) + rest
        return out

    def load_dense(self, state: dict[str, torch.Tensor]) -> None:
        """Copy GPT-named weights into this stage's layers (a tied copy takes `wte.weight` too)."""
        with torch.no_grad():
            for local, p in self.named_parameters():
                head, _, rest = local.partition(".")
                name = rest.partition(".")[2] if head == "tied_modules" else layer_prefix(self.cfg, int(head)) + rest
                if name not in state:
                    raise ValueError(f"pipeline parameter {local} ({name}) is not in the dense weights")
                p.copy_(state[name])

    def shard_blocks(self) -> None:
        """Split this stage's blocks over its tp group (DeepSpeed's slice group), in place, as
        lifecycle.tasks.train.parallel.tp.shard_model splits a dense GPT's: same names, local shapes."""
        from lifecycle.tasks.train.parallel.tp import TPAttention, TPGroup, TPMLP, check_divisible

        grid = self._grid
        self.tp = TPGroup(grid.get_slice_parallel_group(), grid.get_slice_parallel_world_size(),
                          grid.get_slice_parallel_rank())
        check_divisible(self.cfg, self.tp.size)
        for idx in range(self._local_start, self._local_stop):
            layer = self.forward_funcs[idx - self._local_start]
            if isinstance(layer, BlockPipe):
                prefix = layer_prefix(self.cfg, idx)
                layer.attn = TPAttention(layer.attn, prefix + "attn", self.tp)
                layer.mlp = TPMLP(layer.mlp, prefix + "mlp", self.cfg, self.tp)

    def stage_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """This stage's parameters under GPT names and dense shapes (fp32 CPU); with tp, the slices are gathered
        over the tp group (collective over it)."""
        params = dict(self.named_parameters())
        state = {dense: params[local].detach().float() for local, dense in self.dense_names().items()}
        if getattr(self, "tp", None) is not None:
            from lifecycle.tasks.train.parallel.tp import gather_dense

            state = gather_dense(self.cfg, state, self.tp)
        state = {k: t.cpu() for k, t in state.items()}
        return {k: t.clone() for k, t in state.items()} if copy else state

    def export_state(self, copy: bool = True) -> dict[str, torch.Tensor] | None:
        """GPT.export_state of the whole model on global rank 0 (None elsewhere), gathered from data-parallel
        rank 0 of every stage. Collective: every rank calls it."""
        whole = self.stage_state(copy=True)  # collective over the tp group
        mine = whole if self._grid.data_parallel_id == 0 and self._grid.get_slice_parallel_rank() == 0 else None
        got = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, got, dst=0)
        if dist.get_rank() != 0:
            return None
        state = {}
        for part in got:
            state.update(part or {})
        return state


# --------------------------------------------------------------------------------------------------
# the step


def forward_backward(engine, batches: list, poison: bool = False) -> float:
    """One optimizer step over `batches` (this rank's grad_accum (x, y) micro-batches) through the 1F1B
    schedule; returns the loss averaged over micro-batches and data-parallel ranks, the same on every rank.
    `poison` (fault injection) reports it as NaN, which rolls the step back like a real non-finite loss."""
    loss = engine.train_batch(iter(batches)).item()
    return float("nan") if poison else loss


def eval_loss(engine, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean loss of one validation micro-batch through the pipeline, on every rank."""
    return engine.eval_batch(iter([(x, y)]), num_micro_batches=1).item()


# --------------------------------------------------------------------------------------------------
# layout change: pp -> pp=1


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


def to_dense(src_tag: Path, dst_tag: Path, src: dict, dst: dict) -> dict:
    """Convert the committed pipeline checkpoint `src_tag` (layout `src`) into a dense ZeRO-0 DeepSpeed checkpoint
    in the empty directory `dst_tag` (layout `dst`, pp = 1): `mp_rank_00_model_states.pt` with GPT's state dict,
    the torch AdamW state (fp32 Adam moments and step count of every parameter, from the stage that owns it: the
    token table from the first stage, whose tied copy on the last stage holds the same values), the LR schedule,
    the engine counters and the client_state (sampler state rewritten for the destination's ranks, micro-batch
    and grad_accum; RNG states of ranks the destination has). `model.safetensors` and `model_config.json` are
    copied. Returns the marker fields: {"format": "deepspeed"} (loaded by `engine.load_checkpoint`).

    The `Converter` signature of lifecycle.tasks.train.layout: plugs in there as
    `Converter("pipeline-to-dense", pp.dense_reason, pp.to_dense)`."""
    import shutil

    from lifecycle.tasks.train import commit as ckpt
    from lifecycle.tasks.train.config import TrainConfig

    if (why := dense_reason(src, dst)) is not None:
        raise ValueError(f"{src_tag}: {why}")
    src_tag, dst_tag = Path(src_tag), Path(dst_tag)
    cfg = ModelConfig.model_validate_json((src_tag / ckpt.MODEL_CONFIG).read_text())
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

    # the dense trainer's optimizer: AdamW over [decay (dim >= 2), no decay], each in GPT's parameter order
    opt = train.optimizer
    order = [n for n in shapes if len(shapes[n]) >= 2] + [n for n in shapes if len(shapes[n]) < 2]
    n_decay = sum(len(shapes[n]) >= 2 for n in shapes)
    dummy = [torch.nn.Parameter(torch.zeros(1)) for _ in order]
    groups = torch.optim.AdamW([{"params": dummy[:n_decay], "weight_decay": opt.weight_decay},
                                {"params": dummy[n_decay:], "weight_decay": 0.0}],
                               lr=opt.lr, betas=opt.betas).state_dict()["param_groups"]
    sched = stages[0]["lr_scheduler"]
    for g, lr in zip(groups, sched["_last_lr"]):
        g.update(lr=lr, initial_lr=opt.lr)
    optimizer = {"param_groups": groups, "state": {}}
    for i, name in enumerate(order):
        if name in moments:
            step, m, v = moments[name]
            optimizer["state"][i] = {"step": torch.tensor(step), "exp_avg": m.contiguous(), "exp_avg_sq": v.contiguous()}
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
