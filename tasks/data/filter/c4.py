"""C4 quality rules (Raffel et al. 2020, and tensorflow_datasets `c4_utils.py`), following datatrove 0.10.1
`src/datatrove/pipeline/filters/c4_filters.py` `C4QualityFilter` line by line: line filters (too-long word, no
terminal punctuation, too few words, "javascript", policy phrases), document filters (lorem ipsum, curly bracket,
fewer than 5 sentences). Kept lines replace the text, as datatrove does (`edit`). Sentences follow spaCy's
rule-based `sentencizer`, which datatrove's English sentence splitter uses, over `split_words` tokens.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from typing import ClassVar

from pydantic import Field

from lifecycle.tasks.data.filter.rule import Rule, Verdict, beyond, register
from lifecycle.tasks.data.filter.words import split_words

# --------------------------------------------------------------------------------------------------
# sentences: spaCy's rule-based sentencizer (spacy/pipeline/sentencizer.pyx) over our word tokens

SENT_END = frozenset("!.?։؟۔܀܁܂߹।॥၊။።፧፨᙮᜵᜶᠃᠉᥄᥅᪨᪩᪪᪫᭚᭛᭞᭟᰻᰼᱾᱿‼‽⁇⁈⁉⸮⸼。꓿꘎꘏꛳꛷꡶꡷꣎꣏꤯꧈꧉꩝꩞꩟꫰꫱꯫﹒﹖﹗！．？｡\U00010a56\U00010a57\U00011047\U00011048\U000110be\U000110bf\U000110c0\U000110c1\U00011141\U00011142\U00011143\U000111c5\U000111c6\U000111cd\U000111de\U000111df\U00011238\U00011239\U0001123b\U0001123c\U000112a9\U0001144b\U0001144c\U000115c2\U000115c3\U000115c9\U000115ca\U000115cb\U000115cc\U000115cd\U000115ce\U000115cf\U000115d0\U000115d1\U000115d2\U000115d3\U000115d4\U000115d5\U000115d6\U000115d7\U00011641\U00011642\U0001173c\U0001173d\U0001173e\U00011a42\U00011a43\U00011a9b\U00011a9c\U00011c41\U00011c42\U00016a6e\U00016a6f\U00016af5\U00016b37\U00016b38\U00016b44\U0001bc9f\U0001da88")  # spaCy Sentencizer.default_punct_chars


@lru_cache(maxsize=1 << 16)
def _is_punct(tok: str) -> bool:  # spaCy's lexical `is_punct`: every character is Unicode punctuation
    return all(unicodedata.category(c).startswith("P") for c in tok)


def count_sentences(tokens: list[str]) -> int:
    if not tokens:
        return 0
    n, seen_period = 1, False
    for t in tokens:
        is_end = t in SENT_END
        if seen_period and not is_end and not _is_punct(t):
            n += 1
            seen_period = False
        elif is_end:
            seen_period = True
    return n


# --------------------------------------------------------------------------------------------------
# the rule

_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
C4_END_PUNCT = (".", "?", "!", '"', "'")
C4_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


@register("c4", reasons=("c4_",), doc="C4 rules (c4.py).", order=40)
class C4Config(Rule):
    """C4 rules (datatrove C4QualityFilter defaults, as FineWeb used them). Kept lines replace the text."""

    uses_words: ClassVar[bool] = False  # it splits each kept line itself, for sentences

    terminal_punct: bool = Field(False, description=(
        "Drop lines not ending in . ? ! \" ' (or ending in ...). datatrove default True; FineWeb ran C4 with "
        "filter_no_terminal_punct=False, which is our default."))
    min_words_per_line: int | None = Field(3, ge=0, description="Drop lines with fewer words. C4 / datatrove: 3.")
    max_word_length: int | None = Field(1000, ge=1, description=(
        "Drop lines with a word longer than this. datatrove (from tensorflow_datasets c4_utils): 1000."))
    min_sentences: int | None = Field(5, ge=0, description=(
        "Drop documents with fewer sentences in their kept lines. C4 / datatrove: 5."))
    lorem_ipsum: bool = Field(True, description="Drop documents containing 'lorem ipsum'. C4.")
    javascript: bool = Field(True, description="Drop lines containing 'javascript'. C4.")
    curly_bracket: bool = Field(True, description="Drop documents containing '{'. C4.")
    policy: bool = Field(True, description="Drop lines with 'terms of use', 'privacy policy', cookie phrases. C4.")
    remove_citations: bool = Field(True, description="Remove Wikipedia citation marks ([1], [edit]). datatrove.")

    def reason(self, text: str, words: list[str] | None = None) -> Verdict:
        return _apply(self, text)[0]

    def edit(self, text: str) -> str:
        return _apply(self, text)[1]


@lru_cache(maxsize=4)  # `reason` then `edit` on the same text: one pass
def _apply(cfg: C4Config, text: str) -> tuple[Verdict, str]:
    """(verdict, text with C4's removed lines dropped)."""
    n_sent = 0
    kept: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        words = line.split()
        if cfg.max_word_length is not None and any(len(w) > cfg.max_word_length for w in words):
            continue
        if cfg.remove_citations:
            line = _CITATION.sub("", line)
        if cfg.terminal_punct and (not line.endswith(C4_END_PUNCT) or line.endswith("...")):
            continue
        if cfg.min_words_per_line is not None and len(words) < cfg.min_words_per_line:
            continue
        low = line.lower()
        if cfg.lorem_ipsum and "lorem ipsum" in low:
            return ("c4_lorem_ipsum", "document contains 'lorem ipsum'"), text
        if cfg.javascript and "javascript" in low:
            continue
        if cfg.curly_bracket and "{" in line:
            return ("c4_curly_bracket", "document contains '{'"), text
        if cfg.policy and any(p in low for p in C4_POLICY):
            continue
        if cfg.min_sentences is not None:
            n_sent += count_sentences(split_words(line))
        kept.append(line)
    if cfg.min_sentences is not None and n_sent < cfg.min_sentences:
        return ("c4_too_few_sentences", beyond("sentences", n_sent, "<", cfg.min_sentences)), text
    return None, "\n".join(kept).strip()
