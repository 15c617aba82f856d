"""Tensor parallelism: Megatron-LM's 1-D split of each block (Shoeybi et al. 2019, section 3) over the tp group.

Attention: the fused q/k/v projection is column-parallel (each rank keeps its n_head/tp query heads and
n_kv_head/tp key/value heads, so grouped-query attention keeps its head-to-group map locally) and the output
projection is row-parallel. MLP: the up projection (GELU, or SwiGLU's fused gate|up) is column-parallel, down is
row-parallel. Around each pair, Megatron's conjugate functions over the tp group:
  f (`copy_to_tp`): identity forward, all-reduce of the gradient backward (before the column-parallel matmul);
  g (`reduce_from_tp`): all-reduce forward, identity backward (after the row-parallel matmul).
So one block costs two all-reduces forward and two backward, and every replicated tensor (the residual stream,
the norms, the embedding and the output head) holds the same values and the same full gradient on every rank of
the tp group. The token embedding and the LM head stay replicated: at our widths the vocabulary table is small
next to the blocks, and a vocab-parallel head would need a parallel cross-entropy.

Why our own layers and not DeepSpeed's AutoTP (`tensor_parallel.autotp_size`, DeepSpeed 0.19.8): AutoTP's engine
set-up replaces the `mpu` it is given with `deepspeed.utils.groups` and builds its own 2-D (dp, tp) device mesh
(`DeepSpeedEngine._configure_tensor_parallel_states`), so it cannot share the pp × dp × sp × tp groups of
lifecycle.tasks.train.parallel.mesh that pipeline and sequence parallelism use; and it shards `nn.Linear`
weights only, while our attention reads its head counts and split sizes from the config, so the model would need
rewriting for it anyway. The split here is a table of four parameter names (`split_spec`), used alike to shard
the model, to gather the consolidated export, and to convert a tp checkpoint (weights and Adam moments) to dense.

Initial weights: the dense model is built with the seed on every rank, then sliced (`shard_model`), so a tp run
starts from exactly the weights of a single-rank run. ZeRO-1/2 partition over the data-parallel group only (the
Mesh is DeepSpeed's `mpu`); the sharded parameters carry `tensor_model_parallel = True`, which DeepSpeed's
gradient-norm code reads to sum their norms over the tp group and to count replicated ones once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.model import GPT, MLP, CausalSelfAttention, RMSNorm, apply_rope, causal_attention

__all__ = ["TPGroup", "split_spec", "shard_tensor", "merge_tensors", "shard_model", "TensorParallelGPT",
           "dense_from_checkpoint"]


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group: the process group, its size and this rank's index in it."""

    group: object
    size: int
    rank: int

    @classmethod
    def of(cls, mesh) -> "TPGroup":
        """From a `Mesh` (lifecycle.tasks.train.parallel.mesh)."""
        return cls(mesh.get_model_parallel_group(), mesh.get_model_parallel_world_size(),
                   mesh.get_model_parallel_rank())


# --------------------------------------------------------------------------------------------------
# which parameters are split, and how (pure tensor code: used by the model, the export and the converter)

_BLOCK = re.compile(r"^blocks\.\d+\.(.+)$")


def split_spec(cfg: ModelConfig, name: str) -> tuple[int, list[int]] | None:
    """(dim, sizes of the fused parts along dim) of a dense parameter that tp splits; None: replicated.

    Each fused part (q, k, v; gate, up) is split into tp equal chunks and rank r keeps chunk r of every part,
    so a rank's q/k/v rows are whole heads and its gate and up rows belong to the same hidden units."""
    m = _BLOCK.match(name)
    if m is None:
        return None
    kind = m.group(1)
    C, kvd, h = cfg.n_embd, cfg.kv_heads * cfg.head_dim, cfg.mlp_hidden
    if kind in ("attn.qkv.weight", "attn.qkv.bias"):
        return 0, [C, kvd, kvd]  # column-parallel: output rows [q | k | v]
    if kind == "attn.proj.weight":
        return 1, [C]  # row-parallel: input columns
    if kind == "mlp.up.weight":
        return 0, [h, h] if cfg.mlp == "swiglu" else [h]  # column-parallel: [gate | up] rows
    if kind == "mlp.down.weight":
        return 1, [h]  # row-parallel
    return None


def shard_tensor(t: torch.Tensor, spec: tuple[int, list[int]], tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice of the dense tensor `t` (a weight, or an Adam moment of the same shape)."""
    dim, sizes = spec
    parts = t.split(sizes, dim=dim)
    return torch.cat([p.chunk(tp, dim=dim)[rank] for p in parts], dim=dim).contiguous()


def merge_tensors(shards: list[torch.Tensor], spec: tuple[int, list[int]]) -> torch.Tensor:
    """Inverse of `shard_tensor`: the dense tensor from every rank's slice, in tp-rank order."""
    dim, sizes = spec
    tp = len(shards)
    pieces = [s.split([n // tp for n in sizes], dim=dim) for s in shards]
    return torch.cat([torch.cat([p[i] for p in pieces], dim=dim) for i in range(len(sizes))], dim=dim)


def universal_checkpoint_info(cfg: ModelConfig, tp: int) -> dict:
    """The split table in DeepSpeed's universal-checkpoint vocabulary (deepspeed/checkpoint/constants.py, UCP
    version 0.4). Set on the module as `universal_checkpoint_info`, the engine saves it into every
    `mp_rank_XX_model_states.pt`, and `deepspeed.checkpoint.ds_to_universal` then merges our tp slices (weights and
    Adam moments) into dense parameters: fused q/k/v (uneven under GQA) and SwiGLU's gate|up as sub-parameters
    with their per-rank widths, proj and down as row-parallel (cat on dim 1), the rest replicated."""
    C, kvd, h = cfg.n_embd, cfg.kv_heads * cfg.head_dim, cfg.mlp_hidden
    blk = r"^blocks\.\d+\."
    qkv_w, qkv_b, up_w = blk + r"attn\.qkv\.weight$", blk + r"attn\.qkv\.bias$", blk + r"mlp\.up\.weight$"
    sub = [{"patterns": [qkv_w], "shape": ((C, kvd, kvd), -1), "partition_dim": 0}]
    widths = {qkv_w: [[n // tp] * tp for n in (C, kvd, kvd)]}
    if cfg.qkv_bias:
        sub.append({"patterns": [qkv_b], "shape": ((C, kvd, kvd),), "partition_dim": 0})
        widths[qkv_b] = widths[qkv_w]
    if cfg.mlp == "swiglu":
        sub.append({"patterns": [up_w], "shape": ((h, h), -1), "partition_dim": 0})
        widths[up_w] = [[h // tp] * tp] * 2
    replicated = [r"^wte\.weight$", r"^norm_f\.(weight|bias)$", blk + r"norm[12]\.(weight|bias)$"]
    replicated += [r"^wpe\.weight$"] if cfg.pos == "learned" else []
    replicated += [] if cfg.tie_embeddings else [r"^lm_head\.weight$"]
    return {"universal_checkpoint_version": 0.4, "tp_replicated_parameter_patterns": replicated,
            "parameter_with_row_parallelism_patterns": [blk + r"attn\.proj\.weight$", blk + r"mlp\.down\.weight$"],
            "parameter_with_sub_params": sub, "sub_param_shard_widths": widths}


# --------------------------------------------------------------------------------------------------
# Megatron's f and g


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward, the gradient summed over the tp group (each rank's column slice
    contributed a part of it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: the row-parallel partial outputs summed over the tp group forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


# Megatron's sequence parallelism (Korthikanti et al. 2022, section 4.2.2): between the blocks' matmuls each tp
# rank holds 1/t of the sequence (dim 1), so the norms and residual adds work on a slice and keep a slice; f and g
# become an all-gather along the sequence (backward: reduce-scatter) and a reduce-scatter (backward: all-gather).


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over the group, this rank's slice of dim 1 (an all-reduce, then the slice: gloo has no
    reduce-scatter, and the values are the same)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return _own_slice(out, group)


def _own_slice(x: torch.Tensor, group) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim=1)[r].contiguous()


class _SeqOp(torch.autograd.Function):
    """A sequence-dimension collective `forward` whose backward is `backward` (both (tensor, group) -> tensor)."""

    @staticmethod
    def forward(ctx, x, group, forward, backward):
        ctx.group, ctx.backward_fn = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Before a column-parallel matmul: the whole sequence from the slices; backward, summed and sliced."""
    return _SeqOp.apply(x, group, _all_gather_seq, _reduce_scatter_seq)


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """After a row-parallel matmul: the partial outputs summed, this rank's slice kept; backward, all-gathered."""
    return _SeqOp.apply(x, group, _reduce_scatter_seq, _all_gather_seq)


def slice_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Into the blocks: a replicated tensor's slice; backward, the slices' gradients gathered."""
    return _SeqOp.apply(x, group, _own_slice, _all_gather_seq)


def unslice_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Out of the blocks: the whole sequence, used alike on every rank after; backward, this rank's slice of the
    (identical) gradient."""
    return _SeqOp.apply(x, group, _all_gather_seq, _own_slice)


def _sequence_parallel_norm(self, x: torch.Tensor) -> torch.Tensor:
    """forward of a norm on this rank's slice of the sequence: its weight enters through f, so its gradient is
    summed over the tp group (each rank saw other tokens) and every rank holds the whole, replicated gradient."""
    w = copy_to_tp(self.weight, self.tp.group)
    if isinstance(self, RMSNorm):
        return self.normalize(x, w)
    return F.layer_norm(x, self.normalized_shape, w, self.bias, self.eps)


_SP_NORMS: dict[type, type] = {}


def sequence_parallel_norm_(norm: nn.Module, tp: "TPGroup") -> None:
    """Make `norm` (RMSNorm or LayerNorm) a sequence-parallel norm in place: its class changes, its parameter
    and its name in the state dict do not."""
    base = type(norm)
    if base not in _SP_NORMS:
        _SP_NORMS[base] = type(f"SequenceParallel{base.__name__}", (base,), {"forward": _sequence_parallel_norm})
    norm.__class__ = _SP_NORMS[base]
    norm.tp = tp


# --------------------------------------------------------------------------------------------------
# the layers


def _shard_linear_(linear: nn.Linear, cfg: ModelConfig, prefix: str, tp: TPGroup) -> None:
    """Replace `linear`'s weight (and bias) by this rank's slice, in place: the module, its name and its init
    attributes stay; no new module is built (that would draw from the RNG)."""
    for pname in ("weight", "bias"):
        p = getattr(linear, pname, None)
        if p is None:
            continue
        spec = split_spec(cfg, f"{prefix}.{pname}")
        piece = nn.Parameter(shard_tensor(p.detach(), spec, tp.size, tp.rank), requires_grad=p.requires_grad)
        piece.tensor_model_parallel = True  # type: ignore[attr-defined]  # DeepSpeed's grad-norm: sum over the tp group, not counted once
        setattr(linear, pname, piece)
    linear.out_features, linear.in_features = linear.weight.shape


def _leave_tp(y: torch.Tensor, tp: TPGroup, seq_parallel: bool) -> torch.Tensor:
    """g after a row-parallel matmul: summed over the tp group (whole, or this rank's sequence slice)."""
    return reduce_scatter_seq(y, tp.group) if seq_parallel else reduce_from_tp(y, tp.group)


class TPAttention(nn.Module):
    """Causal self-attention over this rank's heads: column-parallel qkv, row-parallel proj."""

    def __init__(self, dense: CausalSelfAttention, prefix: str, tp: TPGroup, seq_parallel: bool = False):
        super().__init__()
        cfg = self.cfg = dense.cfg
        self.tp, self.seq_parallel = tp, seq_parallel
        self.n_head, self.kv_heads = cfg.n_head // tp.size, cfg.kv_heads // tp.size
        self.q_dim, self.kv_dim = self.n_head * cfg.head_dim, self.kv_heads * cfg.head_dim
        _shard_linear_(dense.qkv, cfg, f"{prefix}.qkv", tp)
        _shard_linear_(dense.proj, cfg, f"{prefix}.proj", tp)
        self.qkv, self.proj, self.resid_drop = dense.qkv, dense.proj, dense.resid_drop

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = gather_seq(x, self.tp.group) if self.seq_parallel else copy_to_tp(x, self.tp.group)
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        q, k, v = self.qkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=2)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k, v = (t.view(B, T, self.kv_heads, hd).transpose(1, 2) for t in (k, v))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # dropout is refused with tp > 1 (config): masks would need a tp-aware RNG stream (Megatron's tracker)
        y = causal_attention(q, k, v, 0.0, mask)  # mask: document-aware attention's (model.documents)
        y = y.transpose(1, 2).contiguous().view(B, T, self.q_dim)
        return self.resid_drop(_leave_tp(self.proj(y), self.tp, self.seq_parallel))


class TPMLP(nn.Module):
    """GELU or SwiGLU MLP over this rank's hidden units: column-parallel up (gate|up fused), row-parallel down."""

    def __init__(self, dense: MLP, prefix: str, cfg: ModelConfig, tp: TPGroup, seq_parallel: bool = False):
        super().__init__()
        self.kind, self.tp, self.seq_parallel = dense.kind, tp, seq_parallel
        _shard_linear_(dense.up, cfg, f"{prefix}.up", tp)
        _shard_linear_(dense.down, cfg, f"{prefix}.down", tp)
        self.up, self.down, self.drop = dense.up, dense.down, dense.drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(gather_seq(x, self.tp.group) if self.seq_parallel else copy_to_tp(x, self.tp.group))
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.drop(_leave_tp(self.down(h), self.tp, self.seq_parallel))


class TensorParallelGPT(GPT):
    """A `GPT` whose blocks are tp-sharded (`shard_model` turns a built dense GPT into one, in place).

    `export_state` is collective over the tp group (every rank of it must call it: `collective_export`) and
    returns the dense names and shapes, so the consolidated `model.safetensors`, evaluation and
    `lifecycle export hf` see the model a single rank would have trained."""

    collective_export = True
    seq_parallel = False

    def enter_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return slice_seq(x, self.tp.group) if self.seq_parallel else x

    def leave_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return unslice_seq(x, self.tp.group) if self.seq_parallel else x

    def export_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        state = gather_dense(self.cfg, {n: p.detach().float() for n, p in self.named_parameters()}, self.tp)
        return {n: t.cpu().clone() if copy and split_spec(self.cfg, n) is None else t.cpu() for n, t in state.items()}

    def load_export(self, state: dict[str, torch.Tensor]) -> None:
        """Dense weights (`GPT.export_state` names and shapes) into this rank's slices."""
        GPT.load_export(self, {n: shard_tensor(t, spec, self.tp.size, self.tp.rank)
                               if (spec := split_spec(self.cfg, n)) is not None else t for n, t in state.items()})


def gather_dense(cfg: ModelConfig, state: dict[str, torch.Tensor], tp: TPGroup) -> dict[str, torch.Tensor]:
    """`state` (dense names, this rank's slices) with every split tensor gathered over the tp group and merged
    to its dense shape; replicated ones as they are. Collective over the tp group, in `state`'s order."""
    out = {}
    for name, t in state.items():
        if (spec := split_spec(cfg, name)) is not None:
            shards = [torch.empty_like(t) for _ in range(tp.size)]
            dist.all_gather(shards, t.contiguous(), group=tp.group)
            t = merge_tensors(shards, spec)
        out[name] = t
    return out


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """The split needs whole heads and whole hidden units per rank (ModelConfig-level; TrainConfig refuses it too)."""
    for what, n in (("n_head", cfg.n_head), ("key/value heads", cfg.kv_heads), ("MLP hidden width", cfg.mlp_hidden)):
        if n % tp:
            raise ValueError(f"train.parallel.tp={tp} must divide the model's {what} ({n})")


def shard_model(model: GPT, tp: TPGroup, seq_parallel: bool = False) -> TensorParallelGPT:
    """Turn a dense GPT (the same initial weights on every rank) into this rank's tp shard, in place; returns it.
    Parameter names are unchanged; split ones get their local shapes. `seq_parallel`: Megatron's sequence
    parallelism between the matmuls (the norms wrapped, not renamed: their weights keep their names)."""
    check_divisible(model.cfg, tp.size)
    if tp.size == 1:
        raise ValueError("shard_model needs a tp group of 2 or more ranks")
    for i, block in enumerate(model.blocks):
        block.attn = TPAttention(block.attn, f"blocks.{i}.attn", tp, seq_parallel)
        block.mlp = TPMLP(block.mlp, f"blocks.{i}.mlp", model.cfg, tp, seq_parallel)
        if seq_parallel:
            sequence_parallel_norm_(block.norm1, tp)
            sequence_parallel_norm_(block.norm2, tp)
    model.__class__ = TensorParallelGPT  # same attributes; export and load become tp-aware (num_params: this rank's)
    model.tp, model.seq_parallel = tp, seq_parallel
    model.universal_checkpoint_info = universal_checkpoint_info(model.cfg, tp.size)  # saved by DeepSpeed
    return model


# --------------------------------------------------------------------------------------------------
# a tp-sharded DeepSpeed checkpoint to the dense state (weights and Adam moments)


_MODEL_FILE = re.compile(r"^mp_rank_(\d\d)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d\d)_optim_states\.pt$")


def _rank_params(model_states: dict, optim_files: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """One tp rank's {kind: {name: tensor}} for kind in fp32 / exp_avg / exp_avg_sq / step, from its ZeRO-1/2
    files (one per data-parallel rank, in dp order): each parameter's fragment in every dp rank's flat
    partition (DeepSpeed's `param_slice_mappings`: start and numel in that partition), concatenated in dp order
    and viewed at the shape DeepSpeed recorded (`param_shapes`)."""
    out: dict[str, dict[str, torch.Tensor]] = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}, "step": {}}
    shapes = {n: s for group in model_states["param_shapes"] for n, s in group.items()}
    opt = [f["optimizer_state_dict"] for f in optim_files]
    if any("single_partition_of_fp32_groups" not in o or "param_slice_mappings" not in o for o in opt):
        raise ValueError("not a ZeRO-1/2 optimizer checkpoint (tp composes with ZeRO stages 1 and 2 only)")
    for g in range(len(opt[0]["single_partition_of_fp32_groups"])):
        flats = [{"fp32": o["single_partition_of_fp32_groups"][g], **{
            k: o["base_optimizer_state"]["state"][g][k] for k in ("exp_avg", "exp_avg_sq")}} for o in opt]
        names = [n for o in opt for n in o["param_slice_mappings"][g]]
        for name in dict.fromkeys(names):
            for kind in ("fp32", "exp_avg", "exp_avg_sq"):
                pieces = [flat[kind].float().narrow(0, a.start, a.numel) for flat, o in zip(flats, opt)
                          if (a := o["param_slice_mappings"][g].get(name)) is not None]
                out[kind][name] = torch.cat(pieces).view(shapes[name]).clone()
            out["step"][name] = torch.as_tensor(opt[0]["base_optimizer_state"]["state"][g]["step"]).float().clone()
    return out


def dense_from_checkpoint(tag_dir: str | Path, cfg: ModelConfig) -> dict[str, dict[str, torch.Tensor]]:
    """A committed tp-sharded DeepSpeed checkpoint (ZeRO-1/2, any dp) as the dense model's state: {"fp32": master
    weights, "exp_avg", "exp_avg_sq": AdamW moments, "step": AdamW step}, each {dense name: tensor} with the names
    and shapes of `GPT.export_state`. Loading those into a dense (tp=1) engine of any dp/ZeRO layout continues the
    run (lifecycle.tasks.train.commit's layout change reads them; DeepSpeed's `safe_set_full_fp32_param` /
    `safe_set_full_optimizer_state` put them into whatever partition a parameter has)."""
    tag_dir = Path(tag_dir)
    model_files = sorted((int(m.group(1)), p) for p in tag_dir.iterdir() if (m := _MODEL_FILE.match(p.name)))
    optim: dict[int, list[tuple[int, Path]]] = {}
    for p in tag_dir.iterdir():
        if m := _OPTIM_FILE.match(p.name):
            optim.setdefault(int(m.group(2)), []).append((int(m.group(1)), p))
    tp = len(model_files)
    if not tp or [r for r, _ in model_files] != list(range(tp)) or sorted(optim) != list(range(tp)):
        raise ValueError(f"{tag_dir}: expected mp_rank_00..NN model and optimizer files, found "
                         f"{sorted(p.name for p in tag_dir.iterdir())}")
    ranks = []
    for r, path in model_files:
        states = torch.load(path, map_location="cpu", weights_only=False)  # our own checkpoint (see checkpoint.py)
        files = [torch.load(p, map_location="cpu", weights_only=False) for _, p in sorted(optim[r])]
        ranks.append(_rank_params(states, files))
    dense: dict[str, dict[str, torch.Tensor]] = {}
    for kind in ranks[0]:
        dense[kind] = {}
        for name, t in ranks[0][kind].items():
            spec = split_spec(cfg, name) if kind != "step" else None
            dense[kind][name] = merge_tensors([rk[kind][name] for rk in ranks], spec) if spec else t
    return dense
