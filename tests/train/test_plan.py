import json
import math
import subprocess
import sys

import pytest

from lifecycle.tasks.train.sizing import compute_optimal, model_for_params, non_embedding_params
from lifecycle.tasks.train.config import ModelConfig


def test_compute_optimal_from_flops_and_from_tokens():
    p = compute_optimal(flops=1.2e20)
    assert p.n_params == pytest.approx(math.sqrt(1.2e20 / 120))  # 1e9
    assert p.tokens == pytest.approx(20 * p.n_params) and p.flops == pytest.approx(6 * p.n_params * p.tokens)
    q = compute_optimal(tokens=2e10)
    assert q.n_params == pytest.approx(1e9) and q.flops == pytest.approx(1.2e20)
    with pytest.raises(ValueError, match="exactly one"):
        compute_optimal()
    with pytest.raises(ValueError, match="positive"):
        compute_optimal(tokens=0)


def test_chosen_shape_is_close_to_the_target():
    base = ModelConfig(vocab_size=32000, seq_len=2048)
    for target in (5e7, 1.24e8, 1e9):
        m = model_for_params(target, base)
        assert abs(non_embedding_params(m) / target - 1) < 0.1
        assert m.n_embd % 64 == 0 and m.head_dim == 64 and m.vocab_size == 32000 and m.seq_len == 2048
    # more parameters means a deeper and wider model
    small, big = model_for_params(5e7, base), model_for_params(1e9, base)
    assert big.n_layer > small.n_layer and big.n_embd > small.n_embd


def test_plan_cli(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "lifecycle.cli", "plan", *a],  # noqa: E731
                                    capture_output=True, text=True)
    out = run("--flops", "1e18", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["n_params"] == pytest.approx(math.sqrt(1e18 / 120)) and got["tokens"] == pytest.approx(20 * got["n_params"])
    assert abs(got["model_params"] / got["n_params"] - 1) < 0.1
    text = run("--tokens", "2e9").stdout
    assert "optimal params N 1e+08" in text and "C = 6·N·D" in text
    manifest = tmp_path / "_manifest.json"
    manifest.write_text(json.dumps({"stage": "tokenize", "num_tokens": {"train": 4_000_000, "val": 10}}))
    assert "optimal params N 2e+05" in run("--dataset", str(tmp_path)).stdout
    assert run("--flops", "1e18", "--tokens", "5").returncode == 2  # mutually exclusive
