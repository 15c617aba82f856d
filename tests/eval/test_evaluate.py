"""Evaluation metrics on literal inputs: exact byte counts for bits per byte, BLEU/ROUGE (the 13-gram train/val overlap is a data check
at tokenize now: tests/data/test_data_checks.py)."""

import math

import pytest

from lifecycle.tasks.eval.evaluate.stage import (bits_per_byte,
                            text_scores, token_byte_lengths, windows)
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, new_bpe

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Ünïcödé → bytes: 日本語 and emoji 🙂 too.",
         "def f(x):\n    return x * 2  # doubled\n"] * 5


@pytest.fixture(scope="module")
def tokenizer():
    tok, trainer = new_bpe(TokenizeConfig(vocab_size=300))
    tok.train_from_iterator([TEXTS], trainer=trainer)
    return tok


def test_token_byte_lengths_sum_to_utf8_bytes(tokenizer):
    nbytes = token_byte_lengths(tokenizer)
    eot = tokenizer.token_to_id("<|endoftext|>")
    assert nbytes[eot] == 0
    for text in TEXTS[:3]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids + [eot]
        assert nbytes[ids].sum() == len(text.encode("utf-8")), text


def test_bits_per_byte_from_nats():
    # one byte predicted with probability 1/2 is one bit
    assert bits_per_byte(math.log(2), 1) == pytest.approx(1.0)
    assert bits_per_byte(10 * math.log(2), 5) == pytest.approx(2.0)


def test_windows_cover_every_prediction_once():
    w = windows(10, 4)
    assert w == [(0, 4), (4, 4), (8, 1)] and sum(L for _, L in w) == 9


def test_text_scores_perfect_and_unrelated():
    same = text_scores(["the cat sat on the mat today"], ["the cat sat on the mat today"])
    assert same["gen_bleu"] == pytest.approx(100.0) and same["gen_rougeL"] == pytest.approx(1.0)
    other = text_scores(["completely different words here now"], ["the cat sat on the mat today"])
    assert other["gen_bleu"] < 1.0 and other["gen_rouge1"] == 0.0


