"""Evaluate task: validation loss and perplexity of a committed checkpoint on the val token shard.

The model is rebuilt from the checkpoint's `model.safetensors` + `model_config.json` (no pickle), after
the commit marker's hashes are checked. The val shard is cut into consecutive, non-overlapping windows of
`seq_len` predictions (window i predicts tokens i·T+1 … i·T+T from tokens i·T … i·T+T-1; the last window
may be shorter), so every val token is predicted exactly once, from at most seq_len-1 tokens of context
and never from a token of an earlier window. The loss is the token-weighted mean over all windows, so the
result is deterministic and, up to float summation order, independent of the batch size.

torch is imported lazily: the CLI imports this module for `EvaluateConfig`.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.dataset import DatasetRef
from tasks import checkpoint as ckpt
from tasks.tokenizer import token_shards


class EvaluateConfig(BaseModel):
    """How much of the val shard to score, and in what batches."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    max_batches: int | None = Field(None, ge=1)
    """Score at most this many batches of full windows (null = the whole val shard, tail window included)."""
    batch_size: int = Field(8, ge=1)
    """Windows per forward pass (changes speed, and the loss only by float summation order)."""


def windows(n_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, length) of the non-overlapping prediction windows over a shard of n_tokens tokens."""
    preds = n_tokens - 1
    return [(s, min(seq_len, preds - s)) for s in range(0, max(preds, 0), seq_len)]


def run_evaluate(checkpoint_dir: str, tokens: DatasetRef, cfg: EvaluateConfig) -> dict:
    """{"val_loss", "val_perplexity", "val_tokens", "val_windows", "step"} of a committed checkpoint."""
    import torch
    import torch.nn.functional as F

    marker = ckpt.read_marker(checkpoint_dir)
    meta = token_shards(tokens)
    if marker.get("tokenizer_sha256") not in (None, meta.tokenizer_sha256):
        raise ValueError(f"{checkpoint_dir} was trained with tokenizer {marker['tokenizer_sha256']}, "
                         f"but {tokens.path} uses {meta.tokenizer_sha256}")
    model = ckpt.load_model(checkpoint_dir)
    maps = meta.memmap("val")
    data = np.concatenate(maps) if maps else np.zeros(0, dtype=meta.dtype)
    T = model.cfg.seq_len
    wins = windows(len(data), T)
    if not wins:
        raise ValueError(f"val shard of {tokens.path} has {len(data)} tokens: nothing to evaluate "
                         "(raise tokenize.val_fraction)")
    full = [w for w in wins if w[1] == T]
    batches = [full[i : i + cfg.batch_size] for i in range(0, len(full), cfg.batch_size)]
    if cfg.max_batches is not None and cfg.max_batches < len(batches):
        batches = batches[: cfg.max_batches]
    else:
        batches += [[w] for w in wins if w[1] < T]  # the short tail window, scored on its own
    loss_sum, n = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            x = torch.from_numpy(np.stack([data[s : s + L] for s, L in batch]).astype(np.int64))
            y = torch.from_numpy(np.stack([data[s + 1 : s + 1 + L] for s, L in batch]).astype(np.int64))
            logits, _ = model(x)
            loss_sum += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
            n += y.numel()
    val_loss = loss_sum / n
    return {"val_loss": val_loss, "val_perplexity": math.exp(val_loss), "val_tokens": n,
            "val_windows": sum(len(b) for b in batches), "step": marker["step"]}
