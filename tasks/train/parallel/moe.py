"""Mixture of experts with expert parallelism (`train.moe`), on DeepSpeed's MoE layer.

The MLP of every `every`-th block becomes `num_experts` copies of our MLP (GELU or SwiGLU, as configured) behind a
learned top-k router. Two modules compute it, with the same parameters:

- `MoEMLP` (all experts in one process, no capacity, no process group): what `GPT` builds when its config has
  `moe` set. Evaluation, export and the consolidated `model.safetensors` use it; its names are
  `blocks.i.mlp.gate.weight` (E × C) and `blocks.i.mlp.experts.j.{up,down}.weight` with j the global expert.
- `DSMoE` (a `deepspeed.moe.layer.MoE`): what the trainer swaps in (`install`). Each rank of an expert-parallel
  group holds num_experts/ep experts (global ids ep_rank·L .. ep_rank·L + L - 1); tokens reach them through
  DeepSpeed's all-to-all (`sharded_moe._AllToAll`, `all_to_all_single`), and every expert keeps at most
  `capacity` tokens per micro-batch: ceil(tokens·top_k/num_experts · capacity_factor), at least 4 (DeepSpeed's
  min_capacity). A route past it is dropped (the token passes through the residual only) and counted.

Routing (DeepSpeed's TopKGate, fp32): p = softmax(x·Wgᵀ) over all experts. top_k=1 (Switch): the argmax expert,
output scaled by its p. top_k=2 (GShard): the two largest p, scaled by p_i/(p_1+p_2); we turn off DeepSpeed's
default Gumbel sampling of the second expert (`top2_2nd_expert_sampling=False`) and its random token selection
(`use_rts=False`), so routing is deterministic (resume and ep=2-vs-1 runs are exact). That is Mixtral's router:
transformers' `MixtralTopKRouter` takes softmax over all experts, top-k, and divides by the sum of the k, i.e. a
softmax over the top-k logits. The two differ only (a) when capacity drops one of a token's two routes in
training (DeepSpeed renormalises over the routes it kept; Mixtral never drops) and (b) for top_k=1, where
Mixtral's weight is always 1 (so its router would get no gradient from the LM loss) and DeepSpeed's is p; a
top-1 model is therefore not exported as Mixtral (lifecycle.tasks.eval.export).

Load-balancing loss (`l_aux`, DeepSpeed's): top-1: E·Σ_e mean_s(p_e)·frac_e; top-2: the same with frac_e over
the first choices only (GShard); top-k ≥ 3: E·Σ_e mean_s(p_e)·frac_e / k over all k choices. The trainer adds
`aux_loss_weight` × (sum over MoE layers) to the LM loss; the logged `loss` stays the LM loss.

Under pipeline stages (`train.parallel.pp`) a stage passes one activation on and only the last stage has a loss,
so each MoE layer carries its own balancing loss into backward instead (`AuxLossCarrier`, Megatron-LM's
MoEAuxLossAutoScaler): the layer's output goes through an autograd function that returns it unchanged and, in
backward, hands the balancing loss the gradient aux_loss_weight / grad_accum, the factor DeepSpeed's
engine.backward applies to the LM loss of each micro-batch. The gradients are those of Σ_m (LM_m + w·aux_m) /
grad_accum, the single-rank step's, without passing anything between stages. The expert groups are then
built per stage (`ep_group`: DeepSpeed's `_create_expert_and_data_parallel` with pp_size), inside the stage's
data-parallel group.

In evaluation mode (in-training validation) the capacity factor is num_experts/top_k: capacity = tokens, so no
token is dropped and the numbers equal `MoEMLP`'s (the evaluate stage's).

Parameters of an expert are marked by DeepSpeed (`allreduce=False`, `group_name`): their gradients are reduced over
the expert-data-parallel group, and the optimizer's param groups are split with
`split_params_into_different_moe_groups_for_optimizer` (`param_groups`), which ZeRO-1/2 require. ZeRO-3 is
refused at config build (DeepSpeed's engine refuses its native MoE layer under stage 3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lifecycle.tasks.train.config import ModelConfig, MoEArch, TrainConfig

MIN_CAPACITY = 4  # DeepSpeed's MoE default: an expert always accepts at least this many tokens


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (S, k), expert ids (S, k)) of fp32 router logits (S, E), as DeepSpeed's gate weighs them without
    drops: top-1 the softmax probability, top-k ≥ 2 the probabilities renormalised over the chosen k."""
    probs = F.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if top_k > 1:
        w = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(w.dtype).eps)
    return w, idx


class MoEMLP(nn.Module):
    """All experts of one MoE MLP in this process: a router (`gate`, E × C, no bias) and `num_experts` MLPs;
    no capacity (no token dropped). `expert` builds one MLP (called num_experts times, so each draws its own
    initial weights from the generator in turn)."""

    def __init__(self, cfg: ModelConfig, expert):
        super().__init__()
        self.arch: MoEArch = cfg.moe
        self.gate = nn.Linear(cfg.n_embd, cfg.moe.num_experts, bias=False)
        self.experts = nn.ModuleList(expert() for _ in range(cfg.moe.num_experts))

    def inactive_params(self) -> int:
        """Expert parameters a token does not go through (num_experts - top_k experts): left out of the FLOPs."""
        per_expert = sum(p.numel() for p in self.experts[0].parameters())
        return (self.arch.num_experts - self.arch.top_k) * per_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, C = x.shape, x.shape[-1]
        h = x.reshape(-1, C)
        w, idx = route(F.linear(h.float(), self.gate.weight.float()), self.arch.top_k)
        out = torch.zeros(h.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, expert(h[tok]).float() * w[tok, slot, None])
        return out.to(x.dtype).view(shape)


class AuxLossCarrier(torch.autograd.Function):
    """Identity on a layer's output whose backward also gives the layer's balancing loss the gradient `scale`
    (aux_loss_weight / grad_accum): the loss reaches backward through the activation's own graph (Megatron-LM's
    MoEAuxLossAutoScaler, megatron/core/transformer/moe/moe_utils.py)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, l_aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(l_aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (l_aux,) = ctx.saved_tensors
        return grad_out, torch.full_like(l_aux, ctx.scale), None


def _ds_moe_class():
    from deepspeed.moe.layer import MoE

    class DSMoE(MoE):
        """deepspeed.moe.layer.MoE that returns only the output, as our MLP does; the load-balancing loss of the
        last forward is `l_aux`, and in training the routed and kept (within capacity) routes per expert of
        every forward since `take_counts` accumulate in `routed`/`kept` (int64, E)."""

        def __init__(self, local: MoEMLP, ep: int, capacity_factor: float):
            arch = local.arch
            super().__init__(hidden_size=local.gate.in_features, expert=local.experts[0], num_experts=arch.num_experts,
                             ep_size=ep, k=arch.top_k, capacity_factor=capacity_factor,
                             eval_capacity_factor=arch.num_experts / arch.top_k, min_capacity=MIN_CAPACITY,
                             drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False)
            self.arch = arch
            self.l_aux: torch.Tensor | None = None
            self.aux_scale: float | None = None  # set under pipeline stages: the loss is carried (AuxLossCarrier)
            self.aux_carried = torch.zeros((), dtype=torch.float64)  # sum of the carried losses since the last read
            zeros = torch.zeros(arch.num_experts, dtype=torch.int64)
            self.routed, self.kept = zeros.clone(), zeros.clone()
            self.deepspeed_moe.gate.register_forward_hook(self._count)

        def _count(self, gate, args, out) -> None:
            # MOELayer calls its gate with sparse_routes=True: (l_aux, capacity, E, indices (k, S) with -1 where
            # capacity dropped the route, locations, gates, exp_counts = routes per expert before the drop)
            if not self.training:
                return
            indices, exp_counts = out[3], out[6]
            kept = torch.bincount(indices[indices >= 0].long().flatten(), minlength=self.arch.num_experts)
            self.routed += exp_counts.detach().long().cpu()
            self.kept += kept.cpu()

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            out, self.l_aux, _ = super().forward(hidden_states)
            if self.aux_scale is not None and self.training and torch.is_grad_enabled():
                self.aux_carried = self.aux_carried.to(self.l_aux.device) + self.l_aux.detach().double()
                out = AuxLossCarrier.apply(out, self.l_aux, self.aux_scale)
            return out

    return DSMoE


def ep_group(ep: int, pp: int = 1):
    """(process group, its ranks) of this rank's expert-parallel group, created (collectively, every rank) the way
    DeepSpeed's engine would: consecutive ranks, [0..ep), [ep..2ep), ...; the expert-data-parallel groups with it.
    Under pp stages (ranks pp-major, lifecycle.tasks.train.parallel.mesh) DeepSpeed builds both per stage
    (pp_size); checked here against the grid: each lies in this rank's data-parallel group."""
    from deepspeed.utils import groups

    name = f"ep_size_{ep}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep, pp_size=pp)
    ranks = list(groups._get_expert_parallel_group_ranks(name))
    data = list(groups._get_expert_data_parallel_group_ranks(name))
    world, rank = dist.get_world_size(), dist.get_rank()
    stage = list(range(rank - rank % (world // pp), rank - rank % (world // pp) + world // pp))  # dp group (tp = 1)
    i = stage.index(rank)
    if ranks != stage[i - i % ep:i - i % ep + ep] or data != stage[i % ep::ep]:
        raise RuntimeError(f"DeepSpeed's expert groups of rank {rank} ({ranks}, expert-data {data}) are not the "
                           f"expert-parallel slices of its data-parallel group {stage}")
    return groups._get_expert_parallel_group(name), ranks


def install(model: nn.Module, cfg: TrainConfig) -> list[nn.Module]:
    """Swap every `MoEMLP` of `model` for a `DSMoE` holding this rank's num_experts/ep experts, copied from the
    MoEMLP's global experts ep_rank·L .. ep_rank·L + L - 1 (so the initial weights are the same whatever ep);
    returns the DSMoE layers in block order. Collective (creates the expert groups)."""
    DSMoE = _ds_moe_class()
    ep = cfg.moe.ep
    group, ranks = ep_group(ep, cfg.parallel.pp)
    ep_rank = ranks.index(dist.get_rank())
    layers = []
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, MoEMLP):
                continue
            layer = DSMoE(child, ep, cfg.moe.capacity_factor)
            L = layer.num_local_experts
            with torch.no_grad():
                layer.deepspeed_moe.gate.wg.weight.copy_(child.gate.weight)
                for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
                    expert.load_state_dict(child.experts[ep_rank * L + i].state_dict())
            if cfg.parallel.pp > 1:  # the balancing loss rides the activation (AuxLossCarrier)
                layer.aux_scale = cfg.moe.aux_loss_weight / cfg.batch.grad_accum
            layer.to(child.gate.weight.device)
            setattr(parent, child_name, layer)
            layers.append(layer)
    model.moe_layers = layers
    model.ep_rank, model.ep_ranks, model.ep_process_group = ep_rank, ranks, group
    return layers


def param_groups(groups_: list[dict]) -> list[dict]:
    """Optimizer param groups with the expert parameters split into their own groups (`moe: True`), as DeepSpeed's
    ZeRO-1/2 optimizer asks; each group needs a unique `name`."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer([{**g, "name": g.get("name", f"group{i}")}
                                                                for i, g in enumerate(groups_)])


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the last forward's load-balancing losses over the MoE layers (None for a dense model)."""
    layers = getattr(model, "moe_layers", None)
    if not layers:
        return None
    return sum(layer.l_aux for layer in layers)


def take_carried_aux(model: nn.Module) -> float:
    """Sum of the balancing losses the layers carried (pipeline stages) since the last call, on this rank; resets."""
    total = 0.0
    for layer in model.moe_layers:
        total += float(layer.aux_carried)
        layer.aux_carried = torch.zeros((), dtype=torch.float64)
    return total


def take_counts(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(routed, kept) per expert (int64, E) summed over the MoE layers since the last call, on this rank; resets."""
    layers = model.moe_layers
    routed: torch.Tensor = sum(layer.routed for layer in layers)  # type: ignore[assignment]
    kept: torch.Tensor = sum(layer.kept for layer in layers)  # type: ignore[assignment]
    for layer in layers:
        layer.routed.zero_()
        layer.kept.zero_()
    return routed.clone(), kept.clone()


def step_record(model: nn.Module, aux_sum: float, micro_batches: int, dp: int, device: torch.device) -> dict:
    """Collective: the MoE part of a train record for the routes since the last call, over all ranks: the
    load-balancing loss (summed over layers, mean over micro-batches and the `dp` data-parallel replicas: the
    sum over all ranks adds each pipeline stage's layers once per replica), routes and dropped routes per
    expert (summed over layers, ranks and micro-batches; dropped = routed - kept within capacity)."""
    routed, kept = take_counts(model)
    t = torch.cat([routed, kept]).to(torch.float64)
    t = torch.cat([t, torch.tensor([aux_sum / micro_batches], dtype=torch.float64)]).to(device)
    dist.all_reduce(t)
    E = routed.numel()
    routed_all, kept_all = t[:E].long().tolist(), t[E:2 * E].long().tolist()
    dropped = [r - k for r, k in zip(routed_all, kept_all)]
    return {"moe_aux_loss": t[-1].item() / dp, "moe_routed_per_expert": routed_all,
            "moe_dropped_per_expert": dropped, "moe_dropped": sum(dropped),
            "moe_drop_frac": sum(dropped) / max(1, sum(routed_all))}


def consolidated_state(module: nn.Module, copy: bool = True) -> dict[str, torch.Tensor] | None:
    """Collective over every rank: the dense-layout fp32 weights (`MoEMLP` names, all experts) on global rank 0,
    None elsewhere. Each expert-parallel group all-gathers its experts (rank 0's group is the one kept)."""
    if not getattr(module, "moe_layers", None):
        return module.export_state(copy=copy) if dist.get_rank() == 0 else None
    gathered = gather_experts(module)
    if dist.get_rank() != 0:
        return None
    return dense_layout(module.export_state(copy=copy), gathered)


def gather_experts(module: nn.Module, rename=lambda name: name) -> dict[str, torch.Tensor]:
    """Collective over each expert-parallel group: {`MoEMLP` name: fp32 CPU tensor} of every expert of `module`'s
    MoE layers, global expert ids; `rename` maps a layer's module name to its name in the dense GPT."""
    layers = module.moe_layers
    names = {id(layer): name for name, layer in module.named_modules() if any(layer is m for m in layers)}
    gathered: dict[str, torch.Tensor] = {}
    group, ranks = module.ep_process_group, module.ep_ranks
    for layer in layers:
        prefix, L = rename(names[id(layer)]), layer.num_local_experts
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            for pname, p in expert.named_parameters():
                t = p.detach().float().contiguous()
                parts = [torch.empty_like(t) for _ in ranks]
                if len(ranks) > 1:
                    dist.all_gather(parts, t, group=group)
                else:
                    parts = [t]
                for r, part in enumerate(parts):
                    gathered[f"{prefix}.experts.{r * L + i}.{pname}"] = part.cpu()
    return gathered


def dense_layout(state: dict[str, torch.Tensor], gathered: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (DSMoE names, this rank's experts) in `MoEMLP` names: the local experts replaced by `gathered`
    (all of them) and the router renamed."""
    out = {}
    for name, t in state.items():
        if ".deepspeed_moe.experts.deepspeed_experts." in name:
            continue
        out[name.replace(".deepspeed_moe.gate.wg.", ".gate.")] = t
    return out | gathered
