"""Text units every rule family shares: words, datatrove's punctuation sets, duplicate counting.

Words are the tokens of spaCy's blank English tokenizer (datatrove's English word tokenizer), stripped, empty ones
dropped. `split_words` re-implements that tokenizer's rules (whitespace split, prefix/suffix/infix punctuation,
contractions, abbreviations, emoticons) without importing spaCy. Against spaCy 3.8.18 it gave the same tokens for
all but 14 of 895,107 whitespace-separated chunks of the Python library and C-API reference (text not used to write
it), and datatrove 0.10.1 and our Gopher quality rule took the same decision, for the same reason, on all 2,130
documents of corpus/python-docs.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

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
_URL_SCHEME = re.compile(r"[\w+.-]{2,}://")
_URL_HOST = re.compile(  # what follows the user part: host names with a lowercase TLD, port and path
    r"(?:[A-Za-z0-9\u00a1-\uffff](?:[A-Za-z0-9\u00a1-\uffff_-]{0,62}[A-Za-z0-9\u00a1-\uffff])?\.)+"
    rf"[{_LOWER}]{{2,63}}(?::\d{{2,5}})?(?:[/?#]\S*)?"
)
# kept whole: optional scheme and user, then the host part (spaCy's URL_MATCH); `_is_url` tries it in pieces
_URL = re.compile(rf"(?:{_URL_SCHEME.pattern})?(?:\S+(?::\S*)?@)?{_URL_HOST.pattern}")
_DOTS = re.compile(r"\.+")


def _is_url(s: str) -> bool:
    """`_URL.fullmatch(s)` for a chunk without whitespace, in linear time. The regex backtracks over its user part
    (`\\S+(?::\\S*)?@`, spaCy's) at every `:` of a chunk: a search index of 830 KB without a space (Rust's
    searchindex.json) took minutes (docs/benchmarks.md, "Issue 25: 2.3 GB, the same mix at every size, and three
    fixes it found"). In a chunk without whitespace that part is any non-empty run ending in `@`,
    so the host part starts at 0, after the scheme, or after an `@` that follows at least one character."""
    if len(s) <= 256:  # the backtracking is bounded: one regex call is cheaper
        return _URL.fullmatch(s) is not None
    bases = [0]
    if m := _URL_SCHEME.match(s):  # the scheme's class has no ":": where it ends is fixed
        bases.append(m.end())
    for base in bases:
        if _URL_HOST.fullmatch(s, base):
            return True
        at = s.find("@", base + 1)
        while at != -1:
            if _URL_HOST.fullmatch(s, at + 1):
                return True
            at = s.find("@", at + 1)
    return False


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
_LONGEST_SPECIAL = max(map(len, _SPECIALS))
_AFFIX_SPECIALS = {k for k in _SPECIALS if not k.isalnum()}  # re-joined when affix rules cut them apart
_AFFIX_PREFIXES = frozenset(k[:i] for k in _AFFIX_SPECIALS for i in range(len(k) + 1))

# Fast path of `_split_chunk`: a word (letters of any script: str.isalpha) or an ASCII number, optionally after one
# ASCII prefix character and before one ASCII suffix character (`(word`, `word,`, `"wörter"`, `12)`). For these the
# rules below always give (prefix, core, suffix) unless a special case is involved, which the fast path checks.
_FAST_PREFIX = "".join(sorted(c for c in _PREFIX_CHARS if c.isascii() and c not in ".+$"))
_FAST_SUFFIX = "".join(sorted(c for c in _SUFFIX_CHARS if c.isascii() and c != "."))
_WRAPPED = re.compile(rf"([{re.escape(_FAST_PREFIX)}]?)([^\W\d_]+|[0-9]+)([{re.escape(_FAST_SUFFIX)}]?)")


def _prefix_len(s: str) -> int:
    c = s[0]
    if c.isascii() and c.isalnum() and c not in "UCA":  # none of the rules below starts with these
        return 0
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


# every suffix of two or more characters `_is_suffix` can accept (the others are single characters), so that a
# longer tail outside this set is rejected without evaluating the rules
_LONG_SUFFIXES = frozenset({"……", "'s", "'S", "’s", "’S", "US$", "C$", "A$"} | {u for u in _UNITS if len(u) > 1})


def _suffix_len(s: str) -> int:
    """Length of the longest suffix of `s` (at most 4 characters) `_is_suffix` accepts, 0 if none."""
    if s.endswith(".."):
        return len(s) - len(s.rstrip("."))
    n = len(s)
    for p in range(max(0, n - 4), n - 1):
        if s[p:] in _LONG_SUFFIXES and _is_suffix(s, p):
            return n - p
    return 1 if n and _is_suffix(s, n - 1) else 0


def _dots_after(c: str, a: int, b: int) -> int:
    """Length of the run of dots that starts at c[a] (within c[a:b])."""
    return _DOTS.match(c, a, b).end() - a


def _dots_before(c: str, a: int, b: int) -> int:
    """Length of the run of dots that ends at c[b - 1] (within c[a:b])."""
    k = b
    while k > a and c[k - 1] == ".":
        k -= 1
    return b - k


@lru_cache(maxsize=1 << 17)
def _split_chunk(s: str) -> tuple[str, ...]:
    """Tokens of one whitespace-free chunk, following spaCy's Tokenizer._split_affixes/_attach_tokens."""
    if s in _SPECIALS:
        return _SPECIALS[s]
    if m := _WRAPPED.fullmatch(s):  # a prefix char is cut off, then a suffix char, then the core is one token,
        pre, core, suf = m.groups()  # unless one of the strings the rules look up is a special case ([^\W\d_]
        if ((core.isalpha() or core.isascii())  # also has non-decimal digits such as "²": those take the rules)
                and core not in _SPECIALS and pre + core not in _SPECIALS and core + suf not in _SPECIALS):
            return tuple(t for t in (pre, core, suf) if t)
    # the affixes are cut off by moving two indices over the chunk `c`: what is left is c[i:j] (slicing it anew at
    # each step, and looking it up in _SPECIALS, made a chunk of 100,000 closing brackets quadratic). The rules
    # look at most 4 characters in (6 at the end), except for a run of dots, which is cut whole.
    c, i, j, last, longest = s, 0, len(s), -1, _LONGEST_SPECIAL
    prefixes: list[str] = []
    suffixes: list[str] = []
    while i < j and j - i != last and not (j - i <= longest and c[i:j] in _SPECIALS):
        last = j - i
        pre = _prefix_len(c[i:i + 4] if j - i > 4 else c[i:j])
        if pre > 1 and c.startswith("..", i, j):  # a run of dots, which may go on past the 4 characters
            pre = _dots_after(c, i, j)
        if pre and j - i - pre <= longest and c[i + pre:j] in _SPECIALS:
            prefixes.append(c[i:i + pre])
            i += pre
            break
        a = i + pre
        suf = _suffix_len(c[j - 6:j] if j - a > 6 else c[a:j])
        if suf > 1 and c.endswith("..", a, j):
            suf = _dots_before(c, a, j)
        if suf and j - suf - i <= longest and c[i:j - suf] in _SPECIALS:
            suffixes.append(c[j - suf:j])
            j -= suf
            break
        if pre:
            prefixes.append(c[i:a])
        if suf and pre + suf <= j - i:
            suffixes.append(c[j - suf:j])
            i, j = a, j - suf
        else:
            i = a
    s = c[i:j]
    middle: list[str] = []
    if s in _SPECIALS:
        middle = list(_SPECIALS[s])
    elif s and _is_url(s):
        middle = [s]
    elif s:
        middle = _split_infixes(s)
    return tuple(_join_specials(prefixes + middle + suffixes[::-1]))


def _split_infixes(s: str) -> list[str]:
    """What is left of a chunk once its affixes are cut, split around its infixes (`_INFIX`)."""
    out, start = [], 0
    for m in _INFIX.finditer(s):
        a, b = m.span()
        if a == 0:
            continue
        out += [s[start:a]] if a != start else []
        out += [s[a:b]] if a != b else []
        start = b
    return out + ([s[start:]] if s[start:] else [])


def _join_specials(toks: list[str]) -> list[str]:
    """Re-join runs of tokens that spell a special case containing affix characters (`):`, `''`, `'d`)."""
    if len(toks) < 2:
        return toks
    spans = []
    for i in range(len(toks)):
        run = toks[i]
        if run not in _AFFIX_PREFIXES:  # every shorter run of a special's run spells a prefix of that special
            continue
        for j in range(i + 2, min(len(toks), i + 6) + 1):
            run += toks[j - 1]  # "".join(toks[i:j])
            if run not in _AFFIX_PREFIXES:
                break
            if run in _AFFIX_SPECIALS:
                spans.append((i, j))
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


_last_split: tuple[str | None, list[str]] = (None, [])  # the last text split and its words (one entry, by identity)


def split_words(text: str) -> list[str]:
    """Words as datatrove's English Gopher filter sees them (see module docstring). The same text object asked
    again (the next rule of the same document) gets the same list back without a second split: callers must not
    change the list."""
    global _last_split
    last, words = _last_split
    if last is text:
        return words
    words = [t for chunk in text.split() for t in _split_chunk(chunk)]
    _last_split = (text, words)
    return words


# --------------------------------------------------------------------------------------------------
# punctuation sets and duplicates

# datatrove's PUNCTUATION_SET (utils/text.py): its ASCII/CJK punctuation and C0/C1 control characters, plus
# the common sentence terminals of its ~160-entry TERMINAL_PUNCTUATION (the rest are rare non-Latin scripts).
# A word made only of these is a "symbol word" (Gopher quality does not count it as a word).
SYMBOLS = frozenset(
    "!/—”:％〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
    "‼⁇⁈⁉｡﹒﹖﹗։؟۔।॥።፧"
    + "".join(map(chr, [*range(0, 9), 11, 12, *range(13, 32), *range(127, 160)]))
)

# datatrove utils/text.py TERMINAL_PUNCTUATION (FineWeb's default stop_chars), all 159 characters
TERMINAL_PUNCTUATION = tuple("!.?։؝؞؟۔܀܁܂߹࠷࠹࠽࠾।॥၊။።፧፨᙮᜵᜶។៕៖៙៚᠃᠉᥄᥅᪨᪩᪪᪫᭚᭛᭞᭟᭽᭾᰻᰼᱾᱿‼‽⁇⁈⁉⸮⸼⹓⹔。꓿꘎꘏꛳꛷꡶꡷꣎꣏꤯꧈꧉꩝꩞꩟꫰꫱꯫﹒﹖﹗！．？｡\U00010a56\U00010a57\U00010f55\U00010f56\U00010f57\U00010f58\U00010f59\U00010f86\U00010f87\U00010f88\U00010f89\U00011047\U00011048\U000110be\U000110bf\U000110c0\U000110c1\U00011141\U00011142\U00011143\U000111c5\U000111c6\U000111cd\U000111de\U000111df\U00011238\U00011239\U0001123b\U0001123c\U000112a9\U0001144b\U0001144c\U000115c2\U000115c3\U000115c9\U000115ca\U000115cb\U000115cc\U000115cd\U000115ce\U000115cf\U000115d0\U000115d1\U000115d2\U000115d3\U000115d4\U000115d5\U000115d6\U000115d7\U00011641\U00011642\U0001173c\U0001173d\U0001173e\U00011944\U00011946\U00011a42\U00011a43\U00011a9b\U00011a9c\U00011c41\U00011c42\U00011ef7\U00011ef8\U00011f43\U00011f44\U00016a6e\U00016a6f\U00016af5\U00016b37\U00016b38\U00016b44\U00016e98\U0001bc9f\U0001da88")


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
