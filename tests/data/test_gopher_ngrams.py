"""The compiled n-gram counts of Gopher repetition (tasks/data/filter/ngrams.py) equal the string-based
definitions (`top_ngram_chars_python`, `dup_ngram_chars_python`) on random and adversarial word lists: joins that
collide ("ab"+"c" = "a"+"bc"), words holding spaces (space-joined collisions), ties, short lists, empty words,
astral and combining characters, lone surrogates, and a forced 64-bit hash collision (Thue-Morse strings, for
which every odd-base polynomial hash mod 2^64 agrees), so the slice comparison, not the hash, decides."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from lifecycle.tasks.data.filter import gopher_repetition as rep
from lifecycle.tasks.data.filter.ngrams import Ngrams, _codepoints, _prefix_hashes
from lifecycle.tasks.data.filter.words import split_words
from tests import conftest

VOCABS = [
    ["a", "b", "ab", "c", "bc", "abc", ""],        # "" joins collide in many ways
    ["x", "y"],                                   # dense repeats, overlapping windows
    ["a b", "a", "b", "b c", "c"],                 # words with spaces: space-joined collisions
    ["é", "e\u0301", "𝔘", "日本", "😀", "\ud800", "ß", "SS"],  # combining, astral, lone surrogate
    [f"w{i}" for i in range(40)],                  # mostly distinct: ties at count 1 (first seen wins)
]


def check(words: list[str]) -> None:
    grams = Ngrams(words)
    for n in range(1, 12):
        assert grams.dup_chars(n) == rep.dup_ngram_chars_python(words, n), (words, n)
        assert rep.dup_ngram_chars(words, n) == rep.dup_ngram_chars_python(words, n), (words, n)
        if len(words) >= n:
            assert grams.top_chars(n) == rep.top_ngram_chars_python(words, n), (words, n)
            top = Counter(" ".join(words[i : i + n]) for i in range(len(words) - n + 1)).most_common(1)[0][0]
            assert grams.top(n)[1] == top, (words, n)  # the n-gram a drop's detail names
        else:
            with pytest.raises(ValueError, match="needs at least n words"):
                grams.top_chars(n)


def test_random_and_adversarial_word_lists():
    rng = random.Random(25)
    for trial in range(3000):
        vocab = VOCABS[trial % len(VOCABS)]
        check([rng.choice(vocab) for _ in range(rng.choice([0, 1, 2, 3, 5, 9, 10, 11, 30, 200]))])
    for words in (["ab", "c", "a", "bc"] * 4, ["a", "bc", "ab", "c"] * 4 + ["d"], ["a b", "c", "a", "b c"] * 3):
        check(words)


def test_ties_go_to_the_first_seen_ngram():
    # "b a" and "a b" both occur twice; "a b" first -> its length; different lengths make the choice visible
    words = ["aa", "b", "aa", "b", "ccc"] + ["b", "aa"]
    assert rep.top_ngram_chars(words, 2) == rep.top_ngram_chars_python(words, 2) == len("aa b") * 2
    words = ["x", "yyy", "x", "zz", "x", "zz", "x", "yyy"]
    assert rep.top_ngram_chars(words, 2) == rep.top_ngram_chars_python(words, 2)


def thue_morse(k: int) -> str:
    return "".join("ab"[bin(i).count("1") % 2] for i in range(1 << k))


def test_hash_collision_is_resolved_by_comparing_code_points():
    a = thue_morse(11)
    b = a.translate(str.maketrans("ab", "ba"))
    assert a != b
    pre_a, _ = _prefix_hashes(_codepoints(a))
    pre_b, _ = _prefix_hashes(_codepoints(b))
    assert pre_a[-1] == pre_b[-1]  # the two strings really collide: only the slice comparison tells them apart
    for words in ([a, b, a, b, a, b], [a, b] * 12 + [b, a] * 12, [a] * 3 + [b] * 3 + [a, b, a]):
        check(words)
        assert len(words) < 10 or rep.dup_ngram_chars(words, 5) > 0


def test_real_text():
    """Word lists of the bundled corpus (real web text, docs and code of every file)."""
    texts = [r["text"] for r in conftest.corpus_records(150, every_file=True)]
    for text in texts:
        check(split_words(text))


def test_codepoints_count_like_len():
    s = "a\ud800😀e\u0301"
    assert len(_codepoints(s)) == len(s) and _codepoints(s).dtype == np.uint32


def test_rule_without_ngram_checks_passes_what_the_checks_would_reject():
    text = "alpha beta gamma delta " * 40  # no duplicated line or paragraph; every n-gram repeats
    assert rep.GopherRepetitionConfig().reason(text)[0] == "gopher_top_2_gram"
    assert rep.GopherRepetitionConfig(top_ngram_char_frac=(), dup_ngram_char_frac=()).reason(text) is None
    assert rep.GopherRepetitionConfig(top_ngram_char_frac=()).reason(text)[0] == "gopher_dup_5_grams"
