"""Image filter: minimum side, aspect ratio, and caption rules (word counts, then the text path's own filter rules
applied to the caption: `caption_rules`, any of `filter.rules`' names, e.g. `language`).

Reasons: too_small (the shorter side below `min_side`), aspect_ratio (long side / short side above
`max_aspect`), caption_too_short / caption_too_long (words), and the text rules' own codes (lang_not_kept, ...)
prefixed `caption_`. The first failing check is the reason; kept rows are unchanged.
"""

from __future__ import annotations

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core.dataset import StageStats, rejected_table
from lifecycle.core.shards import PerFileStage, map_tables
from lifecycle.tasks.data.filter.rule import Verdict
from lifecycle.tasks.data.filter.stage import FilterConfig, document_verdict

NAME = "image_filter"


class ImageFilterConfig(BaseModel):
    """Which pairs are kept."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    min_side: int = Field(32, ge=1)
    """Reject an image whose shorter side is below this (too_small). 32: below it a 224 px training crop is
    mostly interpolation."""
    max_aspect: float = Field(3.0, ge=1.0)
    """Reject an image whose long side is more than this many times its short side (aspect_ratio): a center crop
    would keep a third of it or less. LAION-5B's aesthetic subsets and DataComp keep aspect ratios up to 3."""
    min_caption_words: int = Field(2, ge=0)
    """Reject a caption with fewer words (caption_too_short)."""
    max_caption_words: int = Field(77, ge=1)
    """Reject a caption with more words (caption_too_long); 77 is CLIP's context length in tokens, an upper bound."""
    caption_rules: FilterConfig = Field(FilterConfig(rules=()))  # type: ignore[call-arg]
    """The text path's filter (tasks/data/filter/) applied to the caption: `rules` lists which (none by default:
    Gopher quality's 50-word minimum is for documents, not captions); every rule's section is as in `filter:`."""


def pair_verdict(width: int, height: int, caption: str, cfg: ImageFilterConfig) -> Verdict:
    short, long = min(width, height), max(width, height)
    if short < cfg.min_side:
        return "too_small", f"{width}x{height}: shorter side {short} < min_side {cfg.min_side}"
    if long / short > cfg.max_aspect:
        return "aspect_ratio", f"{width}x{height}: aspect {long / short:.3g} > max_aspect {cfg.max_aspect}"
    words = len(caption.split())
    if words < cfg.min_caption_words:
        return "caption_too_short", f"{words} words < min_caption_words {cfg.min_caption_words}"
    if words > cfg.max_caption_words:
        return "caption_too_long", f"{words} words > max_caption_words {cfg.max_caption_words}"
    if cfg.caption_rules.rules:
        verdict = document_verdict(caption, cfg.caption_rules)[0]
        if verdict is not None:
            return f"caption_{verdict[0]}", verdict[1]
    return None


def filter_pairs(table: pa.Table, cfg: ImageFilterConfig) -> tuple[pa.Table, pa.Table, StageStats]:
    """(kept rows, rejected rows, stats) of one file of pairs."""
    stats = StageStats(rows_in=table.num_rows)
    keep, rejected = [], []
    cols = table.select(["image_id", "source_id", "width", "height", "caption"]).to_pydict()
    for i, (iid, sid, w, h, caption) in enumerate(zip(*cols.values())):
        verdict = pair_verdict(w, h, caption, cfg)
        if verdict is None:
            keep.append(i)
            continue
        stats.rejected[verdict[0]] += 1
        rejected.append({"doc_id": iid, "source_id": sid, "reason": verdict[0], "detail": verdict[1]})
    kept = table.take(pa.array(keep, type=pa.int64()))
    stats.rows_kept = kept.num_rows
    stats.bytes_in = sum(len(b) for b in table.column("image").to_pylist())
    stats.bytes_out = sum(len(b) for b in kept.column("image").to_pylist())
    return kept, rejected_table(rejected, NAME), stats


def filter_shard(cfg: ImageFilterConfig, files: list[str], writer) -> StageStats:
    return map_tables(files, writer, lambda table: filter_pairs(table, cfg))


STAGE = PerFileStage(NAME, __package__, filter_shard)
