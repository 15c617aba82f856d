"""The memory and layout planner on literal cases worked out by hand (lifecycle.tasks.train.planner)."""


import pytest

from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.layout_search import search
from lifecycle.tasks.train.planner import (
    ActivationModel, Layout, PRECISIONS, activation_per_layer, memory, model_states,
    paper_activation_per_layer, parse_bytes, parse_model, total_params,
)
from lifecycle.tasks.train.step_time import Hardware, step_time
from tests.conftest import lifecycle_in_process

GB = 1e9
BF16 = PRECISIONS["bf16"]


def test_zero_paper_7_5b_example():
    # ZeRO paper, figure 1: Ψ = 7.5B, Nd = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per GPU
    psi = 7.5e9
    per_stage = [sum(model_states(psi, z, 64, BF16).values()) / GB for z in range(4)]
    assert per_stage[0] == pytest.approx(120.0)  # 16Ψ
    assert per_stage[1] == pytest.approx(30 + 90 / 64)  # 4Ψ + 12Ψ/64 = 31.41
    assert per_stage[2] == pytest.approx(15 + 105 / 64)  # 2Ψ + 14Ψ/64 = 16.64
    assert per_stage[3] == pytest.approx(120 / 64)  # 1.875
    assert round(per_stage[1], 1) == 31.4 and round(per_stage[2], 1) == 16.6 and round(per_stage[3], 1) == 1.9


def test_fp32_model_states_with_deepspeeds_master_copy():
    # fp32: 4 + 4 + 8 bytes; the ZeRO optimizers' fp32 partition clone adds 4/Nd (stage 3 too: its
    # fp32_partitioned_groups_flat is a tensor of its own beside the parameters' partitions)
    fp32 = PRECISIONS["fp32"]
    assert sum(model_states(1e6, 0, 2, fp32).values()) == pytest.approx(16e6)
    assert sum(model_states(1e6, 1, 2, fp32).values()) == pytest.approx(8e6 + 12e6 / 2)
    assert sum(model_states(1e6, 2, 2, fp32).values()) == pytest.approx(4e6 + 16e6 / 2)
    assert sum(model_states(1e6, 3, 2, fp32).values()) == pytest.approx(20e6 / 2)
    off = model_states(1e6, 2, 2, BF16, offload=True)
    assert off == {"params": 2e6, "grads": 0.0, "optimizer": 0.0}


def test_gradient_bucket_counts_whole_on_a_gpu_and_as_written_on_the_cpu():
    """DeepSpeed's stage 1-2 bucket (reduce_bucket_size elements, allocated each step with contiguous_gradients,
    two with overlap_comm) and stage 3's (one, for good): a GPU's caching allocator hands out the whole buffer, a
    CPU run's resident set holds the pages the gradients wrote, min(Ψ, bucket). Stage 0 all-reduces flattened
    copies of at most 5e8 elements, freed before the step."""
    m = parse_model("demo")
    psi = total_params(m)
    br = lambda zero, **kw: memory(m, Layout(dp=2, zero=zero), **kw).breakdown["grad_bucket_bytes"]  # noqa: E731
    for zero in (1, 2, 3):
        assert br(zero, device="cuda") == pytest.approx(5e8 * 2)
        assert br(zero, device="cpu") == pytest.approx(psi * 2)
        assert br(zero, device="cpu", reduce_bucket=1e5) == pytest.approx(1e5 * 2)
    assert br(2, device="cuda", overlap_comm=True) == pytest.approx(2 * 5e8 * 2)
    assert br(3, device="cuda", overlap_comm=True) == pytest.approx(5e8 * 2)  # stage 3: one buffer
    assert br(0, device="cuda") == br(0, device="cpu") == pytest.approx(psi * 2)
    with pytest.raises(ValueError, match="device"):
        memory(m, Layout(), device="tpu")


def test_peak_is_the_larger_of_backward_and_step():
    """Activations and the backward's buffers (stages 1-2 release their bucket at the end of backward:
    stage_1_and_2.py `_release_ipg_buffers`) are gone by the optimizer step, whose own buffers are the gradient
    partition in fp32 (ZeRO 1-3), fp32 AdamW's two temporaries and stage 3's bucket, held for good; stage 1 has
    released the gradients outside its partition."""
    m = parse_model("demo")
    psi = total_params(m)
    largest = max(m.vocab_size * m.n_embd, psi / 2)
    for zero in (1, 2, 3):
        est = memory(m, Layout(dp=2, zero=zero), precision="fp32", device="cpu")
        b = est.breakdown
        assert b["step_fp32_grad_bytes"] == pytest.approx(psi / 2 * 4)
        assert b["optimizer_step_temp_bytes"] == pytest.approx(2 * 4 * largest)  # sqrt, then the division
        held = b["grad_bucket_bytes"] if zero == 3 else 0.0
        released = 4 * psi / 2 if zero == 1 else 0.0
        assert b["step_grads_released_bytes"] == pytest.approx(released)
        assert b["step_buffers_bytes"] == pytest.approx(2 * 4 * largest + psi / 2 * 4 + held - released)
        assert est.total_bytes == pytest.approx(est.model_states_bytes + max(
            est.activation_bytes + b["backward_buffers_bytes"], b["step_buffers_bytes"]))
    # a step-bound case: short sequences and a small bucket, so backward holds less than the step's buffers
    short = memory(m, Layout(dp=2, zero=2), precision="fp32", device="cpu", seq_len=8, reduce_bucket=1e5)
    assert short.total_bytes == pytest.approx(short.model_states_bytes + 2 * 4 * largest + psi / 2 * 4)
    assert memory(m, Layout(dp=2, zero=2, offload=True), precision="fp32").breakdown["step_fp32_grad_bytes"] == 0


def test_the_step_gradients_are_fp32_in_bf16_too():
    """DeepSpeed converts the gradient partition to the fp32 master's dtype for the step (stage_1_and_2.py
    `flat_grad_partition.to(...)`), so bf16 pays 4 bytes per element of it, not 2; at stage 0 bf16's
    FP16_UnfusedOptimizer makes fp32 gradients of every parameter (bench.zero_states measures both)."""
    m = parse_model("demo")
    psi = total_params(m)
    for zero in (1, 2, 3):
        assert memory(m, Layout(dp=2, zero=zero)).breakdown["step_fp32_grad_bytes"] == pytest.approx(4 * psi / 2)
    assert memory(m, Layout(dp=2, zero=0)).breakdown["step_fp32_grad_bytes"] == pytest.approx(4 * psi)
    assert memory(m, Layout(dp=2, zero=0), precision="fp32").breakdown["step_fp32_grad_bytes"] == 0
    # stages 2-3 hold a gradient autograd has just made until its hook copies it into the bucket: the largest
    # tensor's, here the tied embedding/head (4096 x 128)
    assert memory(m, Layout(dp=2, zero=2)).breakdown["pending_grad_bytes"] == pytest.approx(2 * 4096 * 128)
    assert memory(m, Layout(dp=2, zero=1)).breakdown["pending_grad_bytes"] == 0


def test_zero3_prefetch_buffer_is_held_beside_the_gathered_parameters():
    """Stage 3 all-gathers a prefetch bucket (stage3_prefetch_bucket_size, 5e7 elements) into one flat tensor
    whose handle every parameter of the bucket keeps until it is fetched, after the first wait has copied
    each parameter out: forward holds the gathered copies and the bucket's flat buffer."""
    m = parse_model("demo")
    psi = total_params(m)
    est = lambda **kw: memory(m, Layout(dp=2, zero=3), **kw)  # noqa: E731
    assert est().breakdown["zero3_prefetch_bytes"] == pytest.approx(psi * 2)  # the whole model fits a bucket
    assert est(prefetch_bucket=1e5).breakdown["zero3_prefetch_bytes"] == pytest.approx(1e5 * 2)
    assert est(precision="fp32").breakdown["zero3_prefetch_bytes"] == pytest.approx(psi * 4)
    assert est().total_bytes - est(prefetch_bucket=0).total_bytes == pytest.approx(psi * 2)
    assert est(max_live=1e5).breakdown["zero3_gathered_bytes"] == pytest.approx(1e5 * 2)
    seven = parse_model("7b")
    assert memory(seven, Layout(dp=8, zero=3)).breakdown["zero3_prefetch_bytes"] == pytest.approx(5e7 * 2)
    for zero in (0, 1, 2):
        assert memory(m, Layout(dp=2, zero=zero)).breakdown["zero3_prefetch_bytes"] == 0


def test_korthikanti_formulas():
    # GPT-3 175B of the paper: s=2048, h=12288, a=96, b=1; per layer 34·sbh + 5·a·s²·b bytes
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    assert activation_per_layer(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert sbh * (34 + 5 * a * s / h) == pytest.approx(sbh * 114)  # 5·96·2048/12288 = 80
    for t in (1, 2, 8):
        for sp in (True, False):
            for rc in ("none", "selective", "full"):
                assert activation_per_layer(s, b, h, a, t, sp, rc) == pytest.approx(
                    paper_activation_per_layer(s, b, h, a, t, sp, rc)), (t, sp, rc)
    assert activation_per_layer(s, b, h, a, 8, True, "selective") == pytest.approx(sbh * 34 / 8)
    assert activation_per_layer(s, b, h, a, 8, False, "none") == pytest.approx(sbh * (10 + 3 + 80 / 8))
    assert activation_per_layer(s, b, h, a, 1, True, "full") == pytest.approx(2 * sbh)


def test_our_model_coefficients():
    # fp32, no dropout, SwiGLU 8/3 h (here h=96 -> hidden 256), RoPE, SDPA: per s·b·h
    m = ModelConfig(vocab_size=100, n_embd=96, n_head=4)
    am = ActivationModel.for_model(m, 4)
    replicated, split, scores = am.coefficients()
    assert replicated == 16  # 2 norms + QKV input + MLP input, 4 bytes each, no masks
    assert split == pytest.approx(4 * 4 + 2 * 4 + 4 + 4 * (256 / 96) * 4)  # Q,K,V,proj; rope; SDPA out; MLP
    assert scores == 0
    assert activation_per_layer(10, 2, 96, 4, am=am) == pytest.approx(10 * 2 * 96 * (replicated + split))


def test_memory_sums_and_pipeline():
    m = parse_model("7b")
    assert total_params(m) == 32 * (2 * 4096 + 4 * 4096**2 + 3 * 4096 * 10944) + 4096 + 2 * 32000 * 4096
    e = memory(m, Layout(dp=8, zero=3, micro_batch=1))
    assert e.total_bytes == pytest.approx(e.model_states_bytes + e.activation_bytes + e.temp_bytes)
    assert e.model_states_bytes == pytest.approx(16 * total_params(m) / 8)
    # 1F1B: with pp micro-batches in flight the first stage holds L layers' worth, like pp=1
    one = memory(m, Layout(dp=1, pp=1, micro_batch=1)).breakdown["activation_per_layer_bytes"]
    p4 = memory(m, Layout(dp=1, pp=4, micro_batch=1), micro_batches=8)
    # the heaviest stage: 8 of the 32 blocks and the untied head (the first holds the token table, as large)
    from lifecycle.tasks.train.sizing import outer_tensors

    outer = outer_tensors(m)
    stage = (total_params(m) - sum(outer.values())) / 4 + outer["lm_head.weight"] + outer["norm_f.weight"]
    assert p4.activation_bytes >= 32 * one and p4.model_states_bytes == pytest.approx(16 * stage)
    full = memory(m, Layout(dp=8, zero=3, micro_batch=1, recompute="full"))
    assert full.activation_bytes < e.activation_bytes / 5


def test_step_time_parts():
    """With a flat MFU the compute is the PaLM FLOPs over ranks × peak × MFU (the norms' few FLOPs aside)."""
    m = parse_model("7b")
    hw = Hardware(mfu=0.45)
    t = step_time(m, Layout(dp=8, zero=1, micro_batch=1), 64, hw)
    from lifecycle.tasks.train.sizing import flops_per_token
    assert t["compute_s"] == pytest.approx(64 * 4096 * flops_per_token(m) / (8 * hw.peak_flops * hw.mfu), rel=1e-4)
    assert t["dp_comm_total_s"] == pytest.approx(2 * 7 / 8 * total_params(m) * 2 / hw.intra_node_bw)
    assert t["dp_comm_s"] < t["dp_comm_total_s"]  # most of it under the backward pass
    assert t["bubble_s"] == 0 and t["tp_comm_s"] == 0
    pp = step_time(m, Layout(dp=2, pp=4, micro_batch=1), 64, hw)
    assert pp["bubble_s"] == pytest.approx(pp["compute_s"] * 3 / 32)  # (p-1)/m of the compute, m = 64/2
    z3 = step_time(m, Layout(dp=8, zero=3, micro_batch=1), 64, hw)
    assert z3["dp_comm_total_s"] == pytest.approx(3 * 8 * t["dp_comm_total_s"] / 2)  # 3Ψ per micro-batch, 8 of them


def test_matmul_rate_depends_on_its_shape():
    """The shape model: a big matmul near the ceiling, a thin tensor-parallel slice or a short reduction slower per
    FLOP, a tiny one bound by memory, and a last wave of tiles that is mostly empty paid in full."""
    from lifecycle.tasks.train.step_time import gemm_seconds

    hw = Hardware()
    rate = lambda m, n, k: 2 * m * n * k / gemm_seconds(m, n, k, hw) / hw.peak_flops  # noqa: E731
    assert 0.5 < rate(16384, 4096, 4096) <= hw.gemm_efficiency
    assert rate(16384, 4096, 256) < 0.7 * rate(16384, 4096, 4096)
    assert rate(16, 4096, 4096) < 0.05  # memory-bound: 2·16·4096·4096 FLOPs move 32 MiB of weights
    # 11 × 12 = 132 tiles of 128 × 128: one full wave on 132 SMs; 12 × 12 = 144: a second wave, mostly empty
    assert rate(12 * 128, 12 * 128, 8192) < 0.6 * rate(11 * 128, 12 * 128, 8192)


def test_data_parallel_bandwidth_follows_the_nics_a_node_gives_it():
    from lifecycle.tasks.train.step_time import dp_bandwidth

    hw = Hardware()
    assert dp_bandwidth(Layout(dp=8), hw) == hw.intra_node_bw
    assert dp_bandwidth(Layout(dp=64), hw) == min(hw.intra_node_bw, 8 * hw.inter_node_bw)
    assert dp_bandwidth(Layout(dp=8, tp=8), hw) == hw.inter_node_bw  # tp fills the node: one NIC for dp


def test_search_7b_on_8_gpus():
    opts = search(parse_model("7b"), 8, 80 * 2**30, 64)
    best = opts[0]
    assert best.fits and best.memory.total_bytes <= 78 * 2**30
    assert best.layout.ranks == 8
    assert all(not o.fits or o.time["step_s"] >= best.time["step_s"] for o in opts)
    # ZeRO-0 replicas of 16Ψ = 107 GB cannot fit
    assert not any(o.fits for o in opts if o.layout.dp == 8 and o.layout.zero == 0)


def test_parse():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("80GB") == 80e9
    m = parse_model("n_layer=2,n_embd=64,n_head=2,vocab=1000")
    assert (m.n_layer, m.n_embd, m.vocab_size) == (2, 64, 1000)
    assert parse_model("7b,seq_len=2048").seq_len == 2048
    from lifecycle.core.errors import UsageError
    with pytest.raises(UsageError, match="unknown preset"):
        parse_model("9b")
    with pytest.raises(UsageError, match="not a model field"):
        parse_model("layerz=3")


def test_cli(capsys):
    rc, got = lifecycle_in_process(capsys, "plan", "memory", "--params", "7.5e9", "--ranks", "64", "--zero", "3")
    assert rc == 0 and got["model_states_bytes"] == pytest.approx(1.875e9, rel=1e-6)
    assert got["total_bytes"] == got["model_states_bytes"] + got["activation_bytes"] + got["temp_bytes"]
    rc, got = lifecycle_in_process(capsys, "plan", "layout", "--model", "7b", "--gpus", "8", "--global-batch", "64")
    assert rc == 0 and got["best"]["fits"] and got["constants"]["mfu"] is None and got["constants"]["gemm_efficiency"] == 0.55 and got["runners_up"]
    rc, got = lifecycle_in_process(capsys, "plan", "--flops", "1e18")  # the compute-optimal command still works
    assert rc == 0 and "n_params" in got
    rc, got = lifecycle_in_process(capsys, "plan", "memory", "--model", "7b", "--ranks", "3", "--tp", "2")
    assert rc == 2 and "not a multiple of tp" in got["error"]


def test_layout_auto_picks_what_fits():
    from lifecycle.tasks.train.config import TrainConfig
    from lifecycle.tasks.train.layout_search import resolve_layout

    def cfg(mem):
        return TrainConfig(model=ModelConfig(vocab_size=4096, n_layer=4, n_embd=512, n_head=8, seq_len=256),
                           layout="auto", layout_memory=mem, batch={"micro_batch_size": 16, "num_ranks": 2})

    roomy, why = resolve_layout(cfg("2GiB"))
    assert (roomy.engine.zero_stage, roomy.batch.micro_batch_size, roomy.engine.activation_checkpointing) == (0, 16, False)
    assert "zero=0" in why and "fastest" in why and roomy.global_batch == 32
    tight, why = resolve_layout(cfg("400MiB"))  # 16-sequence micro-batches do not fit: smaller ones or recompute
    assert tight.global_batch == 32 and tight.batch.micro_batch_size * tight.batch.grad_accum == 16
    assert (tight.batch.micro_batch_size < 16 or tight.engine.activation_checkpointing or tight.engine.zero_stage > 0)
    assert "predicted" in why
    with pytest.raises(ValueError, match="train.layout=auto: no layout of 2 ranks fits"):
        resolve_layout(cfg("100MiB"))
    fixed = cfg(None).model_copy(update={"layout": "fixed"})
    assert resolve_layout(fixed) == (fixed, None)


def test_a_405b_plan_puts_tp_inside_a_node_and_pp_across_nodes_and_the_trainer_runs_it():
    """Llama 3.1 405B on 512 H100s (8 per node), global batch 256 (torchtitan's 3D run, FSDP 8 × TP 8 × PP 8): the
    best layout splits each layer over the 8 GPUs of a node and the layers over pipeline stages on different nodes,
    with dp over the rest; its --set lines make a config the trainer accepts. 70B on 64 GPUs: tp inside a node."""
    from lifecycle.tasks.train.config import TrainConfig
    from lifecycle.tasks.train.layout_search import apply_layout

    m = parse_model("llama3.1-405b")
    best = next(o for o in search(m, 512, 80 * 2**30, 256) if o.fits).layout
    assert best.tp == 8 and best.pp > 1 and best.dp > 1
    cfg = apply_layout(TrainConfig(model=m, batch={"num_ranks": 512, "micro_batch_size": 1, "grad_accum": 1}), best)
    assert cfg.global_batch == 256 and Layout.of(cfg).describe() == best.describe()
    assert all(line.startswith("train.") for line in best.set_lines())
    seventy = next(o for o in search(parse_model("llama3.1-70b"), 64, 80 * 2**30, 512) if o.fits).layout
    assert 1 < seventy.tp <= 8


def test_a_named_layout_sets_train_parallel():
    from pydantic import ValidationError

    from lifecycle.tasks.train.config import TrainConfig

    assert TrainConfig(layout="tp=1,pp=1,sp=1").layout == "tp=1,pp=1,sp=1"
    cfg = TrainConfig(layout="tp=2,dp=1", batch={"num_ranks": 2}, engine={"zero_stage": 1})
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sp, cfg.dp) == (2, 1, 1, 1)
    with pytest.raises(ValidationError, match="train.parallel.tp=4 but train.layout tp=2"):
        TrainConfig(layout="tp=2", parallel={"tp": 4}, batch={"num_ranks": 4}, engine={"zero_stage": 1})
    with pytest.raises(ValidationError, match="pipeline engine runs ZeRO-0 and ZeRO-1 only"):
        TrainConfig(layout="pp=2", batch={"num_ranks": 2})
    with pytest.raises(ValidationError, match="must be 'fixed', 'auto' or degrees"):
        TrainConfig(layout="ep=2")
    with pytest.raises(ValidationError, match="dp must equal train.batch.num_ranks"):
        TrainConfig(layout="dp=4", batch={"num_ranks": 2})
