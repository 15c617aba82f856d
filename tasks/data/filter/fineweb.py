"""FineWeb quality rules (Penedo et al. 2024, "The FineWeb Datasets", https://arxiv.org/abs/2406.17557), following
datatrove 0.10.1 `src/datatrove/pipeline/filters/fineweb_quality_filter.py` line by line: line punctuation ratio,
short-line ratio, duplicated-line character ratio, newline/word ratio.
"""

from __future__ import annotations

from pydantic import Field

from lifecycle.tasks.data.filter.rule import Rule, Verdict, beyond, register
from lifecycle.tasks.data.filter.words import TERMINAL_PUNCTUATION, find_duplicates, split_words


@register("fineweb", reasons=("fineweb_",), doc="FineWeb rules (fineweb.py).", order=50)
class FineWebConfig(Rule):
    """FineWeb quality rules (datatrove FineWebQualityFilter defaults). Every ratio can be set to null to disable
    its rule."""

    line_punct_ratio: float | None = Field(0.12, ge=0, le=1, description=(
        "Drop documents where fewer than this fraction of lines end in terminal punctuation. FineWeb: 0.12."))
    short_line_length: int = Field(30, ge=0, description=(
        "A line of at most this many characters is short. FineWeb: 30."))
    short_line_ratio: float | None = Field(0.67, ge=0, le=1, description=(
        "Drop documents where more than this fraction of lines are short. FineWeb: 0.67."))
    char_dup_ratio: float | None = Field(0.01, ge=0, description=(
        "Drop documents where more than this fraction of characters are in duplicated lines. FineWeb: 0.01."))
    newline_ratio: float | None = Field(0.3, ge=0, description=(
        "Drop documents with more than this many newlines per word (lists). FineWeb: 0.3."))

    def reason(self, text: str, words: list[str] | None = None) -> Verdict:
        lines = [ln for ln in text.split("\n") if ln.strip() != ""]
        if not lines:
            return "fineweb_empty", "no non-blank line"
        r = sum(ln.endswith(TERMINAL_PUNCTUATION) for ln in lines) / len(lines)
        if self.line_punct_ratio is not None and r < self.line_punct_ratio:
            return "fineweb_line_punct_ratio", beyond("line_punct_ratio", r, "<", self.line_punct_ratio)
        r = sum(len(ln) <= self.short_line_length for ln in lines) / len(lines)
        if self.short_line_ratio is not None and r > self.short_line_ratio:
            return "fineweb_short_line_ratio", beyond("short_line_ratio", r, ">", self.short_line_ratio)
        denom = len(text.replace("\n", ""))
        r = find_duplicates(lines)[1] / denom if denom else 0.0
        if self.char_dup_ratio is not None and r > self.char_dup_ratio:
            return "fineweb_char_dup_ratio", beyond("char_dup_ratio", r, ">", self.char_dup_ratio)
        if self.newline_ratio is not None:
            words = split_words(text) if words is None else words
            r = text.count("\n") / len(words) if words else float("inf")
            if r > self.newline_ratio:
                return "fineweb_list_ratio", beyond("newline_word_ratio", r, ">", self.newline_ratio)
        return None
