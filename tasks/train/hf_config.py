"""A Hugging Face checkpoint directory's config.json read as our model's fields, and its weight files listed: what
`train.init_from: hf:<dir>` checks while the config is built, before any work (torch-free, and free of
lifecycle.tasks.train.config, which calls it; hf_import.py loads the weights).

What our model cannot compute exactly is refused here, naming the field and its value: another architecture or
`hidden_act`, a `rope_type` other than default and llama3, sliding-window attention shorter than `seq_len`,
Llama's `attention_bias`/`mlp_bias`, a `head_dim` other than hidden_size / num_attention_heads.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

from lifecycle.tasks.data.tokenize.base import BaseTokenizerError, base_tokens, read_json

PREFIX = "hf:"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json")


class HFImportError(ValueError):
    """A checkpoint directory that cannot be loaded exactly; the message names the file and the field."""


def base_dir(init_from: str) -> Path | None:
    """The directory of `train.init_from: hf:<dir>`, or None for scratch/champion."""
    return Path(init_from[len(PREFIX):]).expanduser().resolve() if init_from.startswith(PREFIX) else None


# --------------------------------------------------------------------------------------------------
# config.json -> ModelConfig fields


def rope_of(cfg: dict, where: Path) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from 5.x `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    if cfg.get("rope_parameters") is not None:
        params, field = cfg["rope_parameters"], "rope_parameters"
        if "rope_theta" not in params:
            raise HFImportError(f"{where}: rope_parameters={params!r} has no rope_theta (per-layer-type RoPE is "
                                f"not supported)")
        theta = params["rope_theta"]
    else:
        params, field = cfg.get("rope_scaling") or {}, "rope_scaling"
        theta = cfg.get("rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise HFImportError(f"{where}: {field}.rope_type={kind!r} is not supported (our model computes "
                            f"'default' and 'llama3' RoPE exactly)")
    try:
        return float(theta), {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                     "original_max_position_embeddings")}
    except KeyError as e:
        raise HFImportError(f"{where}: {field} is not a valid llama3 scaling: missing {e}") from None


def model_fields(directory: str | Path, seq_len: int, dropout: float = 0.0) -> dict:
    """The fields of our ModelConfig for a checkpoint directory's config.json, at context `seq_len`; refuses
    (naming the field and value) whatever our model would not compute exactly. `model_config` makes them a
    ModelConfig; `TrainConfig` does so while it is validated."""
    where = Path(directory) / "config.json"
    try:
        cfg = read_json(where)
    except BaseTokenizerError as e:
        raise HFImportError(str(e)) from None
    mt = cfg.get("model_type")
    if mt not in ARCHITECTURES:
        raise HFImportError(f"{where}: model_type={mt!r} is not supported (supported: "
                            f"{', '.join(f'{k} ({v})' for k, v in ARCHITECTURES.items())})")
    archs = cfg.get("architectures") or [ARCHITECTURES[mt]]
    if archs != [ARCHITECTURES[mt]]:
        raise HFImportError(f"{where}: architectures={archs!r} is not supported (expected [{ARCHITECTURES[mt]!r}])")
    _check_sizes(cfg, where)
    refuse = []
    if cfg.get("hidden_act", "silu") != "silu":
        refuse.append(f"hidden_act={cfg['hidden_act']!r} (our SwiGLU uses silu)")
    C, H = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, C // H) or C % H:
        refuse.append(f"head_dim={cfg.get('head_dim')!r} (ours is hidden_size/num_attention_heads = {C / H:g})")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            refuse.append(f"{key}={cfg[key]!r}")
    window = cfg.get("sliding_window")
    sliding = mt == "mistral" or cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or [])
    if sliding and window is not None and window < seq_len:
        refuse.append(f"sliding_window={window} (shorter than seq_len {seq_len}: our attention is full causal)")
    if cfg.get("max_position_embeddings", seq_len) < seq_len:
        refuse.append(f"max_position_embeddings={cfg['max_position_embeddings']} (below train.model.seq_len "
                      f"{seq_len})")
    if refuse:
        raise HFImportError(f"{where}: cannot be computed exactly by our model: " + "; ".join(refuse))
    theta, scaling = rope_of(cfg, where)
    kv = cfg.get("num_key_value_heads") or H
    try:
        return dict(vocab_size=cfg["vocab_size"], n_layer=cfg["num_hidden_layers"], n_head=H, n_embd=C,
                    seq_len=seq_len, norm="rmsnorm", mlp="swiglu", pos="rope", dropout=dropout, init="normal",
                    tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), rope_theta=theta,
                    norm_eps=cfg.get("rms_norm_eps", 1e-6), n_kv_head=None if kv == H else kv,
                    qkv_bias=mt == "qwen2", mlp_hidden_dim=cfg["intermediate_size"], rope_scaling=scaling)
    except KeyError as e:
        raise HFImportError(f"{where}: missing field {e.args[0]!r}") from None


SIZE_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")


def _check_sizes(cfg: dict, where: Path) -> None:
    """The size fields are whole numbers >= 1, and the weights fit the host's memory at 2 bytes a parameter (every
    rank reads them through it): a config.json claiming a million layers is refused here, naming the numbers,
    instead of ranks allocating until the kernel kills them, and the retry doing it again."""
    for key in (*SIZE_FIELDS, "num_key_value_heads"):
        value = cfg.get(key)
        if key == "num_key_value_heads" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise HFImportError(f"{where}: {key}={value!r} (a whole number >= 1 is required)")
    d, layers, ffn, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    kv_dim = d // cfg["num_attention_heads"] * (cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    params = layers * (2 * d * d + 2 * d * kv_dim + 3 * d * ffn) + vocab * d * (1 if cfg.get("tie_word_embeddings") else 2)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 2 * params > host:
        raise HFImportError(f"{where}: num_hidden_layers={layers}, hidden_size={d}, intermediate_size={ffn}, "
                            f"vocab_size={vocab} make about {params:.3g} parameters, {2 * params / 2**30:.1f} GiB in "
                            f"bf16, more than this host's {host / 2**30:.1f} GiB of memory")


def _inside(d: Path, name: str, what: str) -> Path:
    """`d / name`, refused when `name` is absolute, climbs out of `d`, or is a symlink leading out of it."""
    path = d / name
    if Path(name).is_absolute() or not path.resolve().is_relative_to(d.resolve()):
        raise HFImportError(f"{d}: {what} {name!r} lies outside the checkpoint directory (symlinks and paths out "
                            "of it are refused)")
    return path


def check_base(directory: str | Path, seq_len: int) -> dict:
    """Everything checkable before work starts: the config, the tokenizer against the embedding, the shards'
    presence. Returns the model config's fields."""
    for name in (*SIDE_FILES, INDEX, SINGLE):  # what the run reads and hashes into its config and MLflow
        if (Path(directory) / name).is_symlink() or (Path(directory) / name).exists():
            _inside(Path(directory), name, "file")
    mcfg = model_fields(directory, seq_len)
    try:
        base_tokens(directory)
    except BaseTokenizerError as e:
        raise HFImportError(str(e)) from None
    weight_files(directory)
    return mcfg


# --------------------------------------------------------------------------------------------------
# the weight files


def weight_files(directory: str | Path) -> dict[str, list[str] | None]:
    """{shard file: tensor names the index lists for it (None for a single model.safetensors)}; every listed
    shard must exist."""
    d = Path(directory)
    if (d / INDEX).is_file():
        try:
            wmap = json.loads((d / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise HFImportError(f"{d / INDEX}: not a safetensors index ({e!r})") from None
        files: dict[str, list[str]] = defaultdict(list)
        for name, f in wmap.items():
            files[f].append(name)
        for f in files:
            if not _inside(d, f, f"shard listed in {INDEX}").is_file():
                raise HFImportError(f"{d / f}: shard listed in {d / INDEX} is missing")
        return dict(files)
    if (d / SINGLE).is_file():
        return {SINGLE: None}
    raise HFImportError(f"{d}: neither {SINGLE} nor {INDEX} (only safetensors checkpoints are read)")
