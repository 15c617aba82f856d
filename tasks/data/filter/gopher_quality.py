"""Gopher quality rules (Rae et al. 2021, "Scaling Language Models: Methods, Analysis & Insights from Training
Gopher", https://arxiv.org/abs/2112.11446, appendix A.1.1), as datatrove implements them in
`src/datatrove/pipeline/filters/gopher_quality_filter.py` (huggingface/datatrove, read at a649de79).

We follow datatrove's arithmetic so that our keep/drop decisions can be benchmarked against it:
- words are `split_words` (words.py: spaCy's blank English tokenizer, datatrove's English word tokenizer);
- "non-symbol words" are words with at least one character outside datatrove's punctuation set (words.SYMBOLS);
  they are what the word-count and mean-word-length rules count;
- the symbol and alphabetic-word ratios divide by all words, punctuation tokens included;
- lines are `str.splitlines()`, blank lines included; stop words are counted as distinct, case-sensitive words.
Differences: a threshold of `None` disables a rule (datatrove also disables on 0, we apply 0 literally); a
document without words (possible only with min_doc_words disabled) fails the alphabetic-word rule instead of
raising ZeroDivisionError; datatrove's two symbol checks (`#`, then ellipsis) share one reason code here, with
the symbol in `detail`.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field, model_validator

from lifecycle.tasks.data.filter.rule import MarkupAware, Verdict, beyond, register
from lifecycle.tasks.data.filter.words import SYMBOLS, split_words

@lru_cache(maxsize=1 << 17)  # words repeat: one test per distinct word
def _has_alpha(word: str) -> bool:
    return any(c.isalpha() for c in word)


STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")  # Gopher A.1.1; datatrove STOP_WORDS


@register("gopher_quality", reasons=("gopher_",), doc="Gopher quality rules (gopher_quality.py).", order=30)
class GopherQualityConfig(MarkupAware):
    """Gopher quality rules (datatrove GopherQualityFilter). Every threshold can be set to null to disable its
    rule."""

    min_doc_words: int | None = Field(50, ge=0, description=(
        "Drop documents with fewer non-symbol words. Gopher A.1.1 / datatrove: 50."))
    max_doc_words: int | None = Field(100_000, ge=0, description=(
        "Drop documents with more non-symbol words. Gopher A.1.1 / datatrove: 100,000."))
    min_avg_word_length: float | None = Field(3, ge=0, description=(
        "Drop documents whose mean non-symbol word length (characters) is below this. Gopher / datatrove: 3."))
    max_avg_word_length: float | None = Field(10, ge=0, description=(
        "Drop documents whose mean non-symbol word length is above this. Gopher / datatrove: 10."))
    max_symbol_word_ratio: float | None = Field(0.1, ge=0, description=(
        "Drop documents where count('#') / words, or (count('...') + count('…')) / words, exceeds this. "
        "Gopher A.1.1 / datatrove: 0.1."))
    max_bullet_lines_ratio: float | None = Field(0.9, ge=0, le=1, description=(
        "Drop documents where more than this fraction of lines start with a bullet (see bullet_prefixes). "
        "Gopher A.1.1 / datatrove: 0.9."))
    max_ellipsis_lines_ratio: float | None = Field(0.3, ge=0, le=1, description=(
        "Drop documents where more than this fraction of lines end with '...' or '…'. Gopher / datatrove: 0.3."))
    min_alpha_words_ratio: float | None = Field(0.8, ge=0, le=1, description=(
        "Drop documents where fewer than this fraction of words contain an alphabetic character. Gopher A.1.1 / "
        "datatrove: 0.8 (datatrove names it max_non_alpha_words_ratio, which its own TODO calls a misnomer)."))
    min_stop_words: int | None = Field(2, ge=0, description=(
        "Drop documents containing fewer than this many distinct stop words. Gopher A.1.1 / datatrove: 2."))
    stop_words: tuple[str, ...] = Field(STOP_WORDS, description=(
        "The stop words (matched case-sensitively, as datatrove does). Gopher A.1.1: the, be, to, of, and, "
        "that, have, with."))
    bullet_prefixes: tuple[str, ...] = Field(("•", "-"), description=(
        "A line is a bullet line if it starts with one of these after leading whitespace. datatrove: '•', '-'."))

    @model_validator(mode="after")
    def _check(self) -> "GopherQualityConfig":
        for lo, hi in (("min_doc_words", "max_doc_words"), ("min_avg_word_length", "max_avg_word_length")):
            a, b = getattr(self, lo), getattr(self, hi)
            if a is not None and b is not None and a > b:
                raise ValueError(f"{lo} ({a}) must be <= {hi} ({b})")
        if self.min_stop_words is not None and self.min_stop_words > len(set(self.stop_words)):
            raise ValueError(f"min_stop_words ({self.min_stop_words}) exceeds the {len(set(self.stop_words))} "
                             "distinct stop_words: every document would be dropped")
        if any(not p for p in self.bullet_prefixes):
            raise ValueError("bullet_prefixes must not contain an empty string (it would match every line)")
        return self

    def reason(self, text: str, words: list[str] | None = None) -> Verdict:
        """The first Gopher quality rule `text` fails, in datatrove's order."""
        text, words = self.own_view(text, words)
        words = split_words(text) if words is None else words
        n_words = len(words)
        lengths = [len(w) for w in words if not SYMBOLS.issuperset(w)]  # a character outside SYMBOLS
        n = len(lengths)
        if self.min_doc_words is not None and n < self.min_doc_words:
            return "gopher_short_doc", beyond("words", n, "<", self.min_doc_words)
        if self.max_doc_words is not None and n > self.max_doc_words:
            return "gopher_long_doc", beyond("words", n, ">", self.max_doc_words)
        if n:  # mean over no words is undefined: both length rules pass
            avg = sum(lengths) / n
            if self.min_avg_word_length is not None and avg < self.min_avg_word_length:
                return "gopher_below_avg_word_len", beyond("avg_word_len", avg, "<", self.min_avg_word_length)
            if self.max_avg_word_length is not None and avg > self.max_avg_word_length:
                return "gopher_above_avg_word_len", beyond("avg_word_len", avg, ">", self.max_avg_word_length)
        if self.max_symbol_word_ratio is not None and n_words:
            hashes = text.count("#") / n_words
            if hashes > self.max_symbol_word_ratio:
                return "gopher_symbol_ratio", beyond("hash_ratio", hashes, ">", self.max_symbol_word_ratio)
            ellipses = (text.count("...") + text.count("…")) / n_words
            if ellipses > self.max_symbol_word_ratio:
                return "gopher_symbol_ratio", beyond("ellipsis_ratio", ellipses, ">", self.max_symbol_word_ratio)
        lines = text.splitlines()
        if self.max_bullet_lines_ratio is not None and lines:
            bullets = sum(s.lstrip().startswith(self.bullet_prefixes) for s in lines) / len(lines)
            if bullets > self.max_bullet_lines_ratio:
                return "gopher_bullet_lines", beyond("bullet_lines", bullets, ">", self.max_bullet_lines_ratio)
        if self.max_ellipsis_lines_ratio is not None and lines:
            ends = sum(s.rstrip().endswith(("...", "…")) for s in lines) / len(lines)
            if ends > self.max_ellipsis_lines_ratio:
                return "gopher_ellipsis_lines", beyond("ellipsis_lines", ends, ">", self.max_ellipsis_lines_ratio)
        if self.min_alpha_words_ratio is not None:
            alpha = sum(map(_has_alpha, words)) / n_words if n_words else 0.0
            if alpha < self.min_alpha_words_ratio:
                return "gopher_alpha_ratio", beyond("alpha_words", alpha, "<", self.min_alpha_words_ratio)
        if self.min_stop_words is not None:
            found = len(set(self.stop_words).intersection(words))
            if found < self.min_stop_words:
                return "gopher_stop_words", beyond("stop_words", found, "<", self.min_stop_words)
        return None


# datatrove's reason for each of ours, for agreement benchmarks (its two symbol reasons map to one of ours)
DATATROVE_REASONS = {
    "gopher_short_doc": "gopher_short_doc",
    "gopher_long_doc": "gopher_long_doc",
    "gopher_below_avg_word_len": "gopher_below_avg_threshold",
    "gopher_above_avg_word_len": "gopher_above_avg_threshold",
    "gopher_symbol_ratio": ("gopher_too_many_hashes", "gopher_too_many_ellipsis"),
    "gopher_bullet_lines": "gopher_too_many_bullets",
    "gopher_ellipsis_lines": "gopher_too_many_end_ellipsis",
    "gopher_alpha_ratio": "gopher_below_alpha_threshold",
    "gopher_stop_words": "gopher_enough_stop_words",
}
