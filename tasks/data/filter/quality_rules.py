"""Gopher repetition, C4 and FineWeb quality rules, and language identification, for `tasks/filter.py`.

Each rule family follows datatrove 0.10.1 line by line (huggingface/datatrove, `src/datatrove/pipeline/filters/`),
so that our decisions can be benchmarked against its implementation (`bench/filter_agreement.py`):
- `gopher_repetition_filter.py` (Rae et al. 2021, table A1): duplicate paragraph/line fractions and character
  fractions, top 2/3/4-gram character fractions, duplicated 5..10-gram character fractions;
- `c4_filters.py` `C4QualityFilter` (Raffel et al. 2020, and tensorflow_datasets `c4_utils.py`): line filters
  (too-long word, no terminal punctuation, too few words, "javascript", policy phrases), document filters
  (lorem ipsum, curly bracket, fewer than 5 sentences). Kept lines replace the text, as datatrove does;
- `fineweb_quality_filter.py` (Penedo et al. 2024): line punctuation ratio, short-line ratio, duplicated-line
  character ratio, newline/word ratio.
Thresholds are in `FilterConfig` (tasks/filter.py), each with its source. Words are `split_words` (spaCy's
English tokenizer rules, see tasks/filter.py); sentences follow spaCy's rule-based `sentencizer`, which
datatrove's English sentence splitter uses.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from functools import lru_cache

# --------------------------------------------------------------------------------------------------
# Gopher repetition (datatrove gopher_repetition_filter.py)

_PARAGRAPH = re.compile(r"\n{2,}")
_LINES = re.compile("\n+")


def find_duplicates(xs: list[str]) -> tuple[int, int]:
    """(number of elements seen before, their total characters): datatrove `find_duplicates`."""
    seen: set[str] = set()
    n = chars = 0
    for x in xs:
        if x in seen:
            n += 1
            chars += len(x)
        else:
            seen.add(x)
    return n, chars


def top_ngram_chars(words: list[str], n: int) -> int:
    """Characters covered by the most frequent n-gram (space-joined length x count): datatrove `find_top_duplicate`."""
    counts = Counter(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))
    gram, c = counts.most_common(1)[0]
    return len(gram) * c


def dup_ngram_chars(words: list[str], n: int) -> int:
    """Characters in repeated n-grams, skipping past each repeat: datatrove `find_all_duplicate`."""
    seen: set[str] = set()
    chars = i = 0
    while i < len(words) - n + 1:
        gram = "".join(words[i : i + n])
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


def gopher_repetition_reason(text: str, words: list[str], cfg) -> tuple[str, str] | None:
    if not text:
        return "gopher_rep_empty", "empty text"
    paragraphs = _PARAGRAPH.split(text.strip())
    dup, chars = find_duplicates(paragraphs)
    if cfg.dup_para_frac is not None and dup / len(paragraphs) > cfg.dup_para_frac:
        return "gopher_dup_para_frac", f"dup_para_frac={dup / len(paragraphs):.3g}"
    if cfg.dup_para_char_frac is not None and chars / len(text) > cfg.dup_para_char_frac:
        return "gopher_dup_para_char_frac", f"dup_para_char_frac={chars / len(text):.3g}"
    lines = _LINES.split(text)
    dup, chars = find_duplicates(lines)
    if cfg.dup_line_frac is not None and dup / len(lines) > cfg.dup_line_frac:
        return "gopher_dup_line_frac", f"dup_line_frac={dup / len(lines):.3g}"
    if cfg.dup_line_char_frac is not None and chars / len(text) > cfg.dup_line_char_frac:
        return "gopher_dup_line_char_frac", f"dup_line_char_frac={chars / len(text):.3g}"
    for n, frac in cfg.top_ngram_char_frac:
        if len(words) >= n:
            r = top_ngram_chars(words, n) / len(text)
            if r > frac:
                return f"gopher_top_{n}_gram", f"top_{n}_gram_char_frac={r:.3g}"
    for n, frac in cfg.dup_ngram_char_frac:
        r = dup_ngram_chars(words, n) / len(text)
        if r > frac:
            return f"gopher_dup_{n}_grams", f"dup_{n}_gram_char_frac={r:.3g}"
    return None


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
# C4 (datatrove c4_filters.py C4QualityFilter)

_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
C4_END_PUNCT = (".", "?", "!", '"', "'")
C4_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


def c4_reason(text: str, cfg, split_words) -> tuple[tuple[str, str] | None, str]:
    """(verdict, text with C4's removed lines dropped)."""
    n_sent = 0
    kept: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        words = line.split()
        if cfg.c4_max_word_length is not None and any(len(w) > cfg.c4_max_word_length for w in words):
            continue
        if cfg.c4_remove_citations:
            line = _CITATION.sub("", line)
        if cfg.c4_terminal_punct and (not line.endswith(C4_END_PUNCT) or line.endswith("...")):
            continue
        if cfg.c4_min_words_per_line is not None and len(words) < cfg.c4_min_words_per_line:
            continue
        low = line.lower()
        if cfg.c4_lorem_ipsum and "lorem ipsum" in low:
            return ("c4_lorem_ipsum", "document contains 'lorem ipsum'"), text
        if cfg.c4_javascript and "javascript" in low:
            continue
        if cfg.c4_curly_bracket and "{" in line:
            return ("c4_curly_bracket", "document contains '{'"), text
        if cfg.c4_policy and any(p in low for p in C4_POLICY):
            continue
        if cfg.c4_min_sentences is not None:
            n_sent += count_sentences(split_words(line))
        kept.append(line)
    if cfg.c4_min_sentences is not None and n_sent < cfg.c4_min_sentences:
        return ("c4_too_few_sentences", f"sentences={n_sent}"), text
    return None, "\n".join(kept).strip()


# --------------------------------------------------------------------------------------------------
# FineWeb (datatrove fineweb_quality_filter.py)

# datatrove utils/text.py TERMINAL_PUNCTUATION (FineWeb's default stop_chars), all 159 characters
TERMINAL_PUNCTUATION = tuple("!.?։؝؞؟۔܀܁܂߹࠷࠹࠽࠾।॥၊။።፧፨᙮᜵᜶។៕៖៙៚᠃᠉᥄᥅᪨᪩᪪᪫᭚᭛᭞᭟᭽᭾᰻᰼᱾᱿‼‽⁇⁈⁉⸮⸼⹓⹔。꓿꘎꘏꛳꛷꡶꡷꣎꣏꤯꧈꧉꩝꩞꩟꫰꫱꯫﹒﹖﹗！．？｡\U00010a56\U00010a57\U00010f55\U00010f56\U00010f57\U00010f58\U00010f59\U00010f86\U00010f87\U00010f88\U00010f89\U00011047\U00011048\U000110be\U000110bf\U000110c0\U000110c1\U00011141\U00011142\U00011143\U000111c5\U000111c6\U000111cd\U000111de\U000111df\U00011238\U00011239\U0001123b\U0001123c\U000112a9\U0001144b\U0001144c\U000115c2\U000115c3\U000115c9\U000115ca\U000115cb\U000115cc\U000115cd\U000115ce\U000115cf\U000115d0\U000115d1\U000115d2\U000115d3\U000115d4\U000115d5\U000115d6\U000115d7\U00011641\U00011642\U0001173c\U0001173d\U0001173e\U00011944\U00011946\U00011a42\U00011a43\U00011a9b\U00011a9c\U00011c41\U00011c42\U00011ef7\U00011ef8\U00011f43\U00011f44\U00016a6e\U00016a6f\U00016af5\U00016b37\U00016b38\U00016b44\U00016e98\U0001bc9f\U0001da88")

def fineweb_reason(text: str, words: list[str], cfg, terminal: tuple[str, ...]) -> tuple[str, str] | None:
    lines = [ln for ln in text.split("\n") if ln.strip() != ""]
    if not lines:
        return "fineweb_empty", "no non-blank line"
    r = sum(ln.endswith(terminal) for ln in lines) / len(lines)
    if cfg.fineweb_line_punct_ratio is not None and r < cfg.fineweb_line_punct_ratio:
        return "fineweb_line_punct_ratio", f"line_punct_ratio={r:.3g}"
    r = sum(len(ln) <= cfg.fineweb_short_line_length for ln in lines) / len(lines)
    if cfg.fineweb_short_line_ratio is not None and r > cfg.fineweb_short_line_ratio:
        return "fineweb_short_line_ratio", f"short_line_ratio={r:.3g}"
    denom = len(text.replace("\n", ""))
    r = find_duplicates(lines)[1] / denom if denom else 0.0
    if cfg.fineweb_char_dup_ratio is not None and r > cfg.fineweb_char_dup_ratio:
        return "fineweb_char_dup_ratio", f"char_dup_ratio={r:.3g}"
    if cfg.fineweb_newline_ratio is not None:
        r = text.count("\n") / len(words) if words else float("inf")
        if r > cfg.fineweb_newline_ratio:
            return "fineweb_list_ratio", f"newline_word_ratio={r:.3g}"
    return None


# --------------------------------------------------------------------------------------------------
# language identification: py3langid ships its model (no download at run time)

@lru_cache(maxsize=1)
def _identifier():
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def detect_language(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, probability in [0, 1]) from py3langid's bundled model (97 languages)."""
    lang, score = _identifier().classify(text.replace("\n", " "))
    return lang, float(score)
