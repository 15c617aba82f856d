"""Data checks that run at tokenize, before any training: the train/val n-gram overlap gate.

The figures are `overlap.py`'s. The gate counts near copies: val documents of which at least
`contamination_min_share` of the word n-grams are found in the train split, not counting boilerplate (n-grams in
more than `contamination_boilerplate_docs` train documents). Above `max_contamination` of the val documents, the
stage fails with `ContaminationError`, whose one line names the worst pair and the report (`REPORT`, in the token
dataset: the val documents closest to a copy, the top val<->train pairs and the top shared passages), so a bad
split costs no training time and says what overlaps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

from lifecycle.tasks.data.decontaminate.ngrams import ContaminationError
from lifecycle.tasks.data.tokenize.overlap import overlap

__all__ = ["ContaminationError", "REPORT", "check_overlap", "rule", "train_val_overlap"]

REPORT = "overlap-report.json"


def rule(cfg) -> str:
    """The gate's rule in words (the error and the report say it)."""
    bp = ("" if cfg.contamination_boilerplate_docs is None else
          f", not counting n-grams found in more than {cfg.contamination_boilerplate_docs} train documents")
    return (f"a val document is a near copy when at least {cfg.contamination_min_share:.0%} of its "
            f"{cfg.contamination_ngram}-grams are found in the train split{bp}")


def train_val_overlap(batches: Callable[[], Iterable[tuple[list, list, list]]], val: set[str], cfg
                      ) -> tuple[dict, dict]:
    """(`contamination_*` metrics, report) over `batches()` of (doc_ids, source_ids, texts), read twice."""
    metrics, report = overlap(batches, val, cfg.contamination_ngram, cfg.contamination_boilerplate_docs,
                              cfg.contamination_min_share)
    head = {"rule": rule(cfg), "ngram": cfg.contamination_ngram,
            "boilerplate_docs": cfg.contamination_boilerplate_docs, "min_share": cfg.contamination_min_share,
            "max_contamination": cfg.max_contamination}
    return metrics, head | metrics | report


def check_overlap(metrics: dict, cfg, report: Path) -> None:
    """Raise `ContaminationError` when the near-copy share of val documents is above `max_contamination`; the
    message names the closest near copy, read from the `report` file."""
    rate = metrics["contamination_near_copy_rate"]
    if rate <= cfg.max_contamination:
        return
    worst = (json.loads(report.read_text()).get("closest_val_docs") or [{}])[0] if report.is_file() else {}
    pair = ""
    if worst.get("near_copy"):
        pair = (f"; closest: val {worst['val_source_id']} has {worst['share']:.0%} of its n-grams in train, "
                f"{worst['pair_shared_ngrams']} of them in {worst['train_source_id']}")
    raise ContaminationError(
        f"{metrics['contamination_near_copy_docs']} of {metrics['contamination_eval_docs']} val documents "
        f"({rate:.1%}) are near copies of training text ({rule(cfg)}), above "
        f"tokenize.max_contamination={cfg.max_contamination}; the run stops before training{pair}; "
        f"what overlaps: {report}")
