"""DeepSpeed's MoE checkpoint files, for the pipeline-to-dense converter (lifecycle.tasks.train.parallel.pp_convert).

DeepSpeed 0.19.8 (runtime/engine.py `_save_moe_checkpoint`, `load_moe_state_dict`) saves an engine with MoE layers,
pipeline stage or not, as: `mp_rank_<m>_model_states.pt` with the module's state dict *without* the experts (router
included: `<layer>.deepspeed_moe.gate.wg.weight`) and `num_experts` (one entry per MoE layer, a list); one
`layer_<l>_expert_<e>_mp_rank_<m>_model_states.pt` per MoE layer l (counted from 0 on each model-parallel rank m)
and global expert e, holding `<layer>.deepspeed_moe.experts.deepspeed_experts.<e>.<param>` (global id in the key,
the loader maps it back to the local one); and, under ZeRO-0, the torch optimizer state of each expert-parallel
rank's parameters (its shared ones and its own experts) in `expp_rank_<r>_mp_rank_<m>_optim_states.pt`, which the
loader reads instead of the model-states file's copy. The optimizer's parameter groups are the trainer's groups
with the experts split off into groups of their own (`moe: True`, named `ep_size_<ep>`: moe.param_groups).

The converter works in `GPT`'s names (`MoEMLP`: `blocks.i.mlp.gate.weight`, `blocks.i.mlp.experts.<global>.*`);
this module maps a stage's DeepSpeed names into them (`dense_name`) and lays a dense state out as the single-rank
(ep = 1) engine loads it (`single_rank_files`).
"""

from __future__ import annotations

import re

import torch

from lifecycle.tasks.train.config import ModelConfig

DS_EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."
DS_GATE = ".deepspeed_moe.gate.wg."
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def expert_id(name: str) -> int | None:
    """The global expert id of a `GPT` parameter name (None: not an expert's)."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def dense_name(name: str, ep_rank: int, local_experts: int) -> str:
    """A DSMoE parameter name under `GPT`'s prefix (`blocks.1.mlp.deepspeed_moe...`) as `MoEMLP`'s: the local
    expert id i of expert-parallel rank `ep_rank` becomes ep_rank·local_experts + i; other names pass."""
    if DS_EXPERTS in name:
        head, _, rest = name.partition(DS_EXPERTS)
        local, _, tail = rest.partition(".")
        return f"{head}.experts.{ep_rank * local_experts + int(local)}.{tail}"
    return name.replace(DS_GATE, ".gate.")


def moe_layers(cfg: ModelConfig) -> list[str]:
    """Module names of `GPT(cfg)`'s MoE MLPs in block order (DeepSpeed's MoE layer index is the position)."""
    return [f"blocks.{i}.mlp" for i in range(cfg.n_layer) if cfg.moe.is_moe_block(i)]


def ds_name(name: str) -> str:
    """A `GPT` (MoEMLP) name as the single-rank DSMoE's (ep = 1: local expert id = global)."""
    head, sep, rest = name.partition(".mlp.")
    if sep and rest.startswith("experts."):
        return head + ".mlp" + DS_EXPERTS + rest[len("experts."):]
    if sep and rest.startswith("gate."):
        return head + ".mlp" + DS_GATE + rest[len("gate."):]
    return name


def optim_file(ep_rank: int, mp_rank: int) -> str:
    """DeepSpeed's ZeRO-0 optimizer file of an expert-parallel rank (`_get_optimizer_ckpt_name`)."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def single_rank_files(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> tuple[dict, dict[str, dict]]:
    """(the module state without experts, under DSMoE names; {file name: state dict} of every expert file) of
    `weights` (GPT names, every expert) as the single-rank engine (ep = 1, mp rank 0) saves and loads them."""
    module = {ds_name(n): t for n, t in weights.items() if expert_id(n) is None}
    files: dict[str, dict] = {}
    for layer, prefix in enumerate(moe_layers(cfg)):
        for e in range(cfg.moe.num_experts):
            mine = {ds_name(n): t for n, t in weights.items() if n.startswith(f"{prefix}.experts.{e}.")}
            if not mine:
                raise ValueError(f"no weights of expert {e} of {prefix}")
            files[f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"] = mine
    return module, files


def mark_experts(params: dict[str, torch.nn.Parameter], ep: int = 1) -> bool:
    """Mark the expert parameters of {GPT name: parameter} as DeepSpeed's MoE layer does (`allreduce=False`,
    `group_name`), so moe.param_groups splits them off as the trainer's optimizer does; whether there were any."""
    found = False
    for name, p in params.items():
        if expert_id(name) is not None:
            setattr(p, "allreduce", False)  # attributes DeepSpeed's MoE layer sets on its expert parameters
            setattr(p, "group_name", f"ep_size_{ep}")
            found = True
    return found
