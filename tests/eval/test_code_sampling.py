"""Sampling completions from a model and scoring them by the same path as given samples (the evaluate hook)."""

import pytest
import torch
from pydantic import ValidationError

from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, new_bpe
from lifecycle.tasks.eval.code.config import CodeEvalConfig
from lifecycle.tasks.eval.code.problems import load_problems
from lifecycle.tasks.eval.code.sampling import code_metrics, sample_completions, sample_continue, truncate
from lifecycle.tasks.eval.evaluate.stage import EvaluateConfig, greedy_continue

PROBLEMS = dict(list(load_problems().items())[:3])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: with the shared 2 cores busy, torch's intra-op threads only wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    tok, trainer = new_bpe(TokenizeConfig(vocab_size=400))
    tok.train_from_iterator([[p["prompt"] + p["canonical_solution"] for p in PROBLEMS.values()]], trainer=trainer)
    return tok


class Scripted(torch.nn.Module):
    """A stand-in model that continues each known prompt with a fixed token script, then end-of-text."""

    def __init__(self, scripts: dict[tuple, list[int]], vocab: int, eot: int):
        super().__init__()
        self.cfg = type("Cfg", (), {"seq_len": 4096})()
        self.scripts, self.vocab, self.eot = scripts, vocab, eot

    def forward(self, idx):
        logits = torch.zeros(idx.shape[0], 1, self.vocab)  # the last position is all sampling reads
        for b, row in enumerate(idx.tolist()):
            prompt = next(p for p in self.scripts if tuple(row[: len(p)]) == p)
            t = len(row) - len(prompt)
            script = self.scripts[prompt]
            logits[b, -1, script[t] if t < len(script) else self.eot] = 100.0
        return logits, None


def scripted(tokenizer, completion_of):
    eot = tokenizer.token_to_id("<|endoftext|>")
    scripts = {tuple(tokenizer.encode(p["prompt"]).ids): tokenizer.encode(completion_of(p)).ids
               for p in PROBLEMS.values()}
    return Scripted(scripts, tokenizer.get_vocab_size(), eot)


def test_a_model_that_writes_the_canonical_solutions_scores_one(tokenizer):
    cfg = CodeEvalConfig(enabled=True, max_problems=3, num_samples=2, k=[1, 2], max_new_tokens=400)
    model = scripted(tokenizer, lambda p: p["canonical_solution"])
    samples = sample_completions(model, tokenizer, PROBLEMS, cfg)
    assert [s["task_id"] for s in samples] == [t for t in PROBLEMS for _ in range(2)]
    metrics = code_metrics(model, tokenizer, cfg)
    assert metrics["code_pass_at_1"] == 1.0 and metrics["code_pass_at_2"] == 1.0, metrics
    assert (metrics["code_problems"], metrics["code_samples"], metrics["code_passed"]) == (3, 6, 6)
    assert metrics["code_sandbox_full"] == 1.0
    wrong = scripted(tokenizer, lambda p: "    return None\n")
    assert code_metrics(wrong, tokenizer, cfg)["code_pass_at_1"] == 0.0


def test_sampling_is_seeded_and_cut_at_stop_sequences(tokenizer):
    from lifecycle.tasks.train.model import GPT, ModelConfig

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tokenizer.get_vocab_size(), n_layer=1, n_head=2, n_embd=16, seq_len=64)).eval()
    cfg = CodeEvalConfig(enabled=True, num_samples=3, k=[1], max_new_tokens=16, temperature=1.0, seed=7)
    first = sample_completions(model, tokenizer, PROBLEMS, cfg)
    assert first == sample_completions(model, tokenizer, PROBLEMS, cfg)
    assert len({s["completion"] for s in first}) > 1  # temperature 1: the samples differ
    greedy = sample_completions(model, tokenizer, PROBLEMS, cfg.model_copy(update={"temperature": 0.0}))
    assert len({s["completion"] for s in greedy[:3]}) == 1
    prompt = torch.tensor([tokenizer.encode(next(iter(PROBLEMS.values()))["prompt"]).ids])
    assert torch.equal(sample_continue(model, prompt, 2, 8, 0.0, 1.0, None),  # the evaluate stage's greedy
                       greedy_continue(model, prompt.expand(2, -1), 8))
    assert truncate("    return 1\ndef g():\n    pass") == "    return 1"
    assert truncate("    x = 1\n    return x\n\n\nif __name__") == "    x = 1\n    return x\n\n"


def test_config_is_off_by_default_and_checks_k():
    assert EvaluateConfig().code.enabled is False
    with pytest.raises(ValidationError, match="evaluate.code.k: pass@10 needs at least 10 samples"):
        EvaluateConfig.model_validate({"code": {"enabled": True, "num_samples": 5, "k": [1, 10]}})
