"""One DeepSpeed rank: `deepspeed --module lifecycle.tasks.train.trainer --config <run_dir>/config.json`.

Started by `lifecycle.tasks.train.launch.run_train` (never imports Prefect or MLflow). Every rank reads the same launch
config, builds the same initial model (same seed), and draws its batches from a stateless sampler:
micro-batch `m` of update `s` on rank `r` is `default_rng([seed, s, r, m])` windows over the train shards.
So a resumed run sees exactly the batches an uninterrupted run would have seen; the sampler state in the
checkpoint is just its position plus the settings it depends on, checked on resume. Python, NumPy and
torch RNG states of every rank go into `client_state` too (DeepSpeed saves none of them), so dropout
also replays.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

T_START = time.time()

import numpy as np
import torch
import torch.distributed as dist

from lifecycle.core.fs import atomic_write_json
from lifecycle.tasks.train import checkpoint as ckpt
from lifecycle.tasks.train.loader import Prefetcher, data_step
from lifecycle.tasks.train.model import GPT
from lifecycle.tasks.data.tokenize.stage import TokenShards
from lifecycle.tasks.train.config import TrainConfig


def ds_config(cfg: TrainConfig) -> dict:
    """DeepSpeed config. The optimizer (torch AdamW) and the LambdaLR schedule are built in `main`."""
    return {
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * cfg.num_ranks,
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.precision == "bf16"},
        "zero_allow_untested_optimizer": True,  # our torch.optim.AdamW: no DeepSpeed optimizer op to JIT-build
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
    }


def stub_muon() -> None:
    """DeepSpeed 0.19's ZeRO and bf16 optimizers import its Muon modules (only to run isinstance checks
    when Muon is not in use), and those modules' @torch.compile decorators import inductor: about 7 s of
    CPU per rank, on every launch. We never use Muon, so register stand-ins first: a class nothing is an
    instance of, and an update function that refuses to run."""
    import types

    def muon_update(*args, **kwargs):
        raise RuntimeError("Muon is stubbed out in lifecycle.tasks.train.trainer; this loop trains with AdamW")

    for name, attrs in (("deepspeed.runtime.zero.muon.original_muon", {"muon_update": muon_update}),
                        ("deepspeed.runtime.zero.muon.muon_optimizer",
                         {"MuonWithAuxAdam": type("MuonWithAuxAdam", (), {})})):
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name, "stand-in registered by lifecycle.tasks.train.trainer.stub_muon")
            vars(sys.modules[name]).update(attrs)


def sampler_state(cfg: TrainConfig, next_step: int, world: int, skipped: list[int] = ()) -> dict:
    """`skipped`: data steps thrown away by loss-spike rollbacks; step s reads data step
    `loader.data_step(s, skipped)`."""
    return {"kind": "uniform_windows", "next_step": next_step, "seed": cfg.seed, "world_size": world,
            "micro_batch_size": cfg.micro_batch_size, "grad_accum": cfg.grad_accum, "seq_len": cfg.model.seq_len,
            "skipped": sorted(skipped)}


DEVICE = torch.device("cpu")  # this rank's device, set by `select_device` at start-up


def select_device(cfg: TrainConfig) -> tuple[torch.device, str]:
    """(device, process-group backend) for `train.accelerator`: the CPU with gloo, or this rank's GPU
    (LOCAL_RANK, set by the launcher) with NCCL."""
    global DEVICE
    if cfg.accelerator == "cpu":
        DEVICE = torch.device("cpu")
        return DEVICE, "gloo"
    if not torch.cuda.is_available():
        raise RuntimeError("train.accelerator=cuda, but torch sees no CUDA device on this host "
                           f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use accelerator: cpu")
    DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(DEVICE)
    return DEVICE, "nccl"


def measure_peak_flops(seconds: float = 0.3, n: int = 512, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n×n matmul in `dtype` on this rank's device (on the CPU, this process's threads): the MFU
    denominator when none is configured."""
    if DEVICE.type == "cuda":
        n = max(n, 4096)
    a, b = torch.randn(n, n, device=DEVICE, dtype=dtype), torch.randn(n, n, device=DEVICE, dtype=dtype)
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else (lambda: None)
    a @ b  # warm-up
    sync()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def injected_faults() -> set[int]:
    """Data steps whose loss is made NaN (fault injection for tests and benchmarks only):
    LIFECYCLE_FAULT_NAN_DATA_STEPS="17,40"."""
    raw = os.environ.get("LIFECYCLE_FAULT_NAN_DATA_STEPS", "")
    return {int(x) for x in raw.split(",") if x.strip()}


def get_batch(shards: TokenShards, cfg: TrainConfig, step: int, rank: int, micro: int):
    """(x, y) int64 tensors (B, T) of random windows, a pure function of (seed, step, rank, micro)."""
    T, B = cfg.model.seq_len, cfg.micro_batch_size
    # We recreate np.memmap every batch to avoid a memory leak (nanoGPT): a long-lived map keeps every
    # page it ever touched accounted to the process.
    data = shards.memmap("train")
    sizes = np.array([len(d) - T for d in data], dtype=np.float64).clip(min=0)
    rng = np.random.default_rng([cfg.seed, step, rank, micro])
    which = rng.choice(len(data), size=B, p=sizes / sizes.sum())
    starts = [int(rng.integers(0, int(sizes[k]))) for k in which]
    x = np.stack([data[k][i : i + T] for k, i in zip(which, starts)]).astype(np.int64)
    y = np.stack([data[k][i + 1 : i + 1 + T] for k, i in zip(which, starts)]).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def val_batches(shards: TokenShards, cfg: TrainConfig, rank: int, world: int):
    """Fixed non-overlapping validation windows, a disjoint slice per rank (wrapping on a short shard)."""
    T, B = cfg.model.seq_len, cfg.micro_batch_size
    data = np.concatenate(shards.memmap("val"))
    n_win = (len(data) - 1) // T
    for b in range(cfg.eval_batches):
        idx = [((b * world + rank) * B + j) % n_win for j in range(B)]
        x = np.stack([data[i * T : i * T + T] for i in idx]).astype(np.int64)
        y = np.stack([data[i * T + 1 : i * T + T + 1] for i in idx]).astype(np.int64)
        yield torch.from_numpy(x), torch.from_numpy(y)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if DEVICE.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(DEVICE)
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and DEVICE.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], DEVICE)


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=DEVICE)  # NCCL reduces device tensors only
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _record(line: str) -> dict | None:
    """A metrics line, or None for a blank or torn one (a SIGKILL can cut the last write short)."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


class Metrics:
    """Rank 0's metrics.jsonl; on start it drops records past the resume step (they belong to a lost run)."""

    def __init__(self, path: Path, resume_step: int, enabled: bool):
        self.path, self.enabled = path, enabled
        self.truncate(resume_step)

    def truncate(self, step: int) -> None:
        """Drop records past `step` (a rollback discards that part of the trajectory)."""
        if self.enabled and self.path.exists():
            keep = [line for line in self.path.read_text().splitlines() if (rec := _record(line)) is not None
                    and rec.get("step", 0) <= step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="launch config written by lifecycle.tasks.train.launch.run_train")
    ap.add_argument("--local_rank", type=int, default=None, help="ignored (passed by some launchers)")
    args = ap.parse_args(argv)
    launch = json.loads(Path(args.config).read_text())
    cfg = TrainConfig.model_validate(launch["train"])
    shards = TokenShards.model_validate(launch["tokens"])
    run_dir = Path(launch["run_dir"])
    ckpt_root = run_dir / "checkpoints"

    import deepspeed

    stub_muon()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device, backend = select_device(cfg)
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.num_ranks:
        raise RuntimeError(f"launched with {world} ranks but num_ranks={cfg.num_ranks}")

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GPT(cfg.model)
    if launch.get("init_weights"):  # warm start; a resume below overwrites these with the checkpoint's
        from safetensors.torch import load_file

        model.load_export(load_file(launch["init_weights"]))
    model.to(device)
    model.activation_checkpointing = cfg.activation_checkpointing
    n_params = model.num_params()  # before ZeRO-3 partitions the parameters
    n_matmul, fpt = model.num_params(exclude_embeddings=True), model.flops_per_token()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cfg.lr_at(s) / cfg.lr)  # noqa: E731
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                                   config=ds_config(cfg))
    if rank == 0:
        atomic_write_json(run_dir / "ds_config.json", ds_config(cfg))
        print(f"{n_params:,} parameters, ranks ready after {time.time() - T_START:.1f}s", flush=True)

    peak = cfg.peak_flops_per_rank or measure_peak_flops(dtype=torch.bfloat16 if cfg.precision == "bf16" else torch.float32)
    saver = None
    if cfg.async_save:
        from lifecycle.tasks.train.async_ckpt import AsyncSaver

        saver = AsyncSaver(engine, ckpt_root, cfg.keep_last, log=lambda m: print(m, flush=True) if rank == 0 else None)

    def restore() -> tuple[int, float, list[int], Path | None]:
        """Load the newest committed checkpoint whose hashes verify (rank 0 picks, every rank loads)."""
        found = [ckpt.latest_valid(ckpt_root, max_step=cfg.max_steps) if rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return 0, 0.0, [], None
        _, state = engine.load_checkpoint(str(ckpt_root), tag=Path(found[0]).name)
        skipped_ = state["sampler"].get("skipped", [])
        expected = sampler_state(cfg, state["step"], world, skipped_)
        if state["sampler"] != expected or state["dataset_sha256"] != shards.dataset_sha256:
            raise RuntimeError(f"checkpoint {found[0]} was written for another sampler/dataset: {state['sampler']}")
        set_rng_state(state["rng"][rank])
        return state["step"], state["elapsed"], skipped_, Path(found[0])

    torch.manual_seed(cfg.seed + 1 + rank)  # per-rank stream for dropout
    step, elapsed, skipped, found = restore()
    if rank == 0 and found is not None:
        print(f"resumed from {found} at step {step}", flush=True)
    metrics = Metrics(run_dir / "metrics.jsonl", step, enabled=rank == 0)

    def batches(from_step: int) -> Prefetcher:
        keys = ((s, data_step(s, skipped), m) for s in range(from_step, cfg.max_steps) for m in range(cfg.grad_accum))
        return Prefetcher(lambda k: get_batch(shards, cfg, k[1], rank, k[2]), keys, cfg.prefetch)

    faults = injected_faults()
    engine.train()
    tokens_per_step = cfg.micro_batch_size * cfg.grad_accum * world * cfg.model.seq_len
    first, window_start, window_steps = step, time.perf_counter(), 0
    supervisor = int(os.environ.get("LIFECYCLE_SUPERVISOR_PID", "0"))
    loader = batches(step)
    recent: list[float] = []  # healthy losses for the spike test
    rollbacks = 0
    while step < cfg.max_steps:
        if supervisor and not pid_alive(supervisor):  # orphaned: a rerun may already own the run directory
            raise SystemExit(f"supervisor {supervisor} is gone; stopping at step {step} (last commit stands)")
        t0 = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        loss_sum = 0.0
        dstep = data_step(step, skipped)
        for micro in range(cfg.grad_accum):
            x, y = (t.to(device, non_blocking=True) for t in loader.get((step, dstep, micro)))
            _, loss = engine(x, y)
            if dstep in faults:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
            loss_sum += loss.item()
        mean_loss = mean_over_ranks(loss_sum / cfg.grad_accum)  # every step: the spike test needs it on all ranks
        bad = not math.isfinite(mean_loss) or (
            cfg.spike_factor is not None and len(recent) >= cfg.spike_window
            and mean_loss > cfg.spike_factor * sum(recent[-cfg.spike_window:]) / cfg.spike_window)
        if bad:
            rollbacks += 1
            if rollbacks > cfg.max_rollbacks:
                raise RuntimeError(f"loss {mean_loss} at step {step + 1}: more than max_rollbacks={cfg.max_rollbacks}")
            loader.close()
            if saver is not None:
                saver.finish()
            bad_step = step + 1
            throw = list(range(max(0, dstep - cfg.spike_skip + 1), dstep + 1))
            skipped_before = skipped
            step, elapsed, skipped, found = restore()
            if found is None:
                raise RuntimeError(f"loss {mean_loss} at step {bad_step} and no committed checkpoint to roll back to")
            skipped = sorted(set(skipped) | set(skipped_before) | set(throw))
            metrics.truncate(step)
            metrics.write({"kind": "rollback", "step": step, "bad_step": bad_step,
                           "bad_loss": mean_loss if math.isfinite(mean_loss) else None,
                           "reason": "nan" if not math.isfinite(mean_loss) else "spike",
                           "skipped_data_steps": throw, "checkpoint": str(found)})
            recent, loader = [], batches(step)
            window_start, window_steps = time.perf_counter(), 0
            continue
        recent = (recent + [mean_loss])[-cfg.spike_window:]
        step += 1
        elapsed += time.perf_counter() - t0
        window_steps += 1
        if saver is not None:
            saver.poll()
        last = step == cfg.max_steps
        commit = step % cfg.checkpoint_every == 0 or last
        if step % cfg.log_every == 0 or step == first + 1 or commit:  # same decision on every rank
            now = time.perf_counter()
            window = now - window_start
            wait = mean_over_ranks(loader.take_wait())
            step_time = window / window_steps
            metrics.write({"kind": "train", "step": step, "loss": mean_loss, "lr": lr, "tokens": step * tokens_per_step,
                           "elapsed": round(elapsed, 3), "step_time": step_time,
                           "data_wait": wait / window_steps, "stall_frac": wait / window,
                           "tokens_per_s": tokens_per_step / step_time,
                           "mfu": fpt * tokens_per_step / step_time / (peak * world),
                           "params": n_matmul, "flops_per_token": fpt})
            window_start, window_steps = now, 0
        if cfg.eval_every and (step % cfg.eval_every == 0 or last):
            metrics.write({"kind": "eval", "step": step, "val_loss": evaluate(engine, shards, cfg, rank, world)})
            window_start = time.perf_counter()
            loader.take_wait()
        if commit:
            client_state = {"step": step, "elapsed": elapsed, "sampler": sampler_state(cfg, step, world, skipped),
                            "rng": gather_rng(world), "config": launch["train"],
                            "dataset_sha256": shards.dataset_sha256, "tokenizer_sha256": shards.tokenizer_sha256}
            marker = {"loss": mean_loss, "tokens": step * tokens_per_step, "world_size": world,
                      "zero_stage": cfg.zero_stage, "precision": cfg.precision, "fingerprint": launch["fingerprint"],
                      "dataset_sha256": shards.dataset_sha256, "tokenizer_sha256": shards.tokenizer_sha256}
            t_save = time.perf_counter()
            if saver is not None:
                saver.start(step, client_state, cfg.model, marker)
                if last:
                    saver.finish()
            else:
                tag_dir = ckpt.save(engine, ckpt_root, step, client_state, cfg.model, marker)
                if rank == 0:
                    for gone in ckpt.prune(ckpt_root, cfg.keep_last, keep=(tag_dir,)):
                        print(f"pruned {gone}", flush=True)
                    print(f"committed {tag_dir}", flush=True)
            if rank == 0:
                print(f"save stall {time.perf_counter() - t_save:.3f}s at step {step}", flush=True)
            window_start = time.perf_counter()
            loader.take_wait()
    loader.close()
    if saver is not None:
        saver.finish()
        saver.close()
    dist.barrier()
    dist.destroy_process_group()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def gather_rng(world: int) -> list[dict]:
    states: list = [None] * world
    dist.all_gather_object(states, rng_state())
    return states


@torch.no_grad()
def evaluate(engine, shards: TokenShards, cfg: TrainConfig, rank: int, world: int) -> float:
    engine.eval()
    losses = [engine(x.to(DEVICE), y.to(DEVICE))[1].item() for x, y in val_batches(shards, cfg, rank, world)]
    engine.train()
    return mean_over_ranks(sum(losses) / len(losses))


if __name__ == "__main__":
    main()
