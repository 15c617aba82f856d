"""Start from an open model: a Hugging Face checkpoint directory as our decoder (`train.init_from: hf:<dir>`).

Families: `LlamaForCausalLM` (Llama 2 and 3, SmolLM), `MistralForCausalLM` and `Qwen2ForCausalLM`. The tensor
names are the ones lifecycle.tasks.eval.export writes (its table), read the other way: q/k/v rows go into our
fused `attn.qkv` (rows q, k, v; k and v have n_kv_head heads), gate/up rows into `mlp.up`.

`config.json` is read as transformers 4.x writes it (`rope_theta`, `rope_scaling` at the top level) and as 5.x
does (`rope_parameters`). What our model cannot compute exactly is refused when the config is built, before any
work, naming the field and its value: another architecture or `hidden_act`, a `rope_type` other than default
and llama3, sliding-window attention shorter than `seq_len`, Llama's `attention_bias`/`mlp_bias`, a `head_dim`
other than hidden_size / num_attention_heads.

Loading reads one shard at a time and one tensor at a time from it (`safetensors.safe_open`, memory-mapped), so
host memory holds the model plus one parameter, never the checkpoint twice. Every shard's header is checked
(names against the index, shapes against the model) before any weight is copied: a bad checkpoint raises,
naming the file, and nothing is half-loaded. Under ZeRO-3 (`gathered=True`) the model was built under
`deepspeed.zero.Init`, so each rank holds only its partition; each parameter is gathered in turn, rank 0
fills it, and DeepSpeed re-partitions it on leaving `GatheredParameters`.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from lifecycle.core import fs
from lifecycle.core.dataset import RawFile
from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.data.tokenize.base import read_json
from lifecycle.tasks.train.hf_config import (  # noqa: F401  (base_dir, check_base: the import's public names)
    INDEX, SIDE_FILES, HFImportError, base_dir, check_base, model_fields, weight_files,
)

def model_config(directory: str | Path, seq_len: int, dropout: float = 0.0) -> ModelConfig:
    """Our ModelConfig for a checkpoint directory's config.json, at context `seq_len` (hf_config.model_fields)."""
    try:
        return ModelConfig(**model_fields(directory, seq_len, dropout))
    except ValueError as e:
        if isinstance(e, HFImportError):
            raise
        raise HFImportError(f"{Path(directory) / 'config.json'}: {e}") from None


def base_files(directory: str | Path) -> list[RawFile]:
    """The base model's files (config, tokenizer, index, shards) with their sha256: the training run's parent."""
    d = Path(directory).resolve()
    names = [n for n in SIDE_FILES if (d / n).is_file()] + ([INDEX] if (d / INDEX).is_file() else [])
    names += sorted(weight_files(d))
    return [RawFile(path=str(d / n), sha256=fs.sha256_file(d / n), bytes=(d / n).stat().st_size) for n in names]


def hf_names(cfg: ModelConfig) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """{HF tensor name: (our parameter, first row in it, shape)} for a model config."""
    C, kv, Hd, V = cfg.n_embd, cfg.kv_heads * cfg.head_dim, cfg.mlp_hidden, cfg.vocab_size
    out = {"model.embed_tokens.weight": ("wte.weight", 0, (V, C)), "model.norm.weight": ("norm_f.weight", 0, (C,))}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ("lm_head.weight", 0, (V, C))
    for i in range(cfg.n_layer):
        L, b = f"model.layers.{i}.", f"blocks.{i}."
        out |= {L + "input_layernorm.weight": (b + "norm1.weight", 0, (C,)),
                L + "post_attention_layernorm.weight": (b + "norm2.weight", 0, (C,)),
                L + "self_attn.o_proj.weight": (b + "attn.proj.weight", 0, (C, C)),
                L + "mlp.gate_proj.weight": (b + "mlp.up.weight", 0, (Hd, C)),
                L + "mlp.up_proj.weight": (b + "mlp.up.weight", Hd, (Hd, C)),
                L + "mlp.down_proj.weight": (b + "mlp.down.weight", 0, (C, Hd))}
        kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
        for kind in kinds:
            tail = (C,) if kind == "weight" else ()
            out |= {L + f"self_attn.q_proj.{kind}": (b + f"attn.qkv.{kind}", 0, (C, *tail)),
                    L + f"self_attn.k_proj.{kind}": (b + f"attn.qkv.{kind}", C, (kv, *tail)),
                    L + f"self_attn.v_proj.{kind}": (b + f"attn.qkv.{kind}", C + kv, (kv, *tail))}
    return out


def ignored(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that carry nothing for us: old RoPE buffers, a tied head's copy."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")


def check_shards(directory: str | Path, cfg: ModelConfig) -> list[tuple[str, list[str]]]:
    """[(shard path, its tensor names in file order)] after checking every header: the names a shard holds are
    the ones the index lists for it, each is a tensor of our model with our shape, and every tensor of the
    model is somewhere. Reads headers only."""
    from safetensors import safe_open

    d, expected, seen, plan = Path(directory), hf_names(cfg), set(), []
    for f, listed in weight_files(d).items():
        with safe_open(str(d / f), framework="pt") as sf:
            names = list(sf.keys())
            if listed is not None and set(names) != set(listed):
                extra, gone = sorted(set(names) - set(listed)), sorted(set(listed) - set(names))
                raise HFImportError(f"{d / f}: tensors do not match {d / INDEX}: missing {gone[:5]}"
                                    f"{' ...' if len(gone) > 5 else ''}, not in the index {extra[:5]}")
            for n in names:
                if ignored(n, cfg):
                    continue
                if n not in expected:
                    raise HFImportError(f"{d / f}: tensor {n!r} is not part of the model config.json describes")
                shape = tuple(sf.get_slice(n).get_shape())
                if shape != expected[n][2]:
                    raise HFImportError(f"{d / f}: tensor {n!r} has shape {list(shape)}, config.json implies "
                                        f"{list(expected[n][2])}")
                seen.add(n)
        plan.append((str(d / f), [n for n in names if not ignored(n, cfg)]))
    if missing := sorted(set(expected) - seen):
        raise HFImportError(f"{d}: the checkpoint lacks {len(missing)} tensor(s) of the model: {missing[:5]}")
    return plan


def load_weights(model, directory: str | Path, gathered: bool = False, rank: int = 0) -> None:
    """Fill `model` (our GPT for `model_config(directory)`) from the checkpoint, shard by shard. A parameter that
    is split over several HF tensors (qkv, gate/up) is assigned once all its rows have arrived, so under ZeRO-3
    (`gathered=True`) each parameter is gathered once; only `rank` 0 reads tensor data then."""
    import torch

    cfg = model.cfg
    plan, names = check_shards(directory, cfg), hf_names(cfg)
    params = dict(model.named_parameters())
    parts: dict[str, list[str]] = defaultdict(list)
    for hf, (ours, _, _) in names.items():
        parts[ours].append(hf)
    pending: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for path, tensor_names in plan:
        with torch.no_grad(), safe_open_pt(path) as sf:
            for n in tensor_names:
                ours, row, _ = names[n]
                pending[ours][row] = sf.get_tensor(n) if rank == 0 or not gathered else None
                if len(pending[ours]) == len(parts[ours]):
                    rows = pending.pop(ours)
                    assign(params[ours], rows, gathered, rank)


def safe_open_pt(path: str):
    from safetensors import safe_open

    return safe_open(path, framework="pt")


def assign(param, rows: dict, gathered: bool, rank: int) -> None:
    """Copy the row blocks {first row: tensor} into `param` (gathered and re-partitioned under ZeRO-3)."""
    import torch

    def fill() -> None:
        for row, t in rows.items():
            param.data[row: row + t.shape[0]].copy_(t.to(param.dtype))

    if not gathered:
        fill()
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
        if rank == 0:
            fill()


def load_hf(directory: str | Path, seq_len: int | None = None):
    """Our GPT with a checkpoint directory's weights (fp32, CPU), for tests, the bench and the export check.
    `seq_len` null = the config's max_position_embeddings."""
    import torch

    from lifecycle.tasks.train.model import GPT

    if seq_len is None:
        seq_len = read_json(Path(directory) / "config.json").get("max_position_embeddings", 2048)
    cfg = model_config(directory, seq_len)
    with torch.device("meta"):  # no random init of weights that are overwritten next
        model = GPT(cfg)
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    load_weights(model, directory)
    return model.eval()
