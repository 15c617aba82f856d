"""MFU and tokens/s of our DeepSpeed train stage on one GPU, side by side with a plain PyTorch loop (the peer), and
the stall of its async checkpoints against synchronous saves of the same state.

`python -m bench.gpu_mfu --model {124m,350m} [--json]` on a host with a CUDA build of torch and DeepSpeed
(`bash bench/gpu_setup.sh`). One run measures, in this order, each in its own processes:
1. **ours**: `run_train` (the train stage's supervisor and a DeepSpeed rank, ZeRO-2, bf16, `train.engine.compile`
   on) for `--steps` steps, async checkpoints every `--every` steps (the first save is reported apart from the
   later ones), one step profiled with torch.profiler (`LIFECYCLE_PROFILE_STEP`);
2. **sync**: the same run with `train.checkpoint.async_save: false`, in another work dir: the synchronous save of
   the same state, the denominator of `save_stall_ratio`;
3. **peer**: the same model class, batch, data loader and precision in a plain loop: `torch.compile`d, fused
   AdamW, bf16 autocast over fp32 weights (nanoGPT's recipe), gradient clipping, no DeepSpeed.

Shapes (GPT-2's recipe: LayerNorm, GELU, learned positions, tied embeddings; vocabulary 50,304 = GPT-2's
50,257 padded to a multiple of 64, as nanoGPT pads it):
- 124m: 12 layers, width 768, 12 heads, seq 1024 (124.4 M parameters);
- 350m: 24 layers, width 1024, 16 heads, seq 1024 (354.9 M parameters);
- tiny: 2 layers, width 64, seq 64, vocabulary 512: a check of every path on a CPU (`--device cpu`).
The tokens are synthetic: windows over a stream of 2,000 random 16-token phrases spread over the whole
vocabulary, so the loss falls and every output row is used (this measures speed, not learning).

MFU = (6·N + 12·L·H·Q·T) × tokens/s / the GPU's datasheet dense peak for the precision
(lifecycle.tasks.train.hardware; `--peak` overrides it). tokens/s of ours are the medians of its train records
after the first (which holds the compile), each a window of `logging.every` steps that excludes save stalls;
the peer's are timed over its steps after `--warmup`, between two device synchronisations.
`stall_frac`: ours' loader wait over wall time. `save_stall_ratio`: the median blocking time of ours' later async
saves over the median synchronous save.

Prints a table, then (with `--json`) one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "124m": {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "vocab_size": 50304},
    "350m": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "seq_len": 1024, "vocab_size": 50304},
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "seq_len": 64, "vocab_size": 512},
}
RECIPE = {"norm": "layernorm", "mlp": "gelu", "pos": "learned", "tie_embeddings": True, "init": "gpt2_scaled"}
BATCH = {"124m": (16, 4), "350m": (16, 4), "tiny": (4, 1)}  # (micro batch, grad accumulation): 64 k tokens a step
DATA_VOCAB = {"124m": 50257, "350m": 50257, "tiny": 500}  # the token ids the data uses: GPT-2's 50,257, unpadded
LEVERS = ("compile", "fused_adamw", "no_host_sync", "pinned", "vocab_pad", "micro_batch")


def lever_off(name: str, model: str) -> tuple[str, list[str]]:
    """(what turning lever `name` off means, the peer's flags for it): each is measured alone against all on."""
    micro, accum = BATCH[model]
    return {
        "compile": ("eager: no torch.compile", ["--compile", "false"]),
        "fused_adamw": ("AdamW's foreach kernels, not the fused one", ["--no-fused"]),
        "no_host_sync": ("loss.item() after every micro-batch (a host synchronisation per step)", ["--item-every-step"]),
        "pinned": ("batches not page-locked (a blocking copy to the GPU)", ["--no-pin"]),
        "vocab_pad": (f"vocabulary {DATA_VOCAB[model]:,}, the data's, not padded to a multiple of 64",
                      ["--vocab", str(DATA_VOCAB[model])]),
        "micro_batch": (f"micro-batch {max(1, micro // 2)} x accumulation {accum * 2} (the same tokens a step)",
                        ["--micro", str(max(1, micro // 2)), "--accum", str(accum * 2)]),
    }[name]


def synthetic_tokens(workdir: str, vocab: int, n_tokens: int):
    """A committed token dataset (the tokenize stage's manifest fields) of phrase windows; no tokenizer."""
    import numpy as np

    from lifecycle.core import dataset as ds
    from lifecycle.core import fs

    rng = np.random.default_rng(0)
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    phrases = rng.integers(0, vocab, size=(2000, 16), dtype=np.int64)

    def build(w):
        counts = {}
        for split, n in (("train", n_tokens), ("val", max(n_tokens // 50, 4096))):
            stream = phrases[rng.integers(0, len(phrases), size=-(-n // 16))].reshape(-1)[:n].astype(dtype)
            stream.tofile(w.path(f"{split}.bin"))
            w.add_file(f"{split}.bin", kind="extra")
            counts[split] = int(n)
        fs.atomic_write_json(w.path("tokenizer.json"), {"synthetic": "bench.gpu_mfu: no tokenizer, token ids only"})
        w.add_file("tokenizer.json", kind="extra")
        return {"extra": {"tokenizer_sha256": fs.sha256_file(w.path("tokenizer.json")), "tokenizer_file": "tokenizer.json",
                          "dtype": np.dtype(dtype).name, "vocab_size": vocab, "eot_id": 0, "num_tokens": counts,
                          "num_docs": {"train": 1, "val": 1}, "shards": {"train": ["train.bin"], "val": ["val.bin"]}}}

    return ds.materialize(workdir, "tokenize", {"bench": "gpu_mfu", "vocab": vocab, "tokens": n_tokens}, "bench", build)


def train_config(a, async_save: bool = True, steps: int | None = None, every: int | None = None):
    from lifecycle.tasks.train.config import ModelConfig, TrainConfig

    micro, accum = a.micro or BATCH[a.model][0], a.accum or BATCH[a.model][1]
    steps = steps or a.steps
    shape = {**SHAPES[a.model], **({"vocab_size": a.vocab} if a.vocab else {})}
    return TrainConfig(
        model=ModelConfig(**shape, **RECIPE), max_steps=steps, seed=1337,
        optimizer={"decay_steps": max(steps, a.steps, 10), "warmup_steps": 5, "lr": 6e-4, "min_lr": 6e-5},
        batch={"micro_batch_size": micro, "grad_accum": accum, "num_ranks": 1},
        engine={"zero_stage": a.zero, "precision": a.precision, "accelerator": a.device,
                "compile": "auto" if a.compile is None else a.compile},
        checkpoint={"every": every or a.every, "keep_last": 2, "async_save": async_save},
        logging={"every": a.log_every, "eval_every": 0, **({"peak_flops_per_rank": a.peak} if a.peak else {})},
        launch={"timeout_s": 1200, "stall_s": 600})


def run_ours(a, tokens, workdir: str, async_save: bool, steps: int, every: int, profile: int | None) -> dict:
    """One `run_train`; its train records, save stalls and commit delays, and the profile of one step."""
    from lifecycle.tasks.train.launch import run_train

    if profile:
        os.environ["LIFECYCLE_PROFILE_STEP"] = str(profile)
    try:
        t0 = time.time()
        r = run_train(tokens, train_config(a, async_save, steps, every), workdir)
        wall = time.time() - t0
    finally:
        os.environ.pop("LIFECYCLE_PROFILE_STEP", None)
    rows = [json.loads(x) for x in open(r.metrics_path) if x.strip()]
    train = [x for x in rows if x.get("kind") == "train"]
    log = Path(r.log_path).read_text()
    stalls = [(int(n), float(s)) for s, n in re.findall(r"save stall ([\d.]+)s at step (\d+)", log)]
    prof = sorted(Path(r.log_path).parent.glob("profile-step*.json"))
    return {"wall_s": wall, "train": train, "stalls": stalls, "log": log,
            "commits": [float(x) for x in re.findall(r"committed \S+, ([\d.]+)s after its save began", log)],
            "blocked": re.findall(r"save \d+ blocked .*", log), "basis": re.findall(r"^MFU = .*", log, re.M),
            "compiled": "model compiled with torch.compile" in log,
            "profile": json.loads(prof[0].read_text()) if prof else None}


def peer(a, tokens) -> dict:
    """The plain loop, in this process (the bench runs it in a child of its own: `--role peer`)."""
    import torch

    from lifecycle.tasks.data.tokenize.stage import token_shards
    from lifecycle.tasks.train.hardware import datasheet_peak
    from lifecycle.tasks.train.loader import Prefetcher
    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.loader import get_batch

    cfg = train_config(a)
    shards = token_shards(tokens)
    cuda = a.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optimizer.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.optimizer.lr,
                            betas=cfg.optimizer.betas, **({"fused": True} if cuda and not a.no_fused else {}))
    fpt = model.flops_per_token()
    step_model = torch.compile(model) if cfg.engine.compiled else model
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    accum, total = cfg.batch.grad_accum, a.warmup + a.peer_steps
    keys = ((s, s, m) for s in range(total) for m in range(accum))
    pin = cuda and not a.no_pin
    loader = Prefetcher(lambda k: get_batch(shards, cfg, k[1], 0, k[2], pin), keys, cfg.launch.prefetch)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses, t0 = [], None
    for s in range(total):
        if s == a.warmup:
            sync()
            t0 = time.perf_counter()
        for m in range(accum):
            x, y = loader.get((s, s, m))
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                _, loss = step_model(x, y)
            (loss / accum).backward()
            if a.item_every_step:  # what the train loop did before issue 17: the host waits for the device
                loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s % 10 == 0 or s == total - 1:
            losses.append(loss.item())  # logging steps only, as ours
    sync()
    wall = time.perf_counter() - t0
    loader.close()
    step_s = wall / a.peer_steps
    tps = cfg.global_batch * cfg.model.seq_len / step_s
    found = datasheet_peak(torch.cuda.get_device_name(), a.precision) if cuda else None
    peak = a.peak or (found[0] if found else None)
    return {"tokens_per_s": tps, "step_ms": step_s * 1e3, "mfu": fpt * tps / peak if peak else None,
            "flops_per_token": fpt, "losses": losses}


def header(a) -> dict:
    """What every result line starts with: the run's settings, when and at which commit."""
    return {"model": a.model, "device": a.device, "precision": a.precision,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_head()}


def run_peer(tokdir: str, args: list[str]) -> tuple[dict | None, str]:
    """The peer loop in a process of its own (`--role peer`): (its result, None) or (None, its stderr's tail)."""
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_mfu", "--role", "peer", "--tokens", tokdir, *args],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        return None, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


def levers(a) -> dict:
    """The peer with every lever on, then with each one of `a.levers` turned off alone: tokens/s and the ratio to
    all on, so each lever's worth is measured apart (issue 17: "measured one at a time")."""
    names = list(LEVERS) if a.levers == "all" else a.levers.split(",")
    if unknown := [n for n in names if n not in LEVERS]:
        raise SystemExit(f"--levers: unknown {unknown}; choose from {', '.join(LEVERS)} or all")
    cfg = train_config(a)
    out = {**header(a), "levers": {}}
    base_args = [x for x in a.passthrough if not x.startswith("--levers=")]
    if "--levers" in base_args:  # and its value
        i = base_args.index("--levers")
        base_args = base_args[:i] + base_args[i + 2:]
    if a.compile is None:  # every lever on: compiled, also where `auto` would not compile (the CPU)
        base_args += ["--compile", "true"]
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        need = (a.warmup + a.peer_steps + 2) * cfg.global_batch * cfg.model.seq_len // 4 + 10**6
        tokens = synthetic_tokens(str(Path(tmp) / "tok"), DATA_VOCAB[a.model], need)
        tokdir = str(Path(tokens.manifest_path).parent)
        for name, (what, flags) in [("all on", ("every lever on", []))] + [(n, lever_off(n, a.model)) for n in names]:
            got, error = run_peer(tokdir, [*base_args, *flags])
            if got is None:
                out["levers"][name] = {"what": what, "error": error}
                print(f"  {name:14} failed: {error.strip().splitlines()[-1] if error.strip() else '?'}")
                continue
            out["levers"][name] = {"what": what, **got}
            base = out["levers"]["all on"].get("tokens_per_s") if "all on" in out["levers"] else None
            rel = f"{got['tokens_per_s'] / base:.3f}x all on" if base else ""
            print(f"  {name:14} {got['tokens_per_s']:12,.0f} tokens/s {got['step_ms']:8.1f} ms  {rel:>16}  {what}",
                  flush=True)
    return out


def loader_capacity(a) -> dict:
    """Tokens/s that one prefetch thread's `get_batch` prepares for this shape (no GPU needed; pinned on CUDA):
    the rate the loader can feed, to set against the step's tokens/s."""
    import torch

    from lifecycle.tasks.data.tokenize.stage import token_shards
    from lifecycle.tasks.train.loader import get_batch

    cfg = train_config(a)
    pin = a.device == "cuda" and torch.cuda.is_available()
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        shards = token_shards(synthetic_tokens(str(Path(tmp) / "tok"), cfg.model.vocab_size, 50 * 10**6))
        get_batch(shards, cfg, 0, 0, 0, pin)  # warm: the maps, the allocator
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 3.0:
            get_batch(shards, cfg, n, 0, n % cfg.batch.grad_accum, pin)
            n += 1
        wall = time.perf_counter() - t0
    tps = n * cfg.batch.micro_batch_size * cfg.model.seq_len / wall
    print(f"loader: {n} micro-batches of {cfg.batch.micro_batch_size} x {cfg.model.seq_len} tokens in {wall:.2f} s, "
          f"{tps:,.0f} tokens/s from one thread{' (pinned)' if pin else ''}")
    return {"loader_tokens_per_s": tps, "pinned": pin}


def main(a) -> dict:
    from lifecycle.tasks.train.hardware import datasheet_peak

    out: dict = {**header(a), "zero_stage": a.zero}
    if a.device == "cuda":
        import torch

        out["gpu"] = torch.cuda.get_device_name()
        found = datasheet_peak(out["gpu"], a.precision)
        out["peak_flops"], out["peak_source"] = (a.peak, "--peak") if a.peak else (found or (None, "none"))
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        cfg = train_config(a)
        need = (max(a.steps, a.warmup + a.peer_steps) + 2) * cfg.global_batch * cfg.model.seq_len // 4 + 10**6
        tokens = synthetic_tokens(str(Path(tmp) / "tok"), DATA_VOCAB[a.model], need)
        timings = {}
        t = time.time()
        try:
            ours = run_ours(a, tokens, str(Path(tmp) / "ours"), True, a.steps, a.every, a.profile_step)
        except Exception as e:  # noqa: BLE001 - say why, then measure what still can be
            if a.compile is False:
                raise
            print(f"ours failed with compile {a.compile or 'auto'}; measuring it eager instead:\n{e}", flush=True)
            out["ours_compile_error"] = str(e)[-4000:]
            a.compile = False
            a.passthrough += ["--compile", "false"]
            ours = run_ours(a, tokens, str(Path(tmp) / "ours-eager"), True, a.steps, a.every, a.profile_step)
        timings["ours_s"] = time.time() - t
        records = [r for r in ours["train"] if r["step"] > ours["train"][0]["step"]]  # the first holds the compile
        med = {k: statistics.median(r[k] for r in records) if all(k in r for r in records) else None
               for k in ("step_time", "tokens_per_s", "mfu", "mfu_measured", "stall_frac")}  # no mfu_measured: --peak
        out["params"], out["flops_per_token"] = records[-1]["params"], records[-1]["flops_per_token"]
        out["ours"] = {"tokens_per_s": med["tokens_per_s"], "step_ms": med["step_time"] * 1e3, "mfu": med["mfu"],
                       "mfu_vs_measured_matmul": med["mfu_measured"], "compiled": ours["compiled"],
                       "loss": [round(r["loss"], 3) for r in ours["train"]]}
        out["mfu_basis"] = ours["basis"][0] if ours["basis"] else None
        out["stall_frac"] = med["stall_frac"]
        out["profile"] = ours["profile"]
        saves = [s for n, s in ours["stalls"] if n != a.steps]  # the last save waits for its commit: not a stall
        out["save"] = {"first_async_s": saves[0] if saves else None,
                       "later_async_s": statistics.median(saves[1:]) if len(saves) > 1 else None,
                       "final_save_with_commit_s": next((s for n, s in ours["stalls"] if n == a.steps), None),
                       "commit_after_s": ours["commits"], "blocked": ours["blocked"]}
        if a.sync_steps:
            t = time.time()
            try:
                sync = run_ours(a, tokens, str(Path(tmp) / "sync"), False, a.sync_steps, a.sync_every, None)
            except Exception as e:  # noqa: BLE001 - the other figures stand
                print(f"the synchronous-save run failed:\n{e}", flush=True)
                out["sync_error"], sync = str(e)[-4000:], {"stalls": []}
            timings["sync_s"] = time.time() - t
            sync_saves = [s for n, s in sync["stalls"]]
            out["save"]["sync_s"] = statistics.median(sync_saves) if sync_saves else None
            sync_s, first = out["save"]["sync_s"], out["save"]["first_async_s"]
            later = out["save"]["later_async_s"] if out["save"]["later_async_s"] is not None else first
            out["save_stall_ratio"] = later / sync_s if later is not None and sync_s else None
            out["save"]["first_save_ratio"] = first / sync_s if first is not None and sync_s else None
        if a.peer_steps:
            t = time.time()
            got, error = run_peer(str(Path(tokens.manifest_path).parent), a.passthrough)
            timings["peer_s"] = time.time() - t
            if got is None:  # ours' figures still stand: say why there is no ratio
                out["peer_error"] = error
                print(f"the peer loop failed:\n{error}", flush=True)
            else:
                out["peer"] = got
                out["ratio"] = out["ours"]["tokens_per_s"] / got["tokens_per_s"]
        out["timings"] = timings
    return out


def git_head() -> str | None:
    """This checkout's commit (LIFECYCLE_COMMIT where the tree was copied without its .git, as to a lent GPU)."""
    if os.environ.get("LIFECYCLE_COMMIT"):
        return os.environ["LIFECYCLE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def report(o: dict) -> None:
    peer = o.get("peer", {})
    print(f"{o['model']} on {o.get('gpu', o['device'])} ({o['precision']}, ZeRO-{o['zero_stage']}), "
          f"{o['params']:,} parameters, {o['flops_per_token']:,} FLOPs/token; commit {o['commit']}, {o['date']}")
    if o.get("mfu_basis"):
        print("  " + o["mfu_basis"])
    print(f"  {'':8} {'tokens/s':>12} {'step ms':>9} {'MFU':>7}")
    for name, r in (("ours", o["ours"]), ("peer", peer)):
        if r:
            mfu = f"{r['mfu']:.3f}" if r.get("mfu") is not None else "-"
            print(f"  {name:8} {r['tokens_per_s']:12,.0f} {r['step_ms']:9.1f} {mfu:>7}")
    if "ratio" in o:
        print(f"  ours / peer tokens/s: {o['ratio']:.3f} (goal >= 0.95)")
    print(f"  loader stall fraction {o['stall_frac']:.5f} (goal <= 0.01)")
    s = o["save"]
    print(f"  saves: first async {s['first_async_s']}s, later async {s['later_async_s']}s, sync {s.get('sync_s')}s; "
          f"save_stall_ratio {o.get('save_stall_ratio')} (goal <= 0.10); commits {s['commit_after_s']}s after the save")
    for line in s["blocked"]:
        print("   ", line)
    if o.get("profile"):
        p = o["profile"]
        print(f"  profiled step: {p['wall_s'] * 1e3:.1f} ms wall, {p['kernel_s'] * 1e3:.1f} ms in kernels, "
              f"{p['outside_kernels_frac']:.1%} outside kernels; top kernels:")
        for k in p["top"][:8]:
            print(f"    {k['share']:6.1%} {k['ms']:8.2f} ms  x{k['calls']:<4} {k['name'][:90]}")


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_mfu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="124m")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--zero", type=int, default=2, help="ZeRO stage of ours (default 2)")
    ap.add_argument("--micro", type=int, default=None, help="micro-batch size (default: per shape)")
    ap.add_argument("--accum", type=int, default=None, help="gradient accumulation steps (default: per shape)")
    ap.add_argument("--steps", type=int, default=60, help="steps of ours (default 60)")
    ap.add_argument("--every", type=int, default=20, help="ours' async save interval (default 20)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--sync-steps", type=int, default=12, help="steps of the synchronous-save run (0: skip it)")
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--peer-steps", type=int, default=30, help="timed steps of the peer (0: skip it)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps of the peer (its compile)")
    ap.add_argument("--profile-step", type=int, default=25, help="ours' step to profile (0: none; CUDA only)")
    ap.add_argument("--peak", type=float, default=None, help="peak FLOP/s per GPU (default: the datasheet's)")
    ap.add_argument("--compile", type=lambda v: v.lower() in ("1", "true", "yes", "on"), default=None,
                    help="true/false: train.engine.compile for ours and the peer (default auto: on for cuda)")
    ap.add_argument("--tmp", default=None, help="where the work dirs go (default: the system's temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    ap.add_argument("--vocab", type=int, default=None, help="model vocabulary (default: the shape's, 50,304 or 512)")
    ap.add_argument("--levers", default=None, metavar="NAMES|all",
                    help=f"only the peer, with each lever off in turn: {', '.join(LEVERS)} (comma-separated) or all")
    ap.add_argument("--no-fused", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-pin", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--item-every-step", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--loader", action="store_true",
                    help="only measure the tokens/s one prefetch thread prepares for this shape (runs on a CPU)")
    ap.add_argument("--role", choices=["bench", "peer"], default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.precision = a.precision or ("bf16" if a.device == "cuda" else "fp32")
    argv = sys.argv[1:] if argv is None else argv
    a.passthrough = [x for x in argv if x not in ("--json",)]
    return a


if __name__ == "__main__":
    args = parse()
    os.environ.setdefault("DS_ACCELERATOR", args.device)
    if args.loader:
        print(json.dumps(loader_capacity(args)))
    elif args.levers and args.role == "bench":
        result = levers(args)
        if args.json:
            print(json.dumps(result))
    elif args.role == "peer":
        from lifecycle.core import dataset as ds

        print(json.dumps(peer(args, ds.DatasetRef.from_dir(args.tokens))))
    else:
        result = main(args)
        report(result)
        if args.json:
            print(json.dumps(result))
