"""What the pinned DeepSpeed holds per rank (lifecycle.tasks.train.zero_memory), on cases worked out by hand, against
DeepSpeed's own estimator, and (slow) against a measurement of 2 CPU ranks (bench.zero_states)."""

import pytest

from lifecycle.tasks.train.zero_memory import PRECISIONS, engine_bytes, engine_buffers, model_states

GiB = 2**30
BF16, FP32 = PRECISIONS["bf16"], PRECISIONS["fp32"]


def test_zero2_bf16_peaks_in_the_step_at_deepspeeds_own_estimate():
    """2,851M parameters on 8 ranks: the ZeRO paper's 2Ψ + 14Ψ/N = 9.96 GiB is what backward holds (less the
    bucket); the step adds the fp32 gradient partition, 2Ψ + 18Ψ/N = 11.28 GiB, which is DeepSpeed 0.19.8's
    `estimate_zero2_model_states_mem_needs` (GPU side, no offload). memory.rst's 4Ψ + 16Ψ/N = 15.93 GiB counts
    every 16-bit gradient, which stage 2 does not keep."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    psi, n = 2_851_000_000, 8
    got = engine_bytes(psi, 2, n, BF16, largest=0)
    assert round(sum(model_states(psi, 2, n, BF16).values()) / GiB, 2) == 9.96
    assert got["step"] == pytest.approx(2 * psi + 18 * psi / n)
    assert round(got["step"] / GiB, 2) == 11.28
    assert got["step"] == pytest.approx(estimate_zero2_model_states_mem_needs(psi, n, cpu_offload=False)[1])
    assert got["backward"] == pytest.approx(2 * psi + 14 * psi / n + 2 * 5e8)  # + the bucket, 5e8 bf16 elements
    assert round((4 * psi + 16 * psi / n) / GiB, 2) == 15.93 and got["total"] < 4 * psi + 16 * psi / n


@pytest.mark.parametrize("prec", ["bf16", "fp32"])
def test_each_stage_term_by_term(prec):
    """Ψ = 1e6 on N = 4 ranks, bucket B = 1e5 elements, largest tensor 2e5 elements; p = g = 2 (bf16) or 4."""
    pr = PRECISIONS[prec]
    psi, n, b, big, p = 1e6, 4, 1e5, 2e5, pr.param
    states = lambda z: engine_bytes(psi, z, n, pr, big, reduce_bucket=b)  # noqa: E731
    fp32_master_z0 = 4 * psi if prec == "bf16" else 0  # FP16_UnfusedOptimizer's fp32_groups
    # stage 0: params, grads, moments (+ master); backward flattens every gradient for the all-reduce; in 16 bits
    # the step makes fp32 gradients of every parameter
    assert states(0)["backward"] == pytest.approx(2 * p * psi + 8 * psi + fp32_master_z0 + p * psi)
    assert states(0)["step"] == pytest.approx(2 * p * psi + 8 * psi + fp32_master_z0 * 2)
    # stage 1: every gradient until the end of backward, then the partition; the step's fp32 partition
    assert states(1)["backward"] == pytest.approx(2 * p * psi + 12 * psi / n + p * b)
    assert states(1)["step"] == pytest.approx(p * psi + (p + 12 + 4) * psi / n)
    # stage 2: the gradient partition, the bucket and one gradient waiting for it
    assert states(2)["backward"] == pytest.approx(p * psi + (p + 12) * psi / n + p * b + p * big)
    assert states(2)["step"] == pytest.approx(p * psi + (p + 12 + 4) * psi / n)
    # stage 3: partitions of everything, the gradient partition buffer and the bucket held for good
    assert states(3)["step"] == pytest.approx((2 * p + 12 + 4) * psi / n + p * b)
    assert states(3)["total"] == states(3)["step"]


def test_bucket_counts_whole_on_a_gpu_and_as_written_on_a_cpu():
    psi = 1e6
    assert engine_buffers(psi, 2, 2, BF16, 0)["grad_bucket"] == pytest.approx(2 * 5e8)
    assert engine_buffers(psi, 2, 2, BF16, 0, device="cpu")["grad_bucket"] == pytest.approx(2 * psi)
    assert engine_buffers(psi, 2, 2, BF16, 0, overlap_comm=True)["grad_bucket"] == pytest.approx(2 * 2 * 5e8)
    off = engine_buffers(psi, 2, 2, BF16, 0, offload=True)
    assert off["step_fp32_grads"] == 0
    with pytest.raises(ValueError, match="device"):
        engine_buffers(psi, 2, 2, BF16, 0, device="tpu")


@pytest.mark.slow  # 2 ranks of DeepSpeed per layout: about half a minute each
@pytest.mark.parametrize("layout", [6, 3], ids=["zero2-bf16", "zero3-fp32"])
def test_formulas_match_what_deepspeed_allocates(layout):
    """The storages a real 2-rank CPU engine holds at its peak moment, against `engine_bytes`: within 3 % below
    (what is not counted: the straddling parameter's gradient at stages 1-2, ZeRO-3's gathered embedding)."""
    from bench.zero_states import LAYOUTS, main

    assert LAYOUTS[6] == (2, "bf16") and LAYOUTS[3] == (3, "fp32")
    (row,) = main(only=[layout])
    assert 0.97 <= row["new_ratio"] <= 1.001
    assert row["old_ratio"] < 0.85  # the ZeRO paper's states alone missed the step's fp32 gradients and buffers
