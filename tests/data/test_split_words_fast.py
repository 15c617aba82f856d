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
