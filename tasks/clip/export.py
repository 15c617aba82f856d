"""Export a clip_train model package to transformers' `CLIPModel`: `lifecycle export hf PACKAGE OUT_DIR`, the text
model's command (tasks/eval/export.py), given a `datasets/clip_train/<fp>` directory.

Our dual encoder (tasks/clip/model.py) with `image_pre_norm: true` and `text_pool: eot` (the defaults) computes what
`CLIPModel` computes with `hidden_act="gelu"` (exact erf GELU, not CLIP's quick_gelu) and LayerNorm eps 1e-5, so
the export is a renaming of tensors plus a `CLIPConfig`:

| ours                                      | CLIPModel                                                      |
|-------------------------------------------|----------------------------------------------------------------|
| image.patch (Conv2d with a bias)          | vision_model.embeddings.patch_embedding (no bias: see below)   |
| image.cls, image.pos                      | vision_model.embeddings.class_embedding, position_embedding    |
| image.pre / image.norm                    | vision_model.pre_layrnorm / post_layernorm (class token only)  |
| image.proj, text.proj                     | visual_projection, text_projection (no bias either side)       |
| text.tok, text.pos                        | text_model.embeddings.token_embedding, position_embedding      |
| text.norm                                 | text_model.final_layer_norm                                    |
| <tower>.blocks.layers.i.norm1 / norm2     | <tower>_model.encoder.layers.i.layer_norm1 / layer_norm2       |
| ... self_attn.in_proj (rows q, k, v)      | ... self_attn.q_proj / k_proj / v_proj (with biases)           |
| ... self_attn.out_proj                    | ... self_attn.out_proj                                         |
| ... linear1 / linear2                     | ... mlp.fc1 / mlp.fc2                                          |
| logit_scale (clamped at log 100 in use)   | logit_scale (never clamped: the clamped value is written)      |

- Our patch convolution has a bias, CLIP's has none. The bias adds the same vector to every patch embedding and
  not to the class token, so it is added to the patch positions of the position embedding instead: the same sum.
- The text tower's padding id is `vocab_size`, one past the caption tokenizer; its first copy after the caption is
  the end-of-text token we pool at. The config's `eos_token_id` and `pad_token_id` are that id, and CLIPTextModel
  pools at the first position holding `eos_token_id`: the same token. The vocabulary exported is `vocab_size + 1`.
- A model trained before `image_pre_norm` / `text_pool` existed (its model_config.json lacks them) has no
  pre-norm, or pools at the caption's last token: CLIPModel cannot compute either, so it is refused, naming why.

The tokenizer is exported as a `PreTrainedTokenizerFast` that appends the end-of-text token (`<|eot|>`, id
`vocab_size`), truncates to `context` and pads with it: `tokenizer(captions, padding="max_length",
truncation=True)` gives the ids our model reads. `preprocessor_config.json` is a `CLIPImageProcessor` with our
normalisation and size (tasks/clip/augment.py: bicubic resize, CLIP's mean and std). After writing, the export is
loaded back with `CLIPModel.from_pretrained` and its `logits_per_image` on real images and captions (the first
pairs of the package's image_preprocess dataset) are compared with ours; the largest difference relative to the
largest logit goes into `lifecycle_export.json`, and the export fails above `TOLERANCE`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from lifecycle.core.dataset import DatasetRef
from lifecycle.core.fs import atomic_write_json, sha256_file
from lifecycle.tasks.clip.config import ClipModelConfig

TOLERANCE = 1e-5
EOT = "<|eot|>"
NAME = "clip_train"


def is_clip_package(path: Path) -> bool:
    """Whether `path` is a committed clip_train dataset (what `lifecycle export hf` hands to `export_clip`)."""
    try:
        return json.loads((path / "_manifest.json").read_text()).get("stage") == NAME
    except (OSError, ValueError):
        return False


def refusals(c: ClipModelConfig) -> list[str]:
    out = []
    if not c.image_pre_norm:
        out.append("image_pre_norm=false (CLIPVisionModel always applies pre_layrnorm to the embeddings)")
    if c.text_pool != "eot":
        out.append(f"text_pool={c.text_pool!r} (CLIPTextModel pools at an end-of-text token, not at the caption's "
                   "last token)")
    return out


def clip_config(c: ClipModelConfig, logit_scale: float):
    from transformers import CLIPConfig

    common = dict(hidden_act="gelu", layer_norm_eps=1e-5, attention_dropout=0.0, projection_dim=c.embed_dim,
                  num_attention_heads=c.heads)
    text = dict(common, vocab_size=c.vocab_size + 1, hidden_size=c.text_width, intermediate_size=4 * c.text_width,
                num_hidden_layers=c.text_layers, max_position_embeddings=c.context, pad_token_id=c.vocab_size,
                eos_token_id=c.vocab_size, bos_token_id=c.vocab_size)
    vision = dict(common, hidden_size=c.width, intermediate_size=4 * c.width, num_hidden_layers=c.layers,
                  image_size=c.image_size, patch_size=c.patch, num_channels=3)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=c.embed_dim,
                        logit_scale_init_value=logit_scale)
    config.architectures = ["CLIPModel"]
    return config


def _blocks(state: dict, ours: str, theirs: str, layers: int, width: int) -> dict:
    out = {}
    for i in range(layers):
        b, L = f"{ours}.blocks.layers.{i}.", f"{theirs}.encoder.layers.{i}."
        for kind in ("weight", "bias"):
            qkv = state[b + f"self_attn.in_proj_{kind}"]
            out |= {L + f"self_attn.q_proj.{kind}": qkv[:width], L + f"self_attn.k_proj.{kind}": qkv[width:2 * width],
                    L + f"self_attn.v_proj.{kind}": qkv[2 * width:],
                    L + f"self_attn.out_proj.{kind}": state[b + f"self_attn.out_proj.{kind}"],
                    L + f"layer_norm1.{kind}": state[b + f"norm1.{kind}"],
                    L + f"layer_norm2.{kind}": state[b + f"norm2.{kind}"],
                    L + f"mlp.fc1.{kind}": state[b + f"linear1.{kind}"], L + f"mlp.fc2.{kind}": state[b + f"linear2.{kind}"]}
    return out


def to_clip_state(state: dict, c: ClipModelConfig, max_scale: float) -> dict:
    """Our `export_state()` tensors under CLIPModel names (the patch bias folded into the patch positions)."""
    pos = state["image.pos"][0].clone()
    pos[1:] += state["image.patch.bias"]
    out = {"vision_model.embeddings.patch_embedding.weight": state["image.patch.weight"],
           "vision_model.embeddings.class_embedding": state["image.cls"].reshape(c.width),
           "vision_model.embeddings.position_embedding.weight": pos,
           "visual_projection.weight": state["image.proj.weight"],
           "text_model.embeddings.token_embedding.weight": state["text.tok.weight"],
           "text_model.embeddings.position_embedding.weight": state["text.pos"][0],
           "text_projection.weight": state["text.proj.weight"],
           "logit_scale": state["logit_scale"].reshape(()).clamp(max=max_scale)}
    for kind in ("weight", "bias"):
        out |= {f"vision_model.pre_layrnorm.{kind}": state[f"image.pre.{kind}"],
                f"vision_model.post_layernorm.{kind}": state[f"image.norm.{kind}"],
                f"text_model.final_layer_norm.{kind}": state[f"text.norm.{kind}"]}
    out |= _blocks(state, "image", "vision_model", c.layers, c.width)
    out |= _blocks(state, "text", "text_model", c.text_layers, c.text_width)
    return {k: v.contiguous().clone() for k, v in out.items()}


def hf_tokenizer(tok_path: Path, c: ClipModelConfig):
    """Our caption tokenizer as a PreTrainedTokenizerFast that ends each caption with the end-of-text token (id
    `vocab_size`), truncates to `context` and pads with the same token."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(tok_path))
    if tok.get_vocab_size() != c.vocab_size:
        raise ValueError(f"{tok_path} has {tok.get_vocab_size()} tokens, the model {c.vocab_size}: the end-of-text "
                         "token would not get the model's padding id")
    tok.add_special_tokens([EOT])
    tok.post_processor = TemplateProcessing(single=f"$A {EOT}", special_tokens=[(EOT, c.vocab_size)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT, model_max_length=c.context)


def image_processor(c: ClipModelConfig):
    from transformers import CLIPImageProcessorPil  # the PIL backend: CLIPImageProcessor wants torchvision

    from lifecycle.tasks.clip.augment import MEAN, STD

    return CLIPImageProcessorPil(size={"shortest_edge": c.image_size},
                                 crop_size={"height": c.image_size, "width": c.image_size},
                                 image_mean=MEAN.tolist(), image_std=STD.tolist(), resample=3, do_convert_rgb=True)


def sample_pairs(images: DatasetRef, c: ClipModelConfig, n: int = 8):
    """(pixel tensor, caption ids) of the first `n` pairs of an image_preprocess dataset, as our model reads them."""
    import numpy as np
    import torch

    from lifecycle.tasks.clip.augment import decode
    from lifecycle.tasks.clip.loader import Pairs
    from lifecycle.tasks.clip.model import caption_tokens

    pairs = Pairs(images.dir)
    try:
        rows = list(range(min(n, len(pairs.ids))))
        pixels = np.stack([decode(pairs.read(r), c.image_size) for r in rows])
        return torch.from_numpy(pixels), caption_tokens([pairs.tokens[r] for r in rows], c)
    finally:
        pairs.close()


def relative_logit_diff(ours, hf_dir: Path, pixels, ids) -> float:
    """max |logits_per_image ours - CLIPModel's| / max |ours|, fp32."""
    import torch
    from transformers import CLIPModel

    loaded: tuple[Any, dict] = CLIPModel.from_pretrained(str(hf_dir), dtype=torch.float32, output_loading_info=True)
    hf, info = loaded
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        raise ValueError(f"CLIPModel did not load the export exactly: {info}")
    with torch.no_grad():
        a = ours.logits_per_image(pixels, ids)
        b = hf.eval()(input_ids=ids, pixel_values=pixels).logits_per_image
    return ((a - b).abs().max() / a.abs().max()).item()


def export_clip(package: Path, out: Path, tolerance: float = TOLERANCE) -> dict:
    """Write model.safetensors, config.json, the tokenizer and the image processor into `out`; check the logits."""
    from safetensors.torch import save_file

    from lifecycle.tasks.clip.evaluate.stage import load_clip
    from lifecycle.tasks.clip.model import MAX_SCALE
    from lifecycle.tasks.eval.export import ExportError

    ref = DatasetRef.from_dir(package)
    clip = load_clip(ref)
    c = clip.cfg
    if problems := refusals(c):
        raise ExportError("cannot export this dual encoder exactly to transformers' CLIPModel: " + "; ".join(problems)
                          + ". Retrain with clip_train.model.image_pre_norm=true and text_pool=eot (the defaults).")
    images = DatasetRef.from_dir(Path(next(p["manifest"] for p in ref.manifest()["parents"]
                                           if p["stage"] == "image_preprocess")).parent)
    out.mkdir(parents=True, exist_ok=True)
    state = to_clip_state(clip.export_state(), c, MAX_SCALE)
    clip_config(c, float(state["logit_scale"])).save_pretrained(str(out))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    try:
        hf_tokenizer(package / "tokenizer.json", c).save_pretrained(str(out))
    except ValueError as e:
        raise ExportError(str(e)) from e
    image_processor(c).save_pretrained(str(out))
    shutil.copyfile(package / "model_config.json", out / "lifecycle_model_config.json")
    diff = relative_logit_diff(clip, out, *sample_pairs(images, c))
    report = {"checkpoint": str(package.resolve()), "out_dir": str(out.resolve()), "architecture": "CLIPModel",
              "package_sha256": ref.sha256, "checkpoint_marker_sha256": sha256_file(package / "COMMITTED.json"),
              "tokenizer": str(package / "tokenizer.json"), "tokenizer_sha256": sha256_file(package / "tokenizer.json"),
              "max_rel_logit_diff_fp32": diff, "tolerance": tolerance, "parity_pairs": images.path}
    atomic_write_json(out / "lifecycle_export.json", report)
    if not diff <= tolerance:
        raise ExportError(f"exported CLIPModel's logits_per_image differ from ours by {diff:.3g} (relative) > "
                          f"{tolerance} (left in {out})")
    return report


# --------------------------------------------------------------------------------------------------
# CLI: `lifecycle export hf PACKAGE OUT_DIR` (the text model's command; a clip_train package comes here)


def cmd_export_hf(args) -> int:
    from lifecycle.core.errors import UsageError
    from lifecycle.tasks.eval import export as text

    package, out, _ = text.confined_args(args)
    if not is_clip_package(package):
        return text.cmd_export_hf(args)
    if args.tokenizer:
        raise UsageError("--tokenizer: a clip_train package exports the caption tokenizer it holds")
    return text.reported(args, lambda: export_clip(package, out), lambda r: (
        f"exported {r['checkpoint']} -> {r['out_dir']} (CLIPModel)\n"
        f"  max |logits_per_image difference| / max |logit| vs our model, fp32: {r['max_rel_logit_diff_fp32']:.3g} "
        f"(tolerance {r['tolerance']})\n"
        f"  load: transformers.CLIPModel.from_pretrained({r['out_dir']!r}), AutoTokenizer and AutoImageProcessor too"))


def register(sub) -> None:
    """`lifecycle export hf`, with clip_train packages exported here and every other checkpoint by the text path."""
    from lifecycle.tasks.eval import export as text

    text.register(sub, run=cmd_export_hf)
