"""`split_words`'s shortcuts (issue 25) give exactly the tokens of the rules they skip: the plain-chunk fast path
(`_WRAPPED`), the ASCII exit of `_prefix_len`, the long-suffix prefilter of `_suffix_len` and the prefix-pruned
run search of `_join_specials`. The reference is the chunk splitter with main's versions of those three functions
and no fast path (frozen copies in
bench/gopher_speed.py, `main_rules`), compared on every distinct chunk of the bundled corpus and on random chunks
built from the characters the rules act on."""

from __future__ import annotations

import random

import pytest

from bench.gopher_speed import main_rules
from lifecycle.tasks.data.filter import words
from tests import conftest

NEW = words._split_chunk.__wrapped__  # the uncached splitter


@pytest.fixture()
def reference():
    """The uncached splitter with main's rules (no fast path, no prefilters)."""
    def split(chunk: str) -> tuple[str, ...]:
        with main_rules(ngrams=False):
            return NEW(chunk)
    return split


PIECES = (list("abcxyzABCZ0129.,;:!?'\"’`()[]{}<>-–—_/\\=+*^~#@$£€%&|°²…") + ["US$", "C$", "km", "mph", "MB", "'s",
          "n't", "e.g.", "a.m.", "p.m.", ":)", ":-(", "<3", "http://", "www.", ".com", ".org", "Dr.", "can", "not",
          "don", "I", "ll", "ä.", "Ph.D.", "8-)", "(^_^)", "o.O", "..", "...", "é", "日本", "😀", "ß", "²", "µ", "µm", "ª", "ǅ", "ー", "½", "Ⅷ", "٣", "e\u0301", "ölçü", "а", "ä."])


def test_random_chunks_split_as_main(reference):
    rng = random.Random(25)
    for _ in range(20000):
        chunk = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 7)))
        assert NEW(chunk) == reference(chunk), chunk


def test_every_chunk_of_the_corpus_splits_as_main(reference):
    texts = [r["text"] for r in conftest.corpus_records(2000, every_file=True)]
    chunks = list(dict.fromkeys(c for t in texts for c in t.split()))
    assert len(chunks) > 10000
    for chunk in chunks:
        assert NEW(chunk) == reference(chunk), chunk


def test_specials_and_plain_chunks(reference):
    for chunk in [*words._SPECIALS, "dont", "cannot", "10km", "5mb", "3pm", "12a.m.", "abc", "ABC", "123", "a1",
                  "x86_64", "US$5", "C$", "1+", "hello.", "U.S.", "e.g.,", "(:", "):", "''", "''hello''", "(dont", "dont,",
                  "(cant)", "'em", "'em,", "(em", "(1", "1)", "(12,", "5km,", "(e.g.", "US", "(US$", "'s", "'S,", "km,",
                  "10)", "(x)", "_x_", "*x*", "`x`", '"x"', "<x>", "x;", "%x", "=x", "#1", "&x", "'d", "(Ill"]:
        assert NEW(chunk) == reference(chunk), chunk


def slicing_split(s: str) -> tuple[str, ...]:
    """`_split_chunk` as it was before its affix loop moved indices (2026-11-25): the string sliced anew at each
    step and looked up whole, `_URL.fullmatch` on what is left (the infix split, which did not change, is shared).
    Quadratic on long chunks; the reference here."""
    if s in words._SPECIALS:
        return words._SPECIALS[s]
    if m := words._WRAPPED.fullmatch(s):
        pre, core, suf = m.groups()
        if ((core.isalpha() or core.isascii()) and core not in words._SPECIALS and pre + core not in words._SPECIALS
                and core + suf not in words._SPECIALS):
            return tuple(t for t in (pre, core, suf) if t)
    prefixes, suffixes, last = [], [], -1
    while s and len(s) != last and s not in words._SPECIALS:
        last = len(s)
        pre = words._prefix_len(s)
        if pre and s[pre:] in words._SPECIALS:
            prefixes.append(s[:pre])
            s = s[pre:]
            break
        suf = words._suffix_len(s[pre:])
        if suf and s[:-suf] in words._SPECIALS:
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
    middle = []
    if s in words._SPECIALS:
        middle = list(words._SPECIALS[s])
    elif s and words._URL.fullmatch(s):
        middle = [s]
    elif s:
        middle = words._split_infixes(s)  # unchanged by the index loop
    return tuple(words._join_specials(prefixes + middle + suffixes[::-1]))


URLISH = PIECES + ["user@", "a@b", "@", "x.org", "://", "ftp://", "a.b.c", ":8080", "/path", "?q=1", "#frag", "ab:",
                   "-", "_", "é.fr", "..", ".", "::", "@@", "www.x.com", "x-y.z"]


def test_the_affix_loop_and_url_check_split_as_the_slicing_loop_did():
    rng = random.Random(26)
    for n in (7, 30, 120):
        for _ in range(6000 if n < 100 else 1500):
            chunk = "".join(rng.choice(URLISH) for _ in range(rng.randint(1, n)))
            assert NEW(chunk) == slicing_split(chunk), chunk
    texts = [r["text"] for r in conftest.corpus_records(2000, every_file=True)]
    for chunk in dict.fromkeys(c for t in texts for c in t.split()):
        assert NEW(chunk) == slicing_split(chunk), chunk
    for unit in ("))", "(", '"', "..", "…", "'s", ":)", "a:b", "x@y.", "%", "$", "—"):  # long runs of affixes
        for reps in (1, 2, 3, 50, 501):
            for chunk in (unit * reps, "word" + unit * reps, unit * reps + "word" + unit * reps):
                assert NEW(chunk) == slicing_split(chunk), chunk[:80]


def test_a_chunk_of_hundreds_of_kilobytes_splits_in_linear_time():
    """Three chunks of ~600 KB without whitespace (a JSON search index, a run of brackets, a run of quotes around
    a word), which took the slicing loop and the URL regex ~5 minutes together on this machine (quadratic: 0.84 s,
    0.24 s and 0.23 s at 40 KB), split in about a second. The bound is a hang guard, not a speed goal."""
    import time

    chunks = ['{"body":{"root":{"1":{".":{"3":{"0":{"df":57,"docs":{"0":{"tf":1.0}}}}}}}}' * 8300,
              ")" * 600_000, '"' * 300_000 + "word" + '"' * 300_000]
    started = time.perf_counter()
    for chunk in chunks:
        toks = NEW(chunk)
        assert "".join(toks) == chunk
    assert time.perf_counter() - started < 30
