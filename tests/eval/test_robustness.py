"""Robustness: seeded perturbations edit only what their kind names, and held-out bits per byte is exact and
reported clean, perturbed and as the increase, per kind."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, new_bpe
from lifecycle.tasks.eval.evaluate.robustness import KINDS, RobustnessConfig, perturb, perturbed, robustness, texts_bpb
from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.model import GPT

TEXT = ("The committee will meet again next week to review the budget and the plans for the reading room. "
        "Members who cannot attend should send their comments to the secretary before the meeting.")


@pytest.fixture(scope="module")
def tokenizer():
    tok, trainer = new_bpe(TokenizeConfig(vocab_size=300))
    tok.train_from_iterator([[TEXT] * 3], trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=tokenizer.get_vocab_size(), n_layer=1, n_head=2, n_embd=32, seq_len=16)).eval()


def test_perturbations_edit_only_their_kind_and_are_seeded():
    cfg = RobustnessConfig(rate=0.5, seed=3)
    typo, case, space = (perturbed([TEXT], k, cfg)[0] for k in KINDS)
    assert perturbed([TEXT], "typo", cfg)[0] == typo  # same seed, same edits
    assert perturbed([TEXT], "typo", RobustnessConfig(rate=0.5, seed=4))[0] != typo
    assert typo != TEXT and len(typo) == len(TEXT)
    assert all(sorted(a) == sorted(b) for a, b in zip(typo.split(), TEXT.split()))  # letters swapped within words
    assert case != TEXT and case.lower() == TEXT.lower()
    assert space != TEXT and space.split() == TEXT.split()
    with pytest.raises(ValueError, match="unknown perturbation kind 'emoji'"):
        perturb(TEXT, "emoji", 0.1, random.Random(0))


def test_texts_bpb_is_exact_nats_over_utf8_bytes(model, tokenizer):
    eot = tokenizer.token_to_id("<|endoftext|>")
    text = "the budget ü"  # fits one 16-token window
    ids = [eot, *tokenizer.encode(text, add_special_tokens=False).ids]
    assert len(ids) <= 17
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]))
    nats = F.cross_entropy(logits[0], torch.tensor(ids[1:]), reduction="sum").item()
    assert texts_bpb(model, tokenizer, [text], eot) == pytest.approx(nats / (math.log(2) * len(text.encode())))


def test_robustness_reports_clean_perturbed_and_drop_per_kind(model, tokenizer):
    eot = tokenizer.token_to_id("<|endoftext|>")
    cfg = RobustnessConfig(docs=2, chars=120, prompts=2, rate=0.3)
    docs = [TEXT, TEXT[50:]]
    prompts, refs = ["The committee will", "Members who"], ["meet again next week", "cannot attend"]
    m = robustness(model, tokenizer, eot, docs, prompts, refs, 4, cfg)
    assert m == robustness(model, tokenizer, eot, docs, prompts, refs, 4, cfg)  # deterministic
    assert m["robust_docs"] == 2 and m["robust_prompts"] == 2
    for kind in KINDS:
        assert m[f"robust_{kind}_bpb_increase"] == pytest.approx(m[f"robust_{kind}_bpb"] - m["robust_clean_bpb"])
        assert m[f"robust_{kind}_gen_bleu_drop"] == pytest.approx(m["robust_clean_gen_bleu"] - m[f"robust_{kind}_gen_bleu"])
        assert 0 <= m[f"robust_{kind}_gen_bleu"] <= 100
    assert m["robust_typo_bpb"] != m["robust_clean_bpb"]
    assert robustness(model, tokenizer, eot, docs, prompts, refs, 4, RobustnessConfig(docs=0, prompts=0)) == {}
