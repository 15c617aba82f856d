"""The image path's training and evaluation configs (typed, frozen, checked when built): a CLIP-style dual
encoder's shape (`ClipModelConfig`), its training run (`ClipTrainConfig`, the `clip_train` section) and its
zero-shot retrieval evaluation (`ClipEvalConfig`, `clip_evaluate`). Torch-free: the CLI imports it."""

from __future__ import annotations

import hashlib
import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ClipModelConfig(BaseModel):
    """A tiny ViT image tower and a small causal text transformer, projected into one embedding space."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    image_size: int = Field(64, ge=8)
    """Side of the square input image; the preprocessed shards' resolution (image_preprocess.resolution)."""
    patch: int = Field(8, ge=2)
    """ViT patch side; image_size must be a multiple of it."""
    width: int = Field(64, ge=8)
    """Width of the image tower."""
    layers: int = Field(2, ge=1)
    """Transformer blocks of the image tower."""
    heads: int = Field(4, ge=1)
    """Attention heads of both towers."""
    text_width: int = Field(64, ge=8)
    """Width of the text tower."""
    text_layers: int = Field(2, ge=1)
    """Transformer blocks of the text tower (causal, pooled at the caption's last token as CLIP does)."""
    context: int = Field(24, ge=2)
    """Caption tokens kept (longer captions are cut)."""
    embed_dim: int = Field(64, ge=8)
    """Dimension of the joint embedding."""
    vocab_size: int = Field(0, ge=0)
    """The caption tokenizer's vocabulary; 0 = taken from the image_preprocess dataset."""
    image_pre_norm: bool = True
    """A LayerNorm on the image tower's patch and class embeddings before the blocks, as CLIP and transformers'
    `CLIPVisionModel` (`pre_layrnorm`) have; False is the layout of models trained before it existed, which
    `lifecycle export hf` refuses (CLIPModel cannot leave the norm out)."""
    text_pool: Literal["eot", "last"] = "eot"
    """Where the text tower is pooled: `eot`, the end-of-text token after the caption (the first padding token;
    a caption keeps at most context - 1 tokens so that it is always there), as CLIP and transformers'
    `CLIPTextModel` pool; `last`, the caption's own last token, the layout of models trained before (refused by
    the export: CLIPTextModel pools at an end-of-text token)."""

    @classmethod
    def from_saved(cls, text: str) -> "ClipModelConfig":
        """A model_config.json as written by clip_train; one written before `image_pre_norm` and `text_pool`
        existed describes a model without them (no pre-norm, pooled at the caption's last token)."""
        import json

        return cls.model_validate({"image_pre_norm": False, "text_pool": "last", **json.loads(text)})

    @model_validator(mode="after")
    def _shapes(self) -> "ClipModelConfig":
        if self.image_size % self.patch:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch {self.patch}")
        for name in ("width", "text_width"):
            if getattr(self, name) % self.heads:
                raise ValueError(f"{name} {getattr(self, name)} is not a multiple of heads {self.heads}")
        return self


class ClipTrainConfig(BaseModel):
    """The dual encoder's training run: DeepSpeed ZeRO ranks launched on this host, committed checkpoints."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    model: ClipModelConfig = ClipModelConfig()
    """The dual encoder's shape."""
    steps: int = Field(60, ge=1)
    """Optimizer steps."""
    micro_batch: int = Field(32, ge=2)
    """Pairs per rank per step."""
    negatives: Literal["global", "local"] = "global"
    """The contrastive loss's negatives. `global`: every pair of the step on every rank, as CLIP trains (each rank's
    images against all ranks' captions and the reverse; the features all-gathered with their gradients, open_clip's
    `local_loss` with `gather_with_grad`): the loss and gradients of one rank holding the whole global batch.
    `local`: the rank's own micro-batch only (cheaper, a smaller task; the behaviour before this field)."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate of AdamW (linear warmup, then cosine to a tenth)."""
    warmup: int = Field(5, ge=0)
    """Warmup steps."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW's decoupled weight decay."""
    seed: int = 0
    """Seeds the initial weights, the sample order and the augmentations: a step's batch is a function of (seed,
    step, rank, ranks)."""
    ranks: int = Field(2, ge=1)
    """Data-parallel ranks launched on this host (gloo on the CPU)."""
    zero_stage: int = Field(1, ge=0, le=3)
    """DeepSpeed ZeRO stage."""
    accelerator: str = "cpu"
    """DS_ACCELERATOR of the ranks: cpu (gloo) or cuda (nccl)."""
    threads_per_rank: int | None = Field(None, ge=1)
    """OMP_NUM_THREADS of each rank; None = this host's cores // ranks."""
    holdout: float = Field(0.1, ge=0, lt=1)
    """Fraction of pairs held out for clip_evaluate (chosen by a hash of image_id, never trained on)."""
    save_every: int = Field(20, ge=1)
    """Commit a checkpoint every this many steps (and at the last step); a rerun resumes from the newest."""
    keep_last: int = Field(2, ge=1)
    """Committed checkpoints kept."""
    loader: Literal["workers", "dali"] = "workers"
    """The image loader's backend. `workers`: Pillow decodes and crops in `workers` processes per rank. `dali`: an
    NVIDIA DALI pipeline (the `dali` extra) fed the same encoded bytes in the same order: decode, the same crop
    boxes, resize and normalise in DALI, on its CPU operators on the CPU and nvJPEG ("mixed") and GPU operators
    under `accelerator: cuda`; the same batches up to the resize filters' rounding (docs/data.md)."""
    workers: int = Field(1, ge=0)
    """Decode-and-augment worker processes per rank; 0 decodes in the training loop itself. Under `loader: dali`,
    DALI's CPU threads per rank (at least 1)."""
    prefetch: int = Field(2, ge=1)
    """Batches handed to the workers ahead of the step that needs them (DALI's prefetch queue depth)."""
    cache_mb: float = Field(64.0, ge=0)
    """Per-rank cache of encoded images (CoorDL's policy: kept once cached, never evicted); a rank caches only the
    samples it owns."""
    crop_scale: tuple[float, float] = (0.8, 1.0)
    """Random resized crop: the fraction of the image's area kept, drawn uniformly in this range."""

    @model_validator(mode="after")
    def _crop(self) -> "ClipTrainConfig":
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale {self.crop_scale}: need 0 < low <= high <= 1")
        if self.accelerator not in ("cpu", "cuda"):
            raise ValueError(f"accelerator {self.accelerator!r}: cpu or cuda")
        if self.loader == "dali" and not dali_installed():
            raise ValueError("loader 'dali': NVIDIA DALI is not installed (pip install -c constraints.txt "
                             "-e '.[dali]', or loader: workers)")
        return self


class ClipEvalConfig(BaseModel):
    """Zero-shot retrieval on the held-out pairs."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    ks: tuple[int, ...] = (1, 5)
    """Recall@k reported, image->text and text->image."""
    batch: int = Field(128, ge=1)
    """Pairs encoded at once."""


def dali_installed() -> bool:
    """Whether `nvidia.dali` can be imported (found, not imported: the config check stays quick)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no `nvidia` package at all
        return False


def held_out(image_id: str, fraction: float) -> bool:
    """Whether a pair is held out for evaluation (`ClipTrainConfig.holdout`): a hash of its image_id, so the split
    needs no state and lineage can tell which registered models trained on an image."""
    return int(hashlib.sha256(image_id.encode()).hexdigest()[:8], 16) < fraction * 2**32
