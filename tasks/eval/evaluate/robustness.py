"""Robustness: the same held-out text and prompts, clean and perturbed (typos, case, whitespace), and the drop.

Perturbations are seeded and deterministic: document i under kind k always gets the same edits
(`random.Random(f"{seed}:{k}:{i}")`), so two model versions are scored on identical perturbed text.
- `typo`: a share `rate` of words of 4+ characters get two adjacent inner characters swapped ("model" -> "mdoel").
- `case`: a share `rate` of words have their case flipped ("model" -> "MODEL", "The" -> "tHE").
- `whitespace`: a share `rate` of whitespace runs become a double space, a newline or a tab.

Two measurements, each clean vs every kind:
1. Bits per byte of the first `chars` characters of `docs` held-out documents. Each text is tokenized on its own
   with the end-of-text token in front, so every byte of it is predicted, and is scored in non-overlapping
   windows of the model's context; bpb = nats / (ln 2 * UTF-8 bytes of the text). Metrics `robust_clean_bpb`,
   `robust_<kind>_bpb` and `robust_<kind>_bpb_increase` (perturbed - clean; higher = less robust).
2. Greedy continuations of `prompts` held-out prompts (the text of the evaluate stage's prompts), clean and
   perturbed, each scored with sacrebleu against the document's true continuation: `robust_clean_gen_bleu`,
   `robust_<kind>_gen_bleu` and `robust_<kind>_gen_bleu_drop` (clean - perturbed, BLEU points 0-100).
"""

from __future__ import annotations

import math
import random
import re

from pydantic import BaseModel, ConfigDict, Field

from lifecycle.tasks.eval.evaluate.scoring import continue_texts

KINDS = ("typo", "case", "whitespace")


class RobustnessConfig(BaseModel):
    """Perturbed held-out text and prompts scored beside the clean ones (`robust_*` metrics)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    docs: int = Field(16, ge=0)
    """Held-out documents scored in bits per byte, clean and perturbed (0 = off)."""
    chars: int = Field(600, ge=16)
    """Characters of each document scored (the opening of the document)."""
    prompts: int = Field(8, ge=0)
    """Held-out prompts continued clean and perturbed and scored with BLEU (0 = off; at most evaluate.num_prompts)."""
    rate: float = Field(0.15, gt=0.0, le=1.0)
    """Share of words (typo, case) or whitespace runs (whitespace) that a perturbation edits."""
    seed: int = 0
    """Seed of the perturbations (per kind and per document)."""


def perturb(text: str, kind: str, rate: float, rng: random.Random) -> str:
    """`text` with a share `rate` of its words (or whitespace runs) edited by perturbation `kind`."""
    if kind == "typo":
        def edit(m):
            w = m.group(0)
            if rng.random() >= rate:
                return w
            i = rng.randrange(1, len(w) - 2)
            return w[:i] + w[i + 1] + w[i] + w[i + 2:]
        return re.sub(r"\w{4,}", edit, text)
    if kind == "case":
        return re.sub(r"\w+", lambda m: m.group(0).swapcase() if rng.random() < rate else m.group(0), text)
    if kind == "whitespace":
        return re.sub(r"\s+", lambda m: rng.choice(("  ", "\n", "\t")) if rng.random() < rate else m.group(0), text)
    raise ValueError(f"unknown perturbation kind {kind!r} (known: {', '.join(KINDS)})")


def perturbed(texts: list[str], kind: str, cfg: RobustnessConfig) -> list[str]:
    return [perturb(t, kind, cfg.rate, random.Random(f"{cfg.seed}:{kind}:{i}")) for i, t in enumerate(texts)]


def text_nats(model, ids: list[int]) -> float:
    """Summed cross-entropy (nats) of ids[1:] given the ids before them, in non-overlapping context windows."""
    import torch
    import torch.nn.functional as F

    T, total = model.cfg.seq_len, 0.0
    x_all = torch.tensor(ids, dtype=torch.long)
    with torch.no_grad():
        for s in range(0, len(ids) - 1, T):
            L = min(T, len(ids) - 1 - s)
            logits, _ = model(x_all[s:s + L][None])
            total += F.cross_entropy(logits[0].float(), x_all[s + 1:s + 1 + L], reduction="sum").item()
    return total


def texts_bpb(model, tokenizer, texts: list[str], eot_id: int) -> float:
    """Bits per UTF-8 byte of `texts`, each scored on its own after the end-of-text token."""
    nats = sum(text_nats(model, [eot_id, *tokenizer.encode(t, add_special_tokens=False).ids]) for t in texts)
    return nats / (math.log(2) * sum(len(t.encode()) for t in texts))


def robustness(model, tokenizer, eot_id: int, doc_texts: list[str], prompts: list[str], references: list[str],
               n_new: int, cfg: RobustnessConfig) -> dict[str, float]:
    """`robust_*` metrics (see the module doc) on the given held-out texts and (prompt, reference) pairs."""
    import sacrebleu

    out: dict[str, float] = {}
    texts = [t[: cfg.chars] for t in doc_texts[: cfg.docs] if t.strip()]
    if texts:
        clean = texts_bpb(model, tokenizer, texts, eot_id)
        out.update({"robust_docs": len(texts), "robust_clean_bpb": clean})
        for kind in KINDS:
            bpb = texts_bpb(model, tokenizer, perturbed(texts, kind, cfg), eot_id)
            out[f"robust_{kind}_bpb"], out[f"robust_{kind}_bpb_increase"] = bpb, bpb - clean
    n = min(cfg.prompts, len(prompts))
    if n:
        prompts, refs = prompts[:n], references[:n]
        clean = sacrebleu.corpus_bleu(continue_texts(model, tokenizer, prompts, n_new), [refs]).score
        out.update({"robust_prompts": n, "robust_clean_gen_bleu": clean})
        for kind in KINDS:
            gen = continue_texts(model, tokenizer, perturbed(prompts, kind, cfg), n_new)
            bleu = sacrebleu.corpus_bleu(gen, [refs]).score
            out[f"robust_{kind}_gen_bleu"], out[f"robust_{kind}_gen_bleu_drop"] = bleu, clean - bleu
    return out
