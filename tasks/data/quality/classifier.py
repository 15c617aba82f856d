"""The fastText quality classifier (DCLM's recipe): positives are reference documents the user names, negatives
are documents sampled from the corpus itself; a bigram linear model separates them, and P(high quality) is a
document's score. Pure functions over texts; the stage (stage.py) reads and writes.

fastText: the `fasttext-numpy2` wheel (Facebook's C++ fastText, the same Python API): `fasttext-wheel` 0.9.2 and
`fasttext` 0.9.3 fail `predict` under numpy 2 (`np.array(probs, copy=False)`); this one fixes that.
Trained with one thread and a fixed seed, so a rerun gives the same model bytes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

LABEL_HQ, LABEL_LQ = "__label__hq", "__label__lq"


def line_of(text: str, max_chars: int) -> str:
    """fastText reads one example per line: whitespace collapsed (DCLM replaces newlines with spaces), cut to
    `max_chars` so one huge page costs no more than a long one."""
    return " ".join(text[:max_chars].split())  # str.split: faster than a regex here (bench.quality)


def held_out(key: str, seed: int, fraction: float) -> bool:
    h = hashlib.sha256(f"{seed}:heldout:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def train(examples: list[tuple[str, str]], path: Path, cfg) -> "object":
    """Train on (label, line) examples written to `path` (kept beside the model); returns the fastText model."""
    import fasttext

    path.write_text("".join(f"{label} {line}\n" for label, line in examples), encoding="utf-8")
    return fasttext.train_supervised(input=str(path), epoch=cfg.epoch, lr=cfg.lr, wordNgrams=cfg.word_ngrams,
                                     dim=cfg.dim, minCount=cfg.min_count, thread=1, seed=cfg.seed, verbose=0)


def hq_scores(model, lines: list[str]) -> list[float]:
    """P(hq) of each line."""
    if not lines:
        return []
    labels, probs = model.predict(lines, k=2)
    out = []
    for ls, ps in zip(labels, probs):
        d = dict(zip(ls, ps))
        out.append(float(d.get(LABEL_HQ, 1.0 - d.get(LABEL_LQ, 0.0))))
    return out


def prf(scores: list[float], truth: list[bool], threshold: float = 0.5) -> dict[str, float]:
    """Precision, recall and F1 of `score >= threshold` as high quality."""
    tp = sum(1 for s, t in zip(scores, truth) if s >= threshold and t)
    fp = sum(1 for s, t in zip(scores, truth) if s >= threshold and not t)
    fn = sum(1 for s, t in zip(scores, truth) if s < threshold and t)
    p = tp / (tp + fp) if tp + fp else 0.0
    r = tp / (tp + fn) if tp + fn else 0.0
    return {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0,
            "heldout_docs": len(truth)}
