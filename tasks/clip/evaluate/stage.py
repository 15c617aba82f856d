"""clip_evaluate: zero-shot retrieval on the pairs clip_train held out (`clip_train.holdout`, by a hash of
image_id: never trained on). Every held-out image and caption is encoded (the whole image, no augmentation);
image->text recall@k is the fraction of images whose own caption is among the k most similar captions, and
text->image the converse. Chance is k/n. The same figures on as many training pairs (seen in training) are
reported beside them, to tell memorising from generalising.

Output: a dataset with one row per held-out pair (image_id, caption, the rank of its caption among all captions
for its image, and of its image for its caption; 1 = first) and `metrics` in the manifest."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import load_file

from lifecycle.core.code import code_version
from lifecycle.core.dataset import DatasetRef, DatasetWriter, materialize
from lifecycle.core.shards import StageCode
from lifecycle.tasks.clip.augment import decode
from lifecycle.tasks.clip.config import ClipEvalConfig, ClipModelConfig, ClipTrainConfig
from lifecycle.tasks.clip.loader import Pairs, split
from lifecycle.tasks.clip.model import CLIP, caption_tokens

NAME = "clip_evaluate"


def load_clip(model: DatasetRef) -> CLIP:
    """The trained dual encoder from a clip_train dataset (safetensors, no pickle)."""
    cfg = ClipModelConfig.from_saved((model.dir / "model_config.json").read_text())
    clip = CLIP(cfg)
    clip.load_export(load_file(str(model.dir / "model.safetensors")))
    return clip.eval()


@torch.no_grad()
def ranks_of(clip: CLIP, pairs: Pairs, rows: list[int], batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(rank of each image's caption among the captions, rank of each caption's image among the images), 1-based."""
    c = clip.cfg
    img, txt = [], []
    for i in range(0, len(rows), batch):
        part = rows[i:i + batch]
        images = np.stack([decode(pairs.read(r), c.image_size) for r in part])
        img.append(clip.encode_image(torch.from_numpy(images)))
        txt.append(clip.encode_text(caption_tokens([pairs.tokens[r] for r in part], c)))
    sim = (torch.cat(img) @ torch.cat(txt).T).numpy()
    own = np.diag(sim)
    # ties count against the pair (a model that scores everything equal is at chance, not perfect)
    i2t = (sim >= own[:, None]).sum(1)
    t2i = (sim >= own[None, :]).sum(0)
    return i2t, t2i


def recalls(i2t: np.ndarray, t2i: np.ndarray, ks: tuple[int, ...], prefix: str) -> dict[str, float]:
    n = len(i2t)
    out = {f"{prefix}_pairs": float(n)}
    for k in ks:
        out[f"{prefix}_i2t_recall_at_{k}"] = float((i2t <= k).mean())
        out[f"{prefix}_t2i_recall_at_{k}"] = float((t2i <= k).mean())
        out[f"{prefix}_chance_at_{k}"] = min(1.0, k / n)
    return out


def _build(model: DatasetRef, images: DatasetRef, cfg: ClipEvalConfig, writer: DatasetWriter) -> dict:
    train_cfg = ClipTrainConfig.model_validate(model.manifest()["train"])
    clip, pairs = load_clip(model), Pairs(images.dir)
    try:
        train_rows, held = split(pairs.ids, train_cfg.holdout)
        if len(held) < 2:
            raise ValueError(f"clip_evaluate: {len(held)} held-out pairs in {images.path} "
                             f"(clip_train.holdout={train_cfg.holdout}); need at least 2")
        i2t, t2i = ranks_of(clip, pairs, held, cfg.batch)
        seen = np.random.default_rng(0).choice(train_rows, size=min(len(held), len(train_rows)), replace=False)
        s_i2t, s_t2i = ranks_of(clip, pairs, sorted(int(r) for r in seen), cfg.batch)
    finally:
        pairs.close()
    metrics = {**recalls(i2t, t2i, cfg.ks, "heldout"), **recalls(s_i2t, s_t2i, cfg.ks, "seen")}
    writer.write_table(pa.table({"image_id": [pairs.ids[r] for r in held], "caption": [pairs.caption[r] for r in held],
                                 "i2t_rank": i2t.astype(np.int32), "t2i_rank": t2i.astype(np.int32)}))
    writer.path("metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    writer.add_file("metrics.json")
    return {"extra": {"metrics": metrics}}


def run_clip_evaluate(model: DatasetRef, images: DatasetRef, cfg: ClipEvalConfig, workdir: str) -> DatasetRef:
    return materialize(workdir, NAME, cfg, code_version(__package__), lambda w: _build(model, images, cfg, w),
                       parents=[model, images])


STAGE = StageCode(run=run_clip_evaluate)
