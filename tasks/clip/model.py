"""A CLIP-style dual encoder small enough for the CPU (Radford et al. 2021, "Learning Transferable Visual Models
From Natural Language Supervision"): a ViT image tower (patches, a class token, pre-norm blocks), a causal text
transformer pooled at the end-of-text token after the caption (`text_pool`), both projected into one space and L2-normalised; the symmetric
contrastive loss (cross-entropy over image->text and text->image similarities) with a learned temperature,
clamped at 100 as CLIP clamps it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lifecycle.tasks.clip.config import ClipModelConfig

MAX_SCALE = math.log(100.0)


def _blocks(width: int, heads: int, layers: int) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class ImageTower(nn.Module):
    def __init__(self, c: ClipModelConfig):
        super().__init__()
        self.patch = nn.Conv2d(3, c.width, c.patch, c.patch)
        n = (c.image_size // c.patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, c.width))
        self.pos = nn.Parameter(torch.randn(1, n + 1, c.width) * 0.02)
        self.pre = nn.LayerNorm(c.width) if c.image_pre_norm else nn.Identity()
        self.blocks = _blocks(c.width, c.heads, c.layers)
        self.norm = nn.LayerNorm(c.width)
        self.proj = nn.Linear(c.width, c.embed_dim, bias=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.pos
        return self.proj(self.norm(self.blocks(self.pre(x)))[:, 0])


class TextTower(nn.Module):
    """Token `vocab_size` is the padding after the caption, and its first copy the end-of-text token; causal
    attention keeps what follows out of the pooled token."""

    def __init__(self, c: ClipModelConfig):
        super().__init__()
        self.pad, self.eot = c.vocab_size, c.text_pool == "eot"
        self.tok = nn.Embedding(c.vocab_size + 1, c.text_width)
        self.pos = nn.Parameter(torch.randn(1, c.context, c.text_width) * 0.01)
        self.blocks = _blocks(c.text_width, c.heads, c.text_layers)
        self.norm = nn.LayerNorm(c.text_width)
        self.proj = nn.Linear(c.text_width, c.embed_dim, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(c.context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[:, : tokens.shape[1]]
        n = tokens.shape[1]
        x = self.norm(self.blocks(x, mask=self.causal[:n, :n], is_causal=True))
        length = (tokens != self.pad).sum(1)
        at = length.clamp(max=n - 1) if self.eot else (length - 1).clamp(min=0)
        return self.proj(x[torch.arange(len(x)), at])


class CLIP(nn.Module):
    def __init__(self, cfg: ClipModelConfig):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("ClipModelConfig.vocab_size is not set (take it from the image_preprocess dataset)")
        self.cfg = cfg
        self.image = ImageTower(cfg)
        self.text = TextTower(cfg)
        # shape (1,), not a 0-dim tensor: DeepSpeed 0.19's initial broadcast views every parameter as bytes, which a
        # 0-dim tensor refuses
        self.logit_scale = nn.Parameter(torch.full((1,), math.log(1 / 0.07)))
        # set by the trainer under `negatives: global` with more than one rank: the loss's negatives are the features
        # of every rank (global_contrastive_loss); False: this rank's micro-batch only
        self.gather = False

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.image(images), dim=-1)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text(tokens), dim=-1)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The symmetric contrastive loss of a batch whose i-th image and i-th caption are a pair."""
        loss = global_contrastive_loss if self.gather else contrastive_loss
        return loss(self.encode_image(images), self.encode_text(tokens), self.logit_scale)

    def logits_per_image(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(images, captions) similarities times the clamped temperature: transformers' `logits_per_image`."""
        return similarity_logits(self.encode_image(images), self.encode_text(tokens), self.logit_scale)

    def export_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """fp32 CPU weights by name (what lifecycle.tasks.train.commit writes as model.safetensors)."""
        return {k: (v.detach().float().cpu().clone() if copy else v.detach().float().cpu())
                for k, v in self.state_dict().items()}

    def load_export(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(state)


def similarity_logits(img: torch.Tensor, txt: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    return logit_scale.clamp(max=MAX_SCALE).exp() * img @ txt.T


def contrastive_loss(img: torch.Tensor, txt: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    logits = similarity_logits(img, txt, logit_scale)
    labels = torch.arange(len(img), device=img.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def global_contrastive_loss(img: torch.Tensor, txt: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """The contrastive loss of this rank's pairs against every rank's: its images against all captions, its
    captions against all images, the positives at this rank's offset. The features are all-gathered with their
    gradients (torch.distributed.nn's all_gather sums each rank's gradient back to the rank that made the
    feature), so the mean over ranks of this loss, and of its gradients, is the one-rank loss of the whole batch."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_gather

    all_img, all_txt = torch.cat(all_gather(img)), torch.cat(all_gather(txt))
    labels = torch.arange(len(img), device=img.device) + dist.get_rank() * len(img)
    return (F.cross_entropy(similarity_logits(img, all_txt, logit_scale), labels)
            + F.cross_entropy(similarity_logits(txt, all_img, logit_scale), labels)) / 2


def caption_tokens(captions: list[list[int]], c: ClipModelConfig) -> torch.Tensor:
    """The text tower's input for these captions: padded to `context`; under `text_pool: eot` a caption keeps at
    most context - 1 tokens, so that its end-of-text token (the first padding) is always in the window."""
    return pad_tokens(captions, c.context, c.vocab_size, c.context - 1 if c.text_pool == "eot" else c.context)


def pad_tokens(captions: list[list[int]], context: int, pad: int, keep: int | None = None) -> torch.Tensor:
    """Caption token ids cut to `keep` (default `context`) and padded with `pad` after the caption, as one
    (n, context) tensor."""
    out = torch.full((len(captions), context), pad, dtype=torch.long)
    for i, ids in enumerate(captions):
        ids = ids[:context if keep is None else keep]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out
