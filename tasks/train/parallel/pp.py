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

Document-aware attention (`attention: document`, the dense model's `doc_sep` set): a stage gets only what the
stage before sends, so the embedding layer sends the window's token ids on with the activations, as a tuple
(activations, ids) that DeepSpeed passes between stages (integers get no gradient); the input layer and each block
find the documents in them (`model.documents`: the learned positions, the RoPE tables and the block-causal mask,
recomputed per block, as the RoPE tables are), and the final norm drops them. Without it the layers pass one
tensor, as before.

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


import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology
from deepspeed.runtime.utils import partition_balanced

from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.model import GPT, Block, documents, make_norm, recompute_fn, rope_tables, rope_tables_at
from lifecycle.tasks.train.parallel.mesh import Grid

PARTITION_METHOD = "type:BlockPipe"
TIE_KEY = "wte"


# --------------------------------------------------------------------------------------------------
# the layers


Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""What the layers pass: the activations, or (activations, the window's token ids) under document attention."""


class EmbedPipe(nn.Module):
    """The token table; on the last stage of a tied model the same module (a tied copy) is the output head.
    Under document attention (`doc_sep` set by `pipeline_module`) the ids go on with the activations."""

    doc_sep: int | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor) -> Hidden:
        return self.wte(idx) if self.doc_sep is None else (self.wte(idx), idx)


def tied_head(embed: EmbedPipe, x: torch.Tensor) -> torch.Tensor:
    """The tied output head: logits = x @ wteᵀ (GPT's lm_head shares wte's weight)."""
    return F.linear(x, embed.wte.weight)


class InputPipe(nn.Module):
    """Learned positions (when `pos: learned`; per document under document attention) and the embedding
    dropout."""

    doc_sep: int | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h: Hidden) -> Hidden:
        x, ids = h if isinstance(h, tuple) else (h, None)
        if self.wpe is not None:
            docs = documents(ids, self.doc_sep) if ids is not None and self.doc_sep is not None else None
            x = x + self.wpe(torch.arange(x.shape[1], device=x.device) if docs is None else docs[0])
        return self.drop(x) if ids is None else (self.drop(x), ids)


class BlockPipe(Block):
    """A block that takes only what the layer before passes: its RoPE tables are computed here from the sequence
    length, or under document attention its positions and mask from the window's ids."""

    doc_sep: int | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.cfg = cfg

    def forward(self, h: Hidden) -> Hidden:
        x, ids = h if isinstance(h, tuple) else (h, None)
        docs = documents(ids, self.doc_sep) if ids is not None and self.doc_sep is not None else None
        rope = None
        if self.cfg.pos != "learned":
            rope = rope_tables(self.cfg, x.shape[1], x.device) if docs is None else rope_tables_at(self.cfg, docs[0])
        y = super().forward(x, rope, None if docs is None else docs[1])
        return y if ids is None else (y, ids)


class NormPipe(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_f = make_norm(cfg)

    def forward(self, h: Hidden) -> torch.Tensor:
        return self.norm_f(h[0] if isinstance(h, tuple) else h)


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
    if model.doc_sep is not None:  # document attention: the ids travel with the activations
        set_doc_sep(pipe, model.doc_sep)
    if tp > 1:
        pipe.shard_blocks()
    tp_rank = pipe._grid.get_slice_parallel_rank()
    for p in pipe.parameters():  # the gradient norm: see "Gradient norm" in the module docstring
        p.model_parallel = getattr(p, "tensor_model_parallel", False) or (
            tp_rank == 0 and not getattr(p, "ds_pipe_replicated", False))
    return pipe


def set_doc_sep(layers: nn.Module, sep: int) -> None:
    """Document attention in a stage's (or a list's) layers: the embedding sends the ids on, the input layer and
    the blocks find the documents ending with end-of-text id `sep` in them."""
    for m in layers.modules():
        if isinstance(m, (EmbedPipe, InputPipe, BlockPipe)):
            m.doc_sep = sep


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

    def dense_module_name(self, local: str) -> str:
        """GPT's name of one of this stage's modules (`2.mlp` -> `blocks.0.mlp`)."""
        head, _, rest = local.partition(".")
        return layer_prefix(self.cfg, int(head)) + rest

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
        if getattr(self, "moe_layers", None):  # experts gathered over the stage's expert-parallel group
            from lifecycle.tasks.train.parallel.moe import dense_layout, gather_experts

            state = dense_layout(state, gather_experts(self, self.dense_module_name))
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
