"""Export a committed checkpoint to the Hugging Face format: `lifecycle export hf CHECKPOINT OUT_DIR`.

The command reads CHECKPOINT and --tokenizer only inside the run's work dir (named as for every command: CONFIG,
--workdir or $LIFECYCLE_WORKDIR) or an --input-root; paths are resolved, symlinks followed (lifecycle/core/paths.py).
It writes OUT_DIR wherever the user says, but not into a folder that holds anything unless --force. The files are
written with the mode the umask gives (0644 under the usual 022), not safetensors' private 0600.

Our default decoder (tasks/train/model.py: pre-norm RMSNorm, SwiGLU, rotary embeddings, no biases, optionally tied
embeddings) is exactly `transformers.LlamaForCausalLM`, so the export is a renaming of tensors plus a
`LlamaConfig`; no weight is changed except by slicing:

| ours                                  | LlamaForCausalLM                                   |
|---------------------------------------|----------------------------------------------------|
| wte.weight                            | model.embed_tokens.weight                          |
| blocks.i.norm1 / norm2 (RMSNorm)      | model.layers.i.input_layernorm / post_attention_layernorm |
| blocks.i.attn.qkv (rows q, k, v)      | model.layers.i.self_attn.q_proj / k_proj / v_proj  |
| blocks.i.attn.proj                    | model.layers.i.self_attn.o_proj                    |
| blocks.i.mlp.up (rows gate, up)       | model.layers.i.mlp.gate_proj / up_proj             |
| blocks.i.mlp.down                     | model.layers.i.mlp.down_proj                       |
| norm_f, lm_head (absent when tied)    | model.norm, lm_head (tie_word_embeddings)          |

RoPE convention: `apply_rope` rotates the pair (channel j, channel j + head_dim/2) with inv_freq
theta^(-j/(head_dim/2)) = theta^(-2j/head_dim); that is HF's `rotate_half` layout and its default inv_freq, so
q/k need no permutation (the permutation in HF's convert_llama_weights_to_hf.py is for Meta's interleaved
layout, which we do not use). Both norms compute in fp32 and cast back before the weight multiply.

A mixture of experts (`model_config.json` has `moe`, lifecycle.tasks.train.parallel.moe) is
`MixtralForCausalLM`: Llama attention and norms, and per block a `block_sparse_moe` with a router `gate` (E × C) and
experts w1 (gate), w3 (up), w2 (down) of a SwiGLU MLP:

| ours                                       | MixtralForCausalLM (the hub's layout; transformers fuses it on load) |
|--------------------------------------------|-----------------------------------------------------------------------|
| blocks.i.mlp.gate                          | model.layers.i.block_sparse_moe.gate                                  |
| blocks.i.mlp.experts.j.up (rows gate, up)  | model.layers.i.block_sparse_moe.experts.j.w1 / w3                     |
| blocks.i.mlp.experts.j.down                | model.layers.i.block_sparse_moe.experts.j.w2                          |

Mixtral's router is softmax over the experts, top-k, renormalised over the k: for top_k >= 2 that is our router
(DeepSpeed's TopKGate without capacity drops; see parallel/moe.py). For top_k=1 Mixtral's weight is 1 and ours is
the router probability, so a top-1 model is refused; so is an MoE MLP in only some blocks (`moe.every` > 1:
Mixtral has one in every layer) and a q/k/v bias (Mixtral has none).

The GPT-2 recipe (LayerNorm, GELU, learned positions) is refused: no HF architecture computes
exactly what those configs compute (HF GPT-2 has biases, a different module layout and GELU variants), so an
export would silently change the model's outputs.

After writing, the export is loaded back with `AutoModelForCausalLM` and its fp32 logits are compared with our
model's on val-like random token ids; the max abs difference is written to `lifecycle_export.json` and the
export fails above `tolerance`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lifecycle.core.dataset import DatasetRef

from lifecycle.core.errors import UsageError
from lifecycle.core.fs import atomic_write_json, sha256_file
from lifecycle.core.paths import resolve_within
from lifecycle.tasks.train import commit as ckpt

TOLERANCE = 1e-4


class ExportError(ValueError):
    """A checkpoint that cannot be exported exactly, or an export whose logits differ from ours."""


def check_exportable(cfg) -> None:
    problems = []
    if cfg.norm != "rmsnorm":
        problems.append(f"norm={cfg.norm!r} (LlamaForCausalLM has RMSNorm only)")
    if cfg.mlp != "swiglu":
        problems.append(f"mlp={cfg.mlp!r} (LlamaForCausalLM has SwiGLU only)")
    if cfg.pos != "rope":
        problems.append(f"pos={cfg.pos!r} (LlamaForCausalLM has rotary positions only)")
    if cfg.moe is not None:
        if cfg.moe.top_k < 2:
            problems.append(f"moe.top_k={cfg.moe.top_k} (Mixtral weighs a top-1 expert by 1, ours by its router "
                            "probability)")
        if cfg.moe.every != 1:
            problems.append(f"moe.every={cfg.moe.every} (MixtralForCausalLM has an MoE MLP in every layer)")
        if cfg.qkv_bias:
            problems.append("qkv_bias=True (MixtralForCausalLM has no attention bias)")
    if problems:
        raise ExportError("cannot export this model exactly to a Hugging Face architecture: " + "; ".join(problems)
                          + ". Only the Llama recipe (norm=rmsnorm, mlp=swiglu, pos=rope) maps onto LlamaForCausalLM.")


def hf_architecture(cfg) -> str:
    """The transformers class that computes our model: Mixtral for a mixture of experts, Qwen2 when q/k/v carry a
    bias (Llama's `attention_bias` would put one on o_proj too), Llama otherwise (Mistral without a sliding
    window is the same model)."""
    if cfg.moe is not None:
        return "MixtralForCausalLM"
    return "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"


def llama_config(cfg, eos_id: int | None, pad_id: int | None, bos_id: int | None = None) -> dict:
    """LlamaConfig (or Qwen2Config, see `hf_architecture`) kwargs for a lifecycle.tasks.train.model ModelConfig."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope |= {"rope_type": "llama3", **cfg.rope_scaling.model_dump(exclude={"type"})}
    out = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope, attention_dropout=0.0, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=eos_id if bos_id is None else bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        torch_dtype="float32",
    )
    if cfg.moe is not None:  # MixtralConfig: no attention/mlp bias fields; experts dropless at inference
        return out | dict(sliding_window=None, num_local_experts=cfg.moe.num_experts,
                          num_experts_per_tok=cfg.moe.top_k, router_jitter_noise=0.0, output_router_logits=False)
    if cfg.qkv_bias:
        return out | dict(use_sliding_window=False, sliding_window=None)
    return out | dict(attention_bias=False, mlp_bias=False)


def to_llama_state(state: dict, cfg) -> dict:
    """Our `export_state()` tensors under LlamaForCausalLM names (fused q/k/v and gate/up rows split); the
    names are the same for Qwen2ForCausalLM, which adds the q/k/v biases."""
    C, H, KV = cfg.n_embd, cfg.mlp_hidden, cfg.kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": state["wte.weight"], "model.norm.weight": state["norm_f.weight"]}
    for i in range(cfg.n_layer):
        b, L = f"blocks.{i}.", f"model.layers.{i}."
        out |= {
            L + "input_layernorm.weight": state[b + "norm1.weight"],
            L + "post_attention_layernorm.weight": state[b + "norm2.weight"],
            L + "self_attn.o_proj.weight": state[b + "attn.proj.weight"],
        }
        if cfg.moe is not None:  # Mixtral: block_sparse_moe.gate and experts j: w1 = gate, w3 = up, w2 = down
            M = L + "block_sparse_moe."
            out[M + "gate.weight"] = state[b + "mlp.gate.weight"]
            for j in range(cfg.moe.num_experts):
                up = state[b + f"mlp.experts.{j}.up.weight"]
                out |= {M + f"experts.{j}.w1.weight": up[:H], M + f"experts.{j}.w3.weight": up[H:],
                        M + f"experts.{j}.w2.weight": state[b + f"mlp.experts.{j}.down.weight"]}
        else:
            up = state[b + "mlp.up.weight"]
            out |= {L + "mlp.gate_proj.weight": up[:H], L + "mlp.up_proj.weight": up[H:],
                    L + "mlp.down_proj.weight": state[b + "mlp.down.weight"]}
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            qkv = state[b + f"attn.qkv.{kind}"]
            out |= {L + f"self_attn.q_proj.{kind}": qkv[:C], L + f"self_attn.k_proj.{kind}": qkv[C: C + KV],
                    L + f"self_attn.v_proj.{kind}": qkv[C + KV:]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def find_tokenizer(checkpoint: Path) -> Path:
    """tokenizer.json for a checkpoint: beside it (a packaged model), else the work dir's tokenize dataset
    whose sha256 the commit marker names (checked against the marker's tokenizer digest)."""
    if (checkpoint / "tokenizer.json").is_file():
        return checkpoint / "tokenizer.json"
    marker = ckpt.read_marker(checkpoint)
    for parent in checkpoint.resolve().parents:
        for d in sorted((parent / "datasets" / "tokenize").glob("*/")):
            if (d / "_manifest.json").is_file() and DatasetRef.from_dir(d).sha256 == marker.get("dataset_sha256"):
                tok = d / "tokenizer.json"
                if marker.get("tokenizer_sha256") not in (None, sha256_file(tok)):
                    raise ExportError(f"{tok} does not match the tokenizer digest in {checkpoint}/COMMITTED.json")
                return tok
    raise ExportError(f"no tokenizer found for {checkpoint}: pass --tokenizer PATH/tokenizer.json")


def special_tokens(tok_path: Path) -> dict:
    """eos/bos/pad token strings for the tokenizer: from the tokenizer_config.json the tokenize stage wrote beside
    it (a base model's own tokens, `tokenize.base_model`), else our trained BPE's `<|endoftext|>`/`<|pad|>`."""
    side = tok_path.parent / "tokenizer_config.json"
    if side.is_file():
        conf = json.loads(side.read_text())
        return {k: conf.get(k) for k in ("eos_token", "bos_token", "pad_token")}
    return {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "pad_token": "<|pad|>"}


def _verify_package(checkpoint: Path) -> None:
    """A checkpoint tag dir is verified by its marker; a packaged model (checkpoint dataset) by the marker's
    hashes of the two files it copied."""
    if (checkpoint / "_manifest.json").is_file():
        listed = {f["path"]: f["sha256"] for f in ckpt.read_marker(checkpoint)["files"]}
        for name in (ckpt.WEIGHTS, ckpt.MODEL_CONFIG):
            if sha256_file(checkpoint / name) != listed.get(name):
                raise ExportError(f"{checkpoint / name}: sha256 does not match its commit marker")
    elif (reason := ckpt.verify(checkpoint)) is not None:
        raise ExportError(f"checkpoint {checkpoint} is not usable: {reason}")


def max_logit_diff(ours, hf_dir: Path, vocab_size: int, seq_len: int, seed: int = 0) -> float:
    """Max |logits_ours - logits_hf| in fp32 on random ids (batch 2, full context)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ids = torch.randint(0, vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        a, _ = ours(ids)
        b = hf(input_ids=ids).logits
    return (a.float() - b.float()).abs().max().item()


def export_hf(checkpoint: str | Path, out_dir: str | Path, tokenizer: str | Path | None = None,
              tolerance: float = TOLERANCE) -> dict:
    """Write model.safetensors, config.json and the tokenizer files into out_dir; check the logits."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, MixtralConfig, PreTrainedTokenizerFast, Qwen2Config

    checkpoint, out = Path(checkpoint), Path(out_dir)
    if not (checkpoint / ckpt.MARKER).is_file():
        raise ExportError(f"{checkpoint} is not a committed checkpoint (no {ckpt.MARKER})")
    _verify_package(checkpoint)
    model = ckpt.load_model(checkpoint, check=False)
    check_exportable(model.cfg)
    tok_path = Path(tokenizer) if tokenizer else find_tokenizer(checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    specials = special_tokens(tok_path)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_path), **specials)
    eos, pad = (hf_tok.convert_tokens_to_ids(specials[k]) if specials.get(k) else None for k in ("eos_token", "pad_token"))
    bos = hf_tok.convert_tokens_to_ids(specials["bos_token"]) if specials.get("bos_token") else None
    hf_tok.model_max_length = model.cfg.seq_len
    hf_tok.save_pretrained(str(out))
    arch = hf_architecture(model.cfg)
    config_class = {"Qwen2ForCausalLM": Qwen2Config, "MixtralForCausalLM": MixtralConfig}.get(arch, LlamaConfig)
    config = config_class(**llama_config(model.cfg, eos, pad, bos))
    config.architectures = [arch]
    config.save_pretrained(str(out))
    save_file(to_llama_state(model.export_state(), model.cfg), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    _umask_mode(out)
    diff = max_logit_diff(model, out, model.cfg.vocab_size, model.cfg.seq_len)
    report = {"checkpoint": str(checkpoint.resolve()), "out_dir": str(out.resolve()), "architecture": arch,
              "checkpoint_marker_sha256": sha256_file(checkpoint / ckpt.MARKER),
              "tokenizer": str(tok_path), "tokenizer_sha256": sha256_file(tok_path),
              "max_abs_logit_diff_fp32": diff, "tolerance": tolerance}
    atomic_write_json(out / "lifecycle_export.json", report)
    if not diff <= tolerance:
        raise ExportError(f"exported model's logits differ from ours by {diff:.3g} > {tolerance} (left in {out})")
    return report


# --------------------------------------------------------------------------------------------------
# CLI: `lifecycle export hf CHECKPOINT OUT_DIR`


def _umask_mode(out: Path) -> None:
    """Give the files written into `out` the mode a plain `open` gives (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        if f.is_file() and not f.is_symlink():
            f.chmod(0o666 & ~umask)


def confined_args(args) -> tuple[Path, Path, Path | None]:
    """CHECKPOINT and --tokenizer resolved inside the work dir or an --input-root; OUT_DIR anywhere, but a folder
    that holds files only with --force."""
    roots = [args.workdir, *(args.input_root or [])]
    checkpoint = resolve_within(args.checkpoint, roots, "CHECKPOINT is not inside --workdir or an --input-root")
    tokenizer = args.tokenizer and resolve_within(args.tokenizer, roots,
                                                  "--tokenizer is not inside --workdir or an --input-root")
    out = Path(args.out_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT_DIR {args.out_dir} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UsageError(f"OUT_DIR {args.out_dir} is not empty: pass --force to write into it (files of the same "
                         "name are replaced)")
    return checkpoint, out, tokenizer


def cmd_export_hf(args) -> int:
    return reported(args, lambda: export_hf(*confined_args(args)), lambda r: (
        f"exported {r['checkpoint']} -> {r['out_dir']} ({r['architecture']})\n"
        f"  max |logit difference| vs our model, fp32: {r['max_abs_logit_diff_fp32']:.3g} (tolerance {r['tolerance']})\n"
        f"  load: transformers.AutoModelForCausalLM.from_pretrained({r['out_dir']!r})"))


def reported(args, export, describe) -> int:
    """Run `export()`, print its report (one JSON object under --json, else `describe(report)`); a refused export
    is one line and exit 2 (lifecycle/cli.py), as a missing file or a refused path."""
    try:
        report = export()
    except ExportError as e:
        raise UsageError(str(e)) from e
    print(json.dumps({"status": "ok", **report}) if args.json else describe(report))
    return 0


def register(sub, run=cmd_export_hf) -> None:
    """The `export` command; `run` handles `export hf` (lifecycle.tasks.clip.export's, which hands everything but a
    clip_train package back to `cmd_export_hf`)."""
    export = sub.add_parser("export", help="Export a checkpoint to another ecosystem's format.")
    fmt = export.add_subparsers(dest="format", required=True)
    hf = fmt.add_parser("hf", help="Hugging Face format (safetensors, config, tokenizer), loadable with "
                                   "transformers.AutoModelForCausalLM (a CLIP package: transformers.CLIPModel).")
    hf.add_argument("checkpoint", help="a committed checkpoint (train/.../checkpoints/step_N), a packaged model "
                                       "(datasets/checkpoint/<fp>) or a dual encoder (datasets/clip_train/<fp>)")
    hf.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write (anywhere; refused when not empty, "
                                                         "unless --force)")
    hf.add_argument("--force", action="store_true", help="write into OUT_DIR even if it holds files")
    hf.add_argument("--tokenizer", help="tokenizer.json (default: found from the checkpoint's commit marker)")
    hf.add_argument("--input-root", action="append", metavar="DIR",
                    help="another directory CHECKPOINT and --tokenizer may be read from. Repeatable.")
    hf.add_argument("--json", action="store_true", help="Print one JSON object.")
    hf.set_defaults(func=run, names_run=True, path_arg="checkpoint")  # CONFIG/--workdir: CHECKPOINT and --tokenizer lie in it


def load_model_dir(model_dir: str | Path, tokenizer: str | Path | None = None):
    """(model, tokenizer) from a packaged model (the registry's champion points at one) or a committed
    checkpoint; the tokenizer is found as `lifecycle export hf` finds it unless given."""
    from tokenizers import Tokenizer

    model_dir = Path(model_dir)
    if not (model_dir / ckpt.MODEL_CONFIG).is_file():
        raise UsageError(f"--model {model_dir}: no {ckpt.MODEL_CONFIG} (expected a committed checkpoint "
                         "train/.../checkpoints/step_N or a packaged model datasets/checkpoint/<fp>)")
    try:
        _verify_package(model_dir)  # the marker's hashes, of a checkpoint or of a packaged model's copies
        tok_path = Path(tokenizer) if tokenizer else find_tokenizer(model_dir)
    except ExportError as e:
        raise UsageError(str(e)) from e
    return ckpt.load_model(model_dir, check=False), Tokenizer.from_file(str(tok_path))
