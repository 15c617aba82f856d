"""The planner's matmul model against the GPU it runs on (issues 43 and 45).

    python -m bench.gpu_gemm [--model llama3.1-8b] [--tokens 2048,8192,16384] [--json] [--cpu-check]

Times every weight matmul of one block of `--model` (q/k/v, output projection, MLP up and down; forward shapes,
bf16) with torch.matmul on the GPU, at each token count, and sets each beside `step_time.gemm_seconds` for the same
shape with the default `Hardware`. The ratio measured/predicted rate is what `gemm_efficiency` (0.55, set from
published training runs) would become if set from this GPU's matmuls alone; the JSON line holds every shape.
`--cpu-check`: tiny shapes in fp32 on the CPU, to check the script before a lease is spent on it.
"""

from __future__ import annotations

import argparse
import json
import time


def shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, n, k) of a block's weight matmuls (m is the token count)."""
    from lifecycle.tasks.train.planner import parse_model

    m = parse_model(model)
    h, kv = m.n_embd, m.kv_heads * m.head_dim
    up = m.mlp_hidden * (2 if m.mlp == "swiglu" else 1)
    return [("qkv", h + 2 * kv, h), ("proj", h, h), ("up", up, h), ("down", h, m.mlp_hidden)]


def timed(a, b, reps: int) -> float:
    import torch

    for _ in range(3):
        a @ b
    if a.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if a.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main(argv: list[str] | None = None) -> int:
    import torch

    from lifecycle.tasks.train.step_time import Hardware, gemm_seconds

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--tokens", default="2048,8192,16384")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cpu-check", action="store_true")
    args = ap.parse_args(argv)
    device, dtype = ("cpu", torch.float32) if args.cpu_check else ("cuda", torch.bfloat16)
    model, tokens = ("demo", [64, 128]) if args.cpu_check else (args.model, [int(t) for t in args.tokens.split(",")])
    hw, rows = Hardware(), []
    for t in tokens:
        for name, n, k in shapes(model):
            a = torch.randn(t, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            measured = timed(a, b, 2 if args.cpu_check else args.reps)
            predicted = gemm_seconds(t, n, k, hw)
            rate = 2 * t * n * k / measured / hw.peak_flops
            rows.append({"tokens": t, "matmul": name, "m": t, "n": n, "k": k, "measured_s": measured,
                         "predicted_s": predicted, "fraction_of_peak": rate, "measured_over_predicted_rate":
                         predicted / measured})
            if not args.json:
                print(f"{t:6} {name:5} {t}x{k} @ {k}x{n}: {rate:.1%} of peak, predicted/measured time "
                      f"{predicted / measured:.2f}")
    big = [r["fraction_of_peak"] for r in rows if r["tokens"] == max(tokens)]
    print(json.dumps({"model": model, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                      "peak_flops": hw.peak_flops, "gemm_efficiency_model": hw.gemm_efficiency,
                      "largest_token_count_mean_fraction_of_peak": sum(big) / len(big), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
