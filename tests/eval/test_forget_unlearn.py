"""Jang et al.'s measures (MA, EL_n) and chunked gradient ascent (tasks/eval/unlearn.py), on a tiny model."""

import numpy as np
import pytest
import torch

from lifecycle.tasks.eval import unlearn as ul
from lifecycle.tasks.train.model import GPT, ModelConfig


class Oracle(torch.nn.Module):
    """A 'model' that predicts the next token of a fixed sequence perfectly (and token 0 elsewhere)."""

    def __init__(self, seq, vocab=16):
        super().__init__()
        self.seq, self.vocab = list(seq), vocab
        self.cfg = ModelConfig(vocab_size=vocab, seq_len=64, n_layer=1, n_head=1, n_embd=8)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        logits = torch.zeros(B, T, self.vocab)
        for t in range(T):
            nxt = self.seq[t + 1] if t + 1 < len(self.seq) else 0
            logits[:, t, nxt] = 1.0
        return logits, None


def test_overlap_counts_shared_ngrams():
    assert ul.overlap([1, 2, 3, 4], [1, 2, 3, 4], 2) == 1.0
    assert ul.overlap([1, 2, 9, 4], [1, 2, 3, 4], 2) == pytest.approx(1 / 3)  # (1,2) of (1,2),(2,9),(9,4)
    assert ul.overlap([7, 7], [1, 2], 2) == 0.0 and ul.overlap([1], [1], 2) == 0.0


def test_ma_and_el_of_a_model_that_knows_the_sequence_and_one_that_does_not():
    seq = np.array([[3, 5, 7, 2, 9, 11, 4, 6, 8, 10, 12, 13]])
    knows = Oracle(seq[0])
    assert ul.memorisation_accuracy(knows, seq)[0] == 1.0
    assert ul.extraction_likelihood(knows, seq, n=3)[0] == 1.0
    other = np.array([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    assert ul.memorisation_accuracy(knows, other)[0] == 0.0
    assert ul.extraction_likelihood(knows, other, n=3)[0] == 0.0
    # half known: the oracle's sequence agrees on the first 6 tokens only
    half = seq.copy()
    half[0, 6:] = 1
    ma = ul.memorisation_accuracy(knows, half)[0]
    assert ma == pytest.approx(5 / 11)  # predictions of tokens 1..5 are right, 6..11 wrong
    # EL at t: greedy continuation is the oracle's tail, the truth is all 1s from 6 on
    el = ul.extraction_likelihood(knows, half, n=2)[0]
    expected = []
    for t in range(1, 12 - 2 + 1):
        gen = [seq[0][i] for i in range(t, 12)]
        expected.append(ul.overlap(gen, half[0, t:], 2))
    assert el == pytest.approx(np.mean(expected))
    assert ul.extraction_likelihood(knows, half, n=2, stride=3)[0] == pytest.approx(np.mean(expected[::3]))


@pytest.fixture(scope="module")
def memorised():
    """A tiny GPT trained on two random 'secret' sequences and eight patterned ones until it knows them all."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread is faster than contending ones
    torch.manual_seed(0)
    vocab, T = 48, 16
    model = GPT(ModelConfig(vocab_size=vocab, seq_len=32, n_layer=2, n_head=2, n_embd=32))
    rng = np.random.default_rng(0)
    secrets = rng.integers(0, vocab, (2, T))
    common = np.array([[(i * 5 + k * 3) % vocab for k in range(T)] for i in range(8)])
    x = torch.from_numpy(np.concatenate([secrets, common]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(120):
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    yield model.eval(), secrets, rng.integers(0, vocab, (8, T)), common
    torch.set_num_threads(threads)


def test_ascent_stops_at_the_target_level_chunk_by_chunk(memorised):
    import copy

    model, secrets, unseen, common = memorised
    model = copy.deepcopy(model)
    cfg = ul.UnlearnConfig(lr=3e-4, chunk_size=1, max_epochs=200, el_n=4, sequence_tokens=16)
    before, never = ul.measure(model, secrets, cfg), ul.measure(model, unseen, cfg)
    assert before["ma"] > 0.9 and before["ma"] > never["ma"] + 0.5  # memorised, far above never-seen
    common_before = ul.memorisation_accuracy(model, common).mean()
    target = {"ma": 0.4, "el4": 0.2}  # the level the caller measured on never-seen text of the same kind
    history = ul.ascend(model, secrets, target, cfg, log=lambda s: None)
    assert [h["chunk"] for h in history] == [0, 1] and all(h["steps"] >= 1 for h in history)
    for h in history:  # each chunk ran until it was at or below the level
        assert h["ma"] <= target["ma"] and h["el4"] <= target["el4"]
    after = ul.measure(model, secrets, cfg)
    assert after["ma"] <= target["ma"] + 0.1
    assert ul.memorisation_accuracy(model, common).mean() > 0.5 * common_before  # the rest is still known


def test_gradient_difference_keeps_the_retained_text_better_than_pure_ascent(memorised):
    """retain_weight > 0: the same forgetting (both stop at the level) costs the kept sequences less."""
    import copy

    model, secrets, _, common = memorised
    target = {"ma": 0.4, "el4": 0.2}
    kept_loss = {}
    for w in (0.0, 1.0):
        m = copy.deepcopy(model)
        cfg = ul.UnlearnConfig(lr=3e-4, max_epochs=200, el_n=4, sequence_tokens=16, retain_weight=w, retain_batch=4)
        history = ul.ascend(m, secrets, target, cfg, log=lambda s: None, retain=common)
        assert all(h["ma"] <= target["ma"] and h["el4"] <= target["el4"] for h in history)
        with torch.no_grad():
            x = torch.from_numpy(common)
            kept_loss[w] = m(x[:, :-1], x[:, 1:])[1].item()
    assert kept_loss[1.0] < kept_loss[0.0], kept_loss
    with pytest.raises(ValueError, match="retain sequences"):
        ul.ascend(copy.deepcopy(model), secrets, target, ul.UnlearnConfig(retain_weight=1.0), log=lambda s: None)


def test_ascent_refuses_when_it_cannot_reach_the_level(memorised):
    import copy

    model, secrets, unseen, _ = memorised
    cfg = ul.UnlearnConfig(lr=1e-9, max_epochs=2, el_n=4, sequence_tokens=16)
    with pytest.raises(ul.UnlearningRefused, match="max_epochs=2"):
        ul.ascend(copy.deepcopy(model), secrets, {"ma": 0.0, "el4": 0.0}, cfg, log=lambda s: None)


def test_ascent_checks_the_stop_rule_every_check_every_steps(memorised):
    """Jang et al.'s setting (Adam, no weight decay, small lr): the rule is checked after every `check_every`
    steps, so a chunk stops at the first check at the level, not after a fixed number of epochs."""
    import copy

    model, secrets, _, _ = memorised
    target = {"ma": 0.4, "el4": 0.2}
    one = ul.ascend(copy.deepcopy(model), secrets[:1], target, ul.UnlearnConfig(lr=3e-4, el_n=4, sequence_tokens=16,
                                                                               max_epochs=200), log=lambda s: None)
    four = ul.ascend(copy.deepcopy(model), secrets[:1], target, ul.UnlearnConfig(
        lr=3e-4, el_n=4, sequence_tokens=16, max_epochs=200, check_every=4), log=lambda s: None)
    assert four[0]["steps"] % 4 == 0 and one[0]["steps"] <= four[0]["steps"] < one[0]["steps"] + 4
    cfg = ul.UnlearnConfig()
    assert (cfg.lr, cfg.max_val_loss_increase, cfg.val_batches) == (5e-5, 0.10, None)
