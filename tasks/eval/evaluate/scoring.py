"""Scoring primitives shared by the evaluate stage, its robustness and safety passes and the champion gate:
prediction windows, exact bytes per token, held-out loss and bits per byte, greedy continuation."""

from __future__ import annotations

import math

import numpy as np


def windows(n_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, length) of the non-overlapping prediction windows over a shard of n_tokens tokens."""
    preds = n_tokens - 1
    return [(s, min(seq_len, preds - s)) for s in range(0, max(preds, 0), seq_len)]


def token_byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for: byte-level BPE maps each byte to one alphabet symbol, so a
    token's byte count is its string length; special (added) tokens stand for no text and count 0."""
    from tokenizers import pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    special = set(tokenizer.get_added_tokens_decoder())
    out = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i in special:
            continue
        if not set(token) <= alphabet:
            raise ValueError(f"token {i} ({token!r}) is not byte-level BPE: bits per byte would be wrong")
        out[i] = len(token)
    return out


def bits_per_byte(nats: float, n_bytes: int) -> float:
    return nats / (math.log(2) * n_bytes)


def greedy_continue(model, prompts, n_new: int):
    """Greedy (argmax) continuation of equal-length prompts (B, P); context cropped to the model's seq_len."""
    import torch

    idx = prompts
    with torch.no_grad():
        for _ in range(n_new):
            logits, _ = model(idx[:, -model.cfg.seq_len :])
            idx = torch.cat([idx, logits[:, -1, :].argmax(-1, keepdim=True)], dim=1)
    return idx[:, prompts.shape[1] :]


def held_out_loss(model, data: np.ndarray, nbytes: np.ndarray, batch_size: int, max_batches: int | None) -> dict:
    """val_loss, val_perplexity, val_bpb (and counts) of `model` over a token stream, in the `windows` of its
    context: `batch_size` full windows per forward pass, at most `max_batches` batches (None: every window,
    the short tail one included). evaluate scores the candidate with it, and the champion gate the champion."""
    import torch
    import torch.nn.functional as F

    T = model.cfg.seq_len
    wins = windows(len(data), T)
    if not wins:
        raise ValueError(f"the val shard has {len(data)} tokens: nothing to evaluate (raise tokenize.val_fraction)")
    full = [w for w in wins if w[1] == T]
    batches = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    if max_batches is not None and max_batches < len(batches):
        batches = batches[: max_batches]
    else:
        batches += [[w] for w in wins if w[1] < T]  # the short tail window, scored on its own
    loss_sum, n, n_bytes = 0.0, 0, 0
    with torch.no_grad():
        for batch in batches:
            x = torch.from_numpy(np.stack([data[s : s + L] for s, L in batch]).astype(np.int64))
            y_np = np.stack([data[s + 1 : s + 1 + L] for s, L in batch]).astype(np.int64)
            logits, _ = model(x)
            loss_sum += F.cross_entropy(logits.float().flatten(0, 1), torch.from_numpy(y_np).flatten(),
                                        reduction="sum").item()
            n += y_np.size
            n_bytes += int(nbytes[y_np].sum())
    val_loss = loss_sum / n
    return {"val_loss": val_loss, "val_perplexity": math.exp(val_loss), "val_bpb": bits_per_byte(loss_sum, n_bytes),
            "val_tokens": n, "val_bytes": n_bytes, "val_windows": sum(len(b) for b in batches)}


def continue_texts(model, tokenizer, texts: list[str], n_new: int) -> list[str]:
    """Greedy continuation of each text (tokenized on its own) by `n_new` tokens, decoded."""
    import torch

    out = []
    for t in texts:
        ids = tokenizer.encode(t, add_special_tokens=False).ids or [0]
        out.append(tokenizer.decode(greedy_continue(model, torch.tensor([ids]), n_new)[0].tolist()))
    return out
