"""`lifecycle plan memory` and `lifecycle plan layout`: the planner's command line."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

from lifecycle.core.errors import UsageError
from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.layout_search import Option, runners_up, search
from lifecycle.tasks.train.parallel.mesh import RECOMPUTE, Layout
from lifecycle.tasks.train.planner import (PRESETS, ZERO3_PREFETCH, gib, memory, parse_bytes, parse_count, parse_model,
                                           total_params)
from lifecycle.tasks.train.step_time import Hardware
from lifecycle.tasks.train.zero_memory import GRAD_BUCKET, PRECISIONS


def model_from_args(args: argparse.Namespace) -> tuple[ModelConfig, float]:
    """(shape, Ψ): `--model SHAPE`, or `--params P` with a Llama-style shape of P parameters (sizing)."""
    from lifecycle.tasks.train.sizing import model_for_params

    if args.model:
        m = parse_model(args.model)
        if args.seq_len:
            m = m.model_copy(update={"seq_len": args.seq_len})
        return m, float(total_params(m))
    psi = parse_count(args.params)
    if psi <= 0:
        raise UsageError(f"--params must be positive, got {args.params}")
    base = ModelConfig(vocab_size=32000, seq_len=args.seq_len or 2048, tie_embeddings=False)
    return model_for_params(psi, base), psi


def shape_of(m: ModelConfig) -> dict:
    return {k: getattr(m, k) for k in ("n_layer", "n_embd", "n_head", "kv_heads", "mlp_hidden", "seq_len", "vocab_size",
                                       "mlp", "pos", "tie_embeddings", "qkv_bias")}


def cmd_memory(args: argparse.Namespace) -> int:
    m, psi = model_from_args(args)
    model_par = args.tp * args.pp * args.sp
    if args.ranks % model_par:
        raise UsageError(f"--ranks {args.ranks} is not a multiple of tp x pp x sp = {model_par}")
    if m.n_head % (args.tp * args.sp):
        raise UsageError(f"n_head {m.n_head} is not divisible by tp x sp = {args.tp * args.sp}")
    if args.offload and args.zero == 0:
        raise UsageError("--offload needs --zero 1, 2 or 3 (ZeRO-Offload moves the partitioned optimizer states)")
    lay = Layout(dp=args.ranks // model_par, tp=args.tp, pp=args.pp, sp=args.sp, zero=args.zero,
                 micro_batch=args.micro_batch, recompute=args.activation_checkpointing, offload=args.offload,
                 tp_sequence_parallel=not args.no_sequence_parallel)
    est = memory(m, lay, args.precision, micro_batches=args.micro_batches,
                 fused_attention=args.attention == "fused", params=psi, device=args.device,
                 reduce_bucket=args.reduce_bucket, prefetch_bucket=args.prefetch_bucket, optimizer=args.optimizer)
    out = {"model": shape_of(m), "params": psi, "precision": args.precision, "attention": args.attention,
           "ranks": args.ranks, **est.as_dict()}
    if args.json:
        print(json.dumps(out))
        return 0
    br = est.breakdown
    print(f"model     {' '.join(f'{k}={v}' for k, v in shape_of(m).items())}  Ψ = {psi:,.0f} parameters")
    print(f"layout    {lay.describe()} ({args.ranks} ranks, {args.precision}, {args.attention} attention)")
    print(f"per rank  model states {gib(est.model_states_bytes)} (params {gib(br['params_bytes'])}, grads "
          f"{gib(br['grads_bytes'])}, optimizer {gib(br['optimizer_bytes'])})")
    print(f"          activations  {gib(est.activation_bytes)} ({gib(br['activation_per_layer_bytes'])} per layer, "
          f"output layer {gib(br['output_layer_bytes'])})")
    states, acts = est.model_states_bytes, est.activation_bytes
    print(f"          buffers      backward {gib(br['backward_buffers_bytes'])} (gradient bucket "
          f"{gib(br['grad_bucket_bytes'])}, a gradient waiting for it {gib(br['pending_grad_bytes'])}, loss backward "
          f"{gib(br['loss_backward_bytes'])}, ZeRO-3 gathered {gib(br['zero3_gathered_bytes'])} and prefetch buffer "
          f"{gib(br['zero3_prefetch_bytes'])})")
    print(f"                       step {gib(br['step_buffers_bytes'] + br['step_grads_released_bytes'])} (fp32 "
          f"gradients {gib(br['step_fp32_grad_bytes'])}, optimizer step {gib(br['optimizer_step_temp_bytes'])}, ZeRO-3's "
          f"gradient bucket), and ZeRO-1 has released {gib(br['step_grads_released_bytes'])} of gradients")
    print(f"          peak of      backward {gib(states + acts + br['backward_buffers_bytes'])} (states + activations "
          f"+ buffers), step {gib(states + br['step_buffers_bytes'])} (states + buffers - released)")
    print(f"          total        {gib(est.total_bytes)}")
    return 0


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    hw = Hardware()
    names = ("peak_flops", "gemm_efficiency", "attention_efficiency", "memory_bw", "mfu", "gpus_per_node",
             "intra_node_bw", "inter_node_bw", "pcie_bw", "cpu_adam_params_per_s")
    over = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.reserve is not None:
        over["reserve_bytes"] = parse_bytes(args.reserve)
    return replace(hw, **over)


def describe_option(o: Option) -> str:
    t = o.time
    return (f"{o.layout.describe()}\n    memory {gib(o.memory.total_bytes)} per GPU (model states "
            f"{gib(o.memory.model_states_bytes)}, activations {gib(o.memory.activation_bytes)}, temporary "
            f"{gib(o.memory.temp_bytes)})\n    step {t['step_s']:.3f} s (compute {t['compute_s']:.3f}, bubble "
            f"{t['bubble_s']:.3f}, dp {t['dp_comm_s']:.3f}, tp {t['tp_comm_s']:.3f}, sp {t['sp_comm_s']:.3f}, "
            f"pp {t['pp_comm_s']:.3f}, offload {t['offload_s']:.3f}), MFU {t['mfu']:.1%}")


def cmd_layout(args: argparse.Namespace) -> int:
    m, _ = model_from_args(args)
    hw = hardware_from_args(args)
    mem = parse_bytes(args.gpu_memory)
    if args.gpus < 1 or args.global_batch < 1:
        raise UsageError("--gpus and --global-batch must be >= 1")
    opts = search(m, args.gpus, mem, args.global_batch, hw, args.precision, optimizer=args.optimizer)
    fitting = [o for o in opts if o.fits]
    best, rest = (fitting[0], runners_up(fitting[1:], args.top)) if fitting else (None, [])
    if args.json:
        print(json.dumps({"model": shape_of(m), "params": total_params(m), "gpus": args.gpus, "gpu_memory_bytes": mem,
                          "global_batch": args.global_batch, "precision": args.precision,
                          "constants": asdict(hw), "searched": len(opts), "fitting": len(fitting),
                          "best": best.as_dict() if best else None, "runners_up": [o.as_dict() for o in rest],
                          "smallest_if_none_fits": None if best else min(opts, key=lambda o: o.memory.total_bytes).as_dict()}))
        return 0 if best else 1
    print(f"model     {' '.join(f'{k}={v}' for k, v in shape_of(m).items())}  Ψ = {total_params(m):,} parameters")
    rate = (f"a flat MFU of {hw.mfu:.0%}" if hw.mfu is not None else f"matmuls by shape up to {hw.gemm_efficiency:.0%}, "
            f"attention {hw.attention_efficiency:.0%}, memory {hw.memory_bw / 1e12:g} TB/s")
    print(f"hardware  {args.gpus} GPUs x {gib(mem)}, {hw.gpus_per_node} per node; peak {hw.peak_flops:.3g} FLOP/s, "
          f"{rate}; ring {hw.intra_node_bw / 1e9:g} GB/s in a node, {hw.inter_node_bw / 1e9:g} GB/s "
          f"across; PCIe {hw.pcie_bw / 1e9:g} GB/s; {gib(hw.reserve_bytes)} reserved per GPU")
    print(f"searched  {len(opts)} layouts for a global batch of {args.global_batch} x {m.seq_len} tokens "
          f"({args.precision}); {len(fitting)} fit")
    if not best:
        small = min(opts, key=lambda o: o.memory.total_bytes)
        print(f"none fits: the smallest needs {gib(small.memory.total_bytes)} per GPU: {small.layout.describe()}")
        return 1
    print(f"best      {describe_option(best)}")
    print("run it    lifecycle run CONFIG " + " ".join(f"--set {line}" for line in best.layout.set_lines()))
    for i, o in enumerate(rest, 1):
        print(f"{i}.        {describe_option(o)}")
    return 0


def register(subparsers) -> None:
    """`lifecycle plan` (lifecycle.tasks.train.sizing.register) with `memory` and `layout` under it."""
    from lifecycle.tasks.train.sizing import register as register_plan

    plan_parser = register_plan(subparsers)
    sub = plan_parser.add_subparsers(dest="plan_command", metavar="{memory,layout}")
    _memory_parser(sub)
    _layout_parser(sub)


def _model_args(p: argparse.ArgumentParser, params: bool) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="a preset (" + ", ".join(PRESETS) + "), hf:DIR (a Hugging Face checkpoint's "
                                   "config.json: Llama, Mistral, Qwen2; seq_len 4096) or n_layer=32,n_embd=4096,"
                                   "n_head=32,vocab=32000[,seq_len=4096,n_kv_head=8,mlp=gelu,...]; presets and "
                                   "hf:DIR take overrides: 7b,seq_len=2048")
    if params:
        g.add_argument("--params", help="a parameter count (7e9, 7B, 350M): a Llama-style shape of that size")
    else:
        p.set_defaults(params=None)
    p.add_argument("--seq-len", type=int, help="sequence length (default: the model's)")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16",
                   help="bf16/fp16: mixed-precision Adam, 2+2+12 bytes per parameter (ZeRO paper); fp32: 4+4+8 "
                        "(+4 for DeepSpeed's ZeRO-1/2 master copy) as this project trains on CPU (default bf16)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: DeepSpeed's Muon on the blocks' matrices (one momentum instead of two Adam moments; "
                        "train.optimizer.name), AdamW on the rest (default adamw)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _memory_parser(sub) -> None:
    mem = sub.add_parser("memory", help="Per-rank bytes of one layout: model states (ZeRO paper), activations "
                                        "(Korthikanti et al. 2022) and temporary buffers.")
    _model_args(mem, params=True)
    mem.add_argument("--ranks", type=int, default=1, help="total ranks (dp = ranks / (tp x pp x sp)); default 1")
    mem.add_argument("--zero", type=int, choices=range(4), default=0, help="ZeRO stage 0-3 (default 0)")
    for axis in ("tp", "pp", "sp"):
        mem.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} degree (default 1)")
    mem.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per forward (default 1)")
    mem.add_argument("--micro-batches", type=int, help="micro-batches per step under pp (default pp: 1F1B full)")
    mem.add_argument("--activation-checkpointing", choices=RECOMPUTE, default="none",
                     help="none, selective (fused attention: the trainer's per-op policy; materialized: "
                          "recompute the scores) or full (keep each layer's input)")
    mem.add_argument("--attention", choices=("fused", "materialized"), default="fused",
                     help="fused (SDPA/flash: no a·s·s scores kept; this project's model) or materialized "
                          "(Korthikanti's 5·a·s/h term)")
    mem.add_argument("--no-sequence-parallel", action="store_true",
                     help="tp without Megatron sequence parallelism (norm/dropout activations not split)")
    mem.add_argument("--offload", action="store_true", help="ZeRO-Offload: optimizer states on the CPU")
    mem.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                     help="cuda (default): a reserved buffer counts whole, as the caching allocator hands it out; "
                          "cpu: only the pages written count (the resident set of a CPU run)")
    mem.add_argument("--reduce-bucket", type=float, default=GRAD_BUCKET,
                     help="DeepSpeed's zero_optimization.reduce_bucket_size, elements (default 5e8)")
    mem.add_argument("--prefetch-bucket", type=float, default=ZERO3_PREFETCH,
                     help="DeepSpeed's zero_optimization.stage3_prefetch_bucket_size, elements (default 5e7)")
    mem.set_defaults(func=cmd_memory)


def _layout_parser(sub) -> None:
    lay = sub.add_parser("layout", help="Search the layouts the trainer runs (dp/tp/pp/sp, ZeRO stage, micro-batch, "
                                        "recomputation); print the fastest that fits, how to run it, the runners-up.")
    _model_args(lay, params=False)
    lay.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    lay.add_argument("--gpu-memory", default="80GiB", help="memory per GPU (default 80GiB)")
    lay.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    lay.add_argument("--top", type=int, default=4, help="runners-up to print (default 4)")
    lay.add_argument("--mfu", type=float, help="a flat fraction of peak for all compute instead of the matmul-shape "
                     "model (default: the shape model)")
    for name, what in (("peak-flops", "dense FLOP/s per GPU"), ("gemm-efficiency", "fraction of peak large matmuls "
                       "sustain"), ("attention-efficiency", "fraction of peak fused attention reaches"),
                       ("memory-bw", "GPU memory bytes/s"),
                       ("intra-node-bw", "ring bytes/s per GPU in a node"),
                       ("inter-node-bw", "bytes/s per GPU across nodes"), ("pcie-bw", "host<->GPU bytes/s"),
                       ("cpu-adam-params-per-s", "CPU Adam parameters/s per GPU")):
        lay.add_argument(f"--{name}", type=float, help=f"{what} (default {getattr(Hardware(), name.replace('-', '_')):g})")
    lay.add_argument("--gpus-per-node", type=int, help=f"default {Hardware().gpus_per_node}")
    lay.add_argument("--reserve", help="memory per GPU kept out of the plan (default 2GiB)")
    lay.set_defaults(func=cmd_layout)
