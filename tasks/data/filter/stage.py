"""Quality filter: language ID, Gopher repetition, Gopher quality, C4 and FineWeb rules, in FineWeb's order
(datatrove `examples/fineweb.py`: LanguageFilter, GopherRepetitionFilter, GopherQualityFilter,
C4QualityFilter(filter_no_terminal_punct=False), FineWebQualityFilter). The language, repetition, C4 and FineWeb
rules live in `tasks/quality_rules.py`; each rule has its own reason code, its own threshold field below (null
disables it) and a family switch (language ID and Gopher quality are on by default; Gopher repetition, C4 and
FineWeb are opt-in: `FINEWEB` below is the full FineWeb recipe). Kept rows gain `lang` and `lang_score` columns.

The Gopher quality rules (Rae et al. 2021, "Scaling Language Models: Methods, Analysis &
Insights from Training Gopher", https://arxiv.org/abs/2112.11446, appendix A.1.1), as datatrove implements them
in `src/datatrove/pipeline/filters/gopher_quality_filter.py` (huggingface/datatrove, read at a649de79).

We follow datatrove's arithmetic so that our keep/drop decisions can be benchmarked against it:
- words are the tokens of spaCy's blank English tokenizer (datatrove's English word tokenizer), stripped, empty
  ones dropped. `split_words` below re-implements that tokenizer's rules (whitespace split, prefix/suffix/infix
  punctuation, contractions, abbreviations, emoticons) without importing spaCy. Against spaCy 3.8.18 it gave
  the same tokens for all but 14 of 895,107 whitespace-separated chunks of the Python library and C-API
  reference (text not used to write it), and datatrove 0.10.1 and this filter took the same decision, for the
  same reason, on all 2,130 documents of corpus/python-docs;
- "non-symbol words" are words with at least one character outside datatrove's punctuation set; they are what
  the word-count and mean-word-length rules count;
- the symbol and alphabetic-word ratios divide by all words, punctuation tokens included;
- lines are `str.splitlines()`, blank lines included; stop words are counted as distinct, case-sensitive words.
Differences: a threshold of `None` disables a rule (datatrove also disables on 0, we apply 0 literally); a
document without words (possible only with min_doc_words disabled) fails the alphabetic-word rule instead of
raising ZeroDivisionError; datatrove's two symbol checks (`#`, then ellipsis) share one reason code here, with
the symbol in `detail`.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lifecycle.core.code import code_version
from lifecycle.core.dataset import (
    DatasetRef, StageStats, StagePlan, map_tables, plan_per_file, rejected_table, run_plan,
)
from lifecycle.tasks.data.filter.quality_rules import TERMINAL_PUNCTUATION, c4_reason, detect_language, fineweb_reason, gopher_repetition_reason

STAGE = "filter"
STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")  # Gopher A.1.1; datatrove STOP_WORDS


class FilterConfig(BaseModel):
    """Language, Gopher repetition, Gopher quality, C4 and FineWeb rules. Every threshold can be set to null
    (None) to disable its rule; each family has an on/off switch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # ---- language identification (py3langid, model shipped in the package)
    languages: tuple[str, ...] | None = Field(("en",), description=(
        "Keep documents whose detected language (ISO 639-1) is one of these; null keeps every language (the "
        "language is still detected and stored). FineWeb: English only."))
    lang_threshold: float | None = Field(0.65, ge=0, le=1, description=(
        "Drop documents whose language probability is below this. FineWeb / datatrove LanguageFilter: 0.65."))

    # ---- Gopher repetition (Rae et al. 2021 table A1; datatrove gopher_repetition_filter.py defaults)
    gopher_repetition: bool = Field(False, description="Apply the Gopher repetition rules Off by default (the demo corpus is technical documentation these web-text rules were not made for); FineWeb turns it on.")
    dup_para_frac: float | None = Field(0.3, ge=0, description="Max fraction of duplicated paragraphs. Gopher: 0.30.")
    dup_para_char_frac: float | None = Field(0.2, ge=0, description=(
        "Max fraction of characters in duplicated paragraphs. Gopher: 0.20."))
    dup_line_frac: float | None = Field(0.3, ge=0, description="Max fraction of duplicated lines. Gopher: 0.30.")
    dup_line_char_frac: float | None = Field(0.2, ge=0, description=(
        "Max fraction of characters in duplicated lines. Gopher: 0.20."))
    top_ngram_char_frac: tuple[tuple[int, float], ...] = Field(((2, 0.2), (3, 0.18), (4, 0.16)), description=(
        "(n, max fraction of characters covered by the most frequent n-gram). Gopher: 2: 0.20, 3: 0.18, 4: 0.16."))
    dup_ngram_char_frac: tuple[tuple[int, float], ...] = Field(
        ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10)), description=(
            "(n, max fraction of characters in duplicated n-grams). Gopher: 5: 0.15 ... 10: 0.10."))

    # ---- Gopher quality (Rae et al. 2021 A.1.1; datatrove gopher_quality_filter.py)
    gopher_quality: bool = Field(True, description="Apply the Gopher quality rules below.")

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

    # ---- C4 (Raffel et al. 2020; datatrove c4_filters.py C4QualityFilter defaults, as FineWeb used them)
    c4: bool = Field(False, description="Apply the C4 rules (C4QualityFilter); kept lines replace the text Off by default (the demo corpus is technical documentation these web-text rules were not made for); FineWeb turns it on.")
    c4_terminal_punct: bool = Field(False, description=(
        "Drop lines not ending in . ? ! \" ' (or ending in ...). datatrove default True; FineWeb ran C4 with "
        "filter_no_terminal_punct=False, which is our default."))
    c4_min_words_per_line: int | None = Field(3, ge=0, description="Drop lines with fewer words. C4 / datatrove: 3.")
    c4_max_word_length: int | None = Field(1000, ge=1, description=(
        "Drop lines with a word longer than this. datatrove (from tensorflow_datasets c4_utils): 1000."))
    c4_min_sentences: int | None = Field(5, ge=0, description=(
        "Drop documents with fewer sentences in their kept lines. C4 / datatrove: 5."))
    c4_lorem_ipsum: bool = Field(True, description="Drop documents containing 'lorem ipsum'. C4.")
    c4_javascript: bool = Field(True, description="Drop lines containing 'javascript'. C4.")
    c4_curly_bracket: bool = Field(True, description="Drop documents containing '{'. C4.")
    c4_policy: bool = Field(True, description="Drop lines with 'terms of use', 'privacy policy', cookie phrases. C4.")
    c4_remove_citations: bool = Field(True, description="Remove Wikipedia citation marks ([1], [edit]). datatrove.")

    # ---- FineWeb (Penedo et al. 2024; datatrove fineweb_quality_filter.py defaults)
    fineweb: bool = Field(False, description="Apply the FineWeb quality rules Off by default (the demo corpus is technical documentation these web-text rules were not made for); FineWeb turns it on.")
    fineweb_line_punct_ratio: float | None = Field(0.12, ge=0, le=1, description=(
        "Drop documents where fewer than this fraction of lines end in terminal punctuation. FineWeb: 0.12."))
    fineweb_short_line_length: int = Field(30, ge=0, description="A line of at most this many characters is short. FineWeb: 30.")
    fineweb_short_line_ratio: float | None = Field(0.67, ge=0, le=1, description=(
        "Drop documents where more than this fraction of lines are short. FineWeb: 0.67."))
    fineweb_char_dup_ratio: float | None = Field(0.01, ge=0, description=(
        "Drop documents where more than this fraction of characters are in duplicated lines. FineWeb: 0.01."))
    fineweb_newline_ratio: float | None = Field(0.3, ge=0, description=(
        "Drop documents with more than this many newlines per word (lists). FineWeb: 0.3."))

    @model_validator(mode="after")
    def _check(self) -> "FilterConfig":
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


FINEWEB = FilterConfig(gopher_repetition=True, c4=True, fineweb=True)  # FineWeb's full rule set


# --------------------------------------------------------------------------------------------------
# word splitting: spaCy's blank("en") tokenizer rules (spacy/lang/punctuation.py, lang/en/*), re-implemented

_PUNCT = "…,:;!?¿¡()[]{}<>_#*&。？！，、；：～·।،۔؛٪"
_QUOTES = "'\"”“`‘´’‚,„»«「」『』（）〔〕【】《》〈〉〈〉⟦⟧"
_CURRENCY = frozenset("$£€¥฿₽﷼₴" + "".join(map(chr, range(0x20A0, 0x20C0))))
_PREFIX_CHARS = frozenset("§%=—–" + _PUNCT + _QUOTES) | _CURRENCY
_SUFFIX_CHARS = frozenset(_PUNCT + _QUOTES + "—–")
_DOT_AFTER = frozenset("%²-+|()?:" + _PUNCT + _QUOTES)  # a final "." splits off after these (or a-z, 0-9)
_UNITS = frozenset("km km² km³ m m² m³ dm dm² dm³ cm cm² cm³ mm mm² mm³ ha µm nm yd in ft kg g mg µg t lb oz "
                   "m/s km/h kmh mph hPa Pa mbar mb MB kb KB gb GB tb TB T G M K %".split())
_LOWER, _UPPER, _ALPHA, _Q = "a-zß-öø-ÿ", "A-ZÀ-ÖØ-Þ", r"^\W\d_", re.escape(_QUOTES)
_INFIX = re.compile(
    rf"\.\.+|…|(?<=[0-9])[+\-*^](?=[0-9-])|(?<=[{_LOWER}{_Q}])\.(?=[{_UPPER}{_Q}])|(?<=[{_ALPHA}]),(?=[{_ALPHA}])"
    rf"|(?<=[^\W_])(?:-|–|—|--|---|——|~)(?=[{_ALPHA}])|(?<=[^\W_])[:<>=/](?=[{_ALPHA}])"
)
_URL = re.compile(  # host names with a lowercase TLD, optional scheme, user, port and path: kept whole
    r"(?:[\w+.-]{2,}://)?(?:\S+(?::\S*)?@)?(?:[A-Za-z0-9\u00a1-\uffff](?:[A-Za-z0-9\u00a1-\uffff_-]{0,62}"
    rf"[A-Za-z0-9\u00a1-\uffff])?\.)+[{_LOWER}]{{2,63}}(?::\d{{2,5}})?(?:[/?#]\S*)?"
)


def _build_specials() -> dict[str, tuple[str, ...]]:
    """Strings the tokenizer splits (or keeps) by table: contractions, abbreviations, emoticons."""
    sp: dict[str, tuple[str, ...]] = {}

    def add(*parts: str) -> None:
        for apo in ("'", "’"):
            ps = tuple(p.replace("'", apo) for p in parts)
            sp["".join(ps)] = ps

    def cased(words: str, *suffixes: str) -> None:
        for w in words.split():
            for form in (w, w.title()):
                for suf in suffixes:
                    add(form, suf)

    cased("ai are ca could dare did do does had has have is may might must need ought sha should was were wo "
          "would", "n't", "nt")
    cased("i", "'m", "m")
    cased("i you he she it we they", "'ll", "ll", "'d", "d")
    cased("i you we they", "'ve", "ve")
    cased("you we they", "'re", "re")
    cased("he she it who what when where why how there that this", "'s", "s")
    cased("who what when where why how there that this these those", "'ll", "ll", "'re", "re", "'ve", "ve", "'d", "d")
    cased("can", "not")
    for h in range(1, 13):
        for period in ("a.m.", "am", "p.m.", "pm"):
            sp[f"{h}{period}"] = (str(h), period)
    for s in (
        "'s 'S 'd 'll 're 'em 'bout 'cause 'cos 'coz 'cuz 'nuff ' '' ma'am Ma'am o'clock O'clock ol' Ol' a.m. "
        "p.m. e.g. E.g. E.G. i.e. I.e. I.E. vs. v.s. co. Co. Corp. Inc. Ltd. Bros. Messrs. Mr. Mrs. Ms. Dr. Prof. "
        "Rev. Sen. Rep. Gen. Gov. Adm. St. Mt. Jr. Ph.D. D.C. Md. Mo. Mont. Jan. Feb. Mar. Apr. Jun. Jul. Aug. "
        "Sep. Sept. Oct. Nov. Dec. C++ and/or w/o \\n \\t \\\") — ’’ ä. ö. ü. (: ): (= =) (; ;) :( :) :(( :)) "
        ":((( :))) :() :-) :-( :-)) :-(( :/ =/ :| =| :] :[ =] =[ ]= [: [= [-: :} :* :> :0 :1 :3 :D :O :P :X :o :p "
        ":x :o) :-/ :-| :-] :-} :-* :-0 :-3 :-> :-D :-O :-P :-X :-o :-p :-x (-: (-; (-8 )-: (o: :'( :') :'-( :'-) "
        ";-) ;-D ;D ;_; 8) 8-) 8-D 8D =3 =D <3 <33 <333 </3 -_- -__- ^_^ ^__^ ^___^ ._. 0.0 0.o 0_0 0_o o.0 o.O "
        "o.o o_0 o_O o_o O.O O.o O_O O_o v.v V.V v_v V_V <.< >.< >.> @_@ >:( >:o (^_^) (>_<) (-_-) (._.) (*_*)"
    ).split():
        add(s)
    for c in "abcdefghijklmnopqrstuvwxyz":
        sp[c + "."] = (c + ".",)
    for s in "Ill ill Its its Hell hell Shell shell Shed shed were Were Well well Whore whore".split():
        sp.pop(s, None)  # real words that look like contractions
    return sp


_SPECIALS = _build_specials()
_AFFIX_SPECIALS = {k for k in _SPECIALS if not k.isalnum()}  # re-joined when affix rules cut them apart


def _prefix_len(s: str) -> int:
    c = s[0]
    if s.startswith(".."):
        return len(s) - len(s.lstrip("."))
    if c in _PREFIX_CHARS or unicodedata.category(c) == "So" or (c == "+" and not s[1:2].isdigit()):
        return 1
    return 3 if s.startswith("US$") else 2 if s.startswith(("C$", "A$")) else 0


def _is_suffix(s: str, p: int) -> bool:
    tail, prev, prev2 = s[p:], s[p - 1 : p], s[p - 2 : p - 1] if p >= 2 else ""
    if tail in _SUFFIX_CHARS or (len(tail) == 1 and unicodedata.category(tail) == "So"):
        return True
    if tail in ("……", "'s", "'S", "’s", "’S"):
        return True
    if tail == ".":
        return bool(prev) and (prev.isdigit() or prev in _DOT_AFTER or (prev.isalpha() and not prev.isupper())
                               or (prev2 == "°" and prev in "FfCcKk") or (prev.isupper() and prev2.isupper()))
    return prev.isdigit() and (tail == "+" or tail in _UNITS or tail in _CURRENCY or tail in ("US$", "C$", "A$"))


def _suffix_len(s: str) -> int:
    if s.endswith(".."):
        return len(s) - len(s.rstrip("."))
    return next((len(s) - p for p in range(max(0, len(s) - 4), len(s)) if _is_suffix(s, p)), 0)


@lru_cache(maxsize=1 << 17)
def _split_chunk(s: str) -> tuple[str, ...]:
    """Tokens of one whitespace-free chunk, following spaCy's Tokenizer._split_affixes/_attach_tokens."""
    if s in _SPECIALS:
        return _SPECIALS[s]
    prefixes: list[str] = []
    suffixes: list[str] = []
    last = -1
    while s and len(s) != last and s not in _SPECIALS:
        last = len(s)
        pre = _prefix_len(s)
        if pre and s[pre:] in _SPECIALS:
            prefixes.append(s[:pre])
            s = s[pre:]
            break
        suf = _suffix_len(s[pre:])
        if suf and s[:-suf] in _SPECIALS:
            suffixes.append(s[-suf:])
            s = s[:-suf]
            break
        if pre:
            prefixes.append(s[:pre])
        if suf and pre + suf <= len(s):
            suffixes.append(s[-suf:])
            s = s[pre:-suf]
        else:
            s = s[pre:]
    middle: list[str] = []
    if s in _SPECIALS:
        middle = list(_SPECIALS[s])
    elif s and _URL.fullmatch(s):
        middle = [s]
    elif s:
        start = 0
        for m in _INFIX.finditer(s):
            a, b = m.span()
            if a == 0:
                continue
            middle += [s[start:a]] if a != start else []
            middle += [s[a:b]] if a != b else []
            start = b
        middle += [s[start:]] if s[start:] else []
    return tuple(_join_specials(prefixes + middle + suffixes[::-1]))


def _join_specials(toks: list[str]) -> list[str]:
    """Re-join runs of tokens that spell a special case containing affix characters (`):`, `''`, `'d`)."""
    spans = [(i, j) for i in range(len(toks)) for j in range(i + 2, min(len(toks), i + 6) + 1)
             if "".join(toks[i:j]) in _AFFIX_SPECIALS]
    if not spans:
        return toks
    taken, chosen = set(), []
    for i, j in sorted(spans, key=lambda s: (s[0] - s[1], s[0])):  # longest first, then leftmost
        if taken.isdisjoint(range(i, j)):
            taken.update(range(i, j))
            chosen.append((i, j))
    out, k = [], 0
    for i, j in sorted(chosen):
        out += toks[k:i] + list(_SPECIALS["".join(toks[i:j])])
        k = j
    return out + toks[k:]


def split_words(text: str) -> list[str]:
    """Words as datatrove's English Gopher filter sees them (see module docstring)."""
    return [t for chunk in text.split() for t in _split_chunk(chunk)]


# datatrove's PUNCTUATION_SET (utils/text.py): its ASCII/CJK punctuation and C0/C1 control characters, plus
# the common sentence terminals of its ~160-entry TERMINAL_PUNCTUATION (the rest are rare non-Latin scripts).
_SYMBOLS = frozenset(
    "!/—”:％〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
    "‼⁇⁈⁉｡﹒﹖﹗։؟۔।॥።፧"
    + "".join(map(chr, [*range(0, 9), 11, 12, *range(13, 32), *range(127, 160)]))
)


# --------------------------------------------------------------------------------------------------
# the rules


def gopher_reason(text: str, cfg: FilterConfig, words: list[str] | None = None) -> tuple[str, str] | None:
    """(reason, detail) for the first Gopher quality rule `text` fails, in datatrove's order; None if it passes."""
    words = split_words(text) if words is None else words
    n_words = len(words)
    lengths = [len(w) for w in words if any(ch not in _SYMBOLS for ch in w)]
    n = len(lengths)
    if cfg.min_doc_words is not None and n < cfg.min_doc_words:
        return "gopher_short_doc", f"words={n}"
    if cfg.max_doc_words is not None and n > cfg.max_doc_words:
        return "gopher_long_doc", f"words={n}"
    if n:  # mean over no words is undefined: both length rules pass
        avg = sum(lengths) / n
        if cfg.min_avg_word_length is not None and avg < cfg.min_avg_word_length:
            return "gopher_below_avg_word_len", f"avg_word_len={avg:.3g}"
        if cfg.max_avg_word_length is not None and avg > cfg.max_avg_word_length:
            return "gopher_above_avg_word_len", f"avg_word_len={avg:.3g}"
    if cfg.max_symbol_word_ratio is not None and n_words:
        hashes = text.count("#") / n_words
        if hashes > cfg.max_symbol_word_ratio:
            return "gopher_symbol_ratio", f"hash_ratio={hashes:.3g}"
        ellipses = (text.count("...") + text.count("…")) / n_words
        if ellipses > cfg.max_symbol_word_ratio:
            return "gopher_symbol_ratio", f"ellipsis_ratio={ellipses:.3g}"
    lines = text.splitlines()
    if cfg.max_bullet_lines_ratio is not None and lines:
        bullets = sum(s.lstrip().startswith(cfg.bullet_prefixes) for s in lines) / len(lines)
        if bullets > cfg.max_bullet_lines_ratio:
            return "gopher_bullet_lines", f"bullet_lines={bullets:.3g}"
    if cfg.max_ellipsis_lines_ratio is not None and lines:
        ends = sum(s.rstrip().endswith(("...", "…")) for s in lines) / len(lines)
        if ends > cfg.max_ellipsis_lines_ratio:
            return "gopher_ellipsis_lines", f"ellipsis_lines={ends:.3g}"
    if cfg.min_alpha_words_ratio is not None:
        alpha = sum(any(c.isalpha() for c in w) for w in words) / n_words if n_words else 0.0
        if alpha < cfg.min_alpha_words_ratio:
            return "gopher_alpha_ratio", f"alpha_words={alpha:.3g}"
    if cfg.min_stop_words is not None:
        found = len(set(cfg.stop_words).intersection(words))
        if found < cfg.min_stop_words:
            return "gopher_stop_words", f"stop_words={found}"
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


def document_verdict(text: str, cfg: FilterConfig) -> tuple[tuple[str, str] | None, str, str, float]:
    """(first failing rule as (reason, detail) or None, text after C4's line removal, lang, lang_score)."""
    lang, score = detect_language(text)
    if cfg.languages is not None and lang not in cfg.languages:
        return ("lang_not_kept", f"lang={lang} score={score:.3f}"), text, lang, score
    if cfg.lang_threshold is not None and score < cfg.lang_threshold:
        return ("lang_low_score", f"lang={lang} score={score:.3f}"), text, lang, score
    words = split_words(text)
    if cfg.gopher_repetition and (v := gopher_repetition_reason(text, words, cfg)):
        return v, text, lang, score
    if cfg.gopher_quality and (v := gopher_reason(text, cfg, words)):
        return v, text, lang, score
    if cfg.c4:
        v, new = c4_reason(text, cfg, split_words)
        if v:
            return v, text, lang, score
        if new != text:
            text, words = new, split_words(new)
    if cfg.fineweb and (v := fineweb_reason(text, words, cfg, TERMINAL_PUNCTUATION)):
        return v, text, lang, score
    return None, text, lang, score


def filter_table(table: pa.Table, cfg: FilterConfig) -> tuple[pa.Table, pa.Table, StageStats]:
    """(kept rows, rejected rows, stats). Kept rows keep the input columns (text after C4's line removal) plus
    `lang` and `lang_score`; the first failing rule is the reason."""
    texts = table.column("text").to_pylist()
    doc_ids = table.column("doc_id").to_pylist()
    source_ids = table.column("source_id").to_pylist()
    keep: list[bool] = []
    out_texts, langs, scores = [], [], []
    rejected: list[dict] = []
    stats = StageStats(rows_in=table.num_rows)
    for doc_id, source_id, text in zip(doc_ids, source_ids, texts):
        if text is None:
            raise ValueError(f"{STAGE}: row doc_id={doc_id!r} source_id={source_id!r} has a null text")
        size = len(text.encode("utf-8"))
        stats.bytes_in += size
        verdict, new_text, lang, score = document_verdict(text, cfg)
        keep.append(verdict is None)
        if verdict is None:
            out_texts.append(new_text)
            langs.append(lang)
            scores.append(score)
            stats.bytes_out += len(new_text.encode("utf-8"))
            stats.counters["c4_lines_removed_docs"] += new_text != text
        else:
            rejected.append({"doc_id": doc_id, "source_id": source_id, "reason": verdict[0], "detail": verdict[1]})
            stats.rejected[verdict[0]] += 1
    stats.rows_kept = sum(keep)
    kept = table.filter(pa.array(keep, type=pa.bool_())) if table.num_rows else table
    idx = kept.schema.get_field_index("text")
    kept = kept.set_column(idx, kept.schema.field(idx), pa.array(out_texts, pa.string()))
    kept = kept.append_column("lang", pa.array(langs, pa.string()))
    kept = kept.append_column("lang_score", pa.array(scores, pa.float32()))
    return kept, rejected_table(rejected, STAGE), stats


# --------------------------------------------------------------------------------------------------
# stage entry (no Prefect, no MLflow)


def filter_shard(cfg: FilterConfig, files: list[str], writer) -> StageStats:
    return map_tables(files, writer, lambda table: filter_table(table, cfg))


def plan_filter(parent: DatasetRef, cfg: FilterConfig, workdir: str) -> StagePlan | DatasetRef:
    """One shard per kept file of `parent`; the committed dataset instead if it exists."""
    return plan_per_file(workdir, STAGE, cfg, code_version(__package__), parent, filter_shard)


def run_filter(parent: DatasetRef, cfg: FilterConfig, workdir: str) -> DatasetRef:
    """Filter every kept file of `parent`, one file at a time, into a committed `filter` dataset."""
    return run_plan(plan_filter(parent, cfg, workdir))
