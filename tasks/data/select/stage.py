"""Select: keep documents by a cheap rule on their quality scores (Dolma's "mix" after "tag").

The scores come from the quality step (`quality_fasttext`, higher is better) or the perplexity step
(`quality_perplexity`, under the champion model: lower is better, as for every `*_perplexity` column); this step
only decides. Rule: keep rows whose score is at least `threshold` (at most, for a perplexity), or
(`top_fraction`) the best scoring share of the documents, ties broken by doc_id. A
dropped row is rejected with reason `low_quality`, its detail the column, the score and the cut. Its fingerprint
is its own config and the scored dataset's: a new threshold redoes select and what follows, never the scores.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lifecycle.core.dataset import DatasetRef, StageStats, rejected_table
from lifecycle.core.shards import PerFileStage, map_tables

NAME = "select"
REASON = "low_quality"


class SelectConfig(BaseModel):
    """The keep rule on the quality scores (runs when `quality.enabled`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    column: str = "quality_fasttext"
    """Score column to select on: `quality_fasttext` (higher is better) or `quality_perplexity` (lower is better,
    as for any `*_perplexity` column)."""
    threshold: float | None = 0.5
    """Keep documents scoring at least this; for a perplexity, at most this (null: use top_fraction)."""
    top_fraction: float | None = Field(None, gt=0.0, le=1.0)
    """Keep this share of the documents, best scores first (set threshold to null)."""

    @model_validator(mode="after")
    def _one_rule(self) -> "SelectConfig":
        if (self.threshold is None) == (self.top_fraction is None):
            raise ValueError("select: set exactly one of select.threshold and select.top_fraction")
        return self


class SelectRun(SelectConfig):
    """The rule with its cut resolved over the whole dataset (top_fraction -> the score and doc_id of the last
    kept document), handed to each shard."""

    cut: tuple[float, str] | None = None


def lower_is_better(column: str) -> bool:
    """A perplexity is better low; every other score high."""
    return column.endswith("_perplexity")


def _key(score: float, doc_id: str, column: str) -> tuple[float, str]:
    """Sort key, best first: the score (negated when higher is better), then doc_id."""
    return (score if lower_is_better(column) else -score, doc_id)


def resolve_cut(parent: DatasetRef, cfg: SelectConfig) -> SelectRun:
    if cfg.threshold is not None:
        return SelectRun(**cfg.model_dump())
    t = parent.read(["doc_id", cfg.column])
    rows = sorted(((s, d) for s, d in zip(t.column(cfg.column).to_pylist(), t.column("doc_id").to_pylist())
                   if s is not None), key=lambda r: _key(r[0], r[1], cfg.column))
    k = max(1, round(cfg.top_fraction * len(rows))) if rows else 0
    return SelectRun(**cfg.model_dump(), cut=(rows[k - 1][0], rows[k - 1][1]) if k else None)


def keeps(score: float, doc_id: str, cfg: SelectRun) -> bool:
    if cfg.threshold is not None:
        return score <= cfg.threshold if lower_is_better(cfg.column) else score >= cfg.threshold
    return cfg.cut is not None and _key(score, doc_id, cfg.column) <= _key(*cfg.cut, cfg.column)


def select_table(table: pa.Table, cfg: SelectRun) -> tuple[pa.Table, pa.Table, StageStats]:
    if cfg.column not in table.column_names:
        raise ValueError(f"select.column {cfg.column!r} is not a column of the scored documents "
                         f"({', '.join(c for c in table.column_names if c.startswith('quality_'))})")
    stats = StageStats(rows_in=table.num_rows)
    ids, sources = table.column("doc_id").to_pylist(), table.column("source_id").to_pylist()
    scores = table.column(cfg.column).to_pylist()
    mask, rejected = [], []
    rule = {"threshold": cfg.threshold} if cfg.threshold is not None else {"top_fraction": cfg.top_fraction,
                                                                             "cut_score": cfg.cut and cfg.cut[0]}
    for d, s, score in zip(ids, sources, scores):
        keep = score is not None and keeps(score, d, cfg)
        mask.append(keep)
        if not keep:
            stats.rejected[REASON] += 1
            rejected.append({"doc_id": d, "source_id": s, "reason": REASON, "detail": json.dumps(
                {"column": cfg.column, "score": None if score is None else round(score, 6), **rule},
                sort_keys=True)})
    kept = table.filter(pa.array(mask, type=pa.bool_()))
    stats.rows_kept = kept.num_rows
    stats.bytes_in = int(pc.sum(pc.binary_length(table.column("text"))).as_py() or 0)
    stats.bytes_out = int(pc.sum(pc.binary_length(kept.column("text"))).as_py() or 0)
    return kept, rejected_table(rejected, NAME), stats


def select_shard(cfg: SelectRun, files: list[str], writer) -> StageStats:
    return map_tables(files, writer, lambda t: select_table(t, cfg))


# one shard per file of the scored dataset, the cut resolved first (top_fraction is global)
STAGE = PerFileStage(NAME, __package__, select_shard, config=resolve_cut, grouped=False)
run_select = STAGE.run
