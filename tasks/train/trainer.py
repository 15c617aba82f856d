"""One DeepSpeed rank: `python -m lifecycle.tasks.train.trainer --config <run_dir>/config.json`, with the rank
environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) of DeepSpeed's launcher.

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

if __name__ == "__main__":  # a rank: die with the process that started it and with the run, before the slow imports
    from lifecycle.core.procs import die_with_parent, watch_parent_run
    from lifecycle.tasks.train.supervise import rank_alive_beat

    die_with_parent()
    watch_parent_run()
    rank_alive_beat(sys.argv)  # the supervisor's start-up watchdog sees this rank alive until its first step

import numpy as np
import torch
import torch.distributed as dist

from lifecycle.core.fs import atomic_write_json
from lifecycle.tasks.train.checkpoint import read_marker
from lifecycle.tasks.train.checkpointer import SaveSchedule, make_checkpointer
from lifecycle.tasks.train.hardware import datasheet_peak, mfu_basis
from lifecycle.tasks.train.layout import describe, layout_of
from lifecycle.tasks.train.loader import Prefetcher
from lifecycle.tasks.train.sampler import data_step, first_sequence, windows
from lifecycle.tasks.train.model import GPT
from lifecycle.tasks.train.parallel import moe
from lifecycle.tasks.train.parallel.mesh import Grid, Mesh
from lifecycle.tasks.data.tokenize.stage import TokenShards
from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.supervise import STANDBY_ENV, WORLD_ENV, ready_path, write_heartbeat

# This rank's launch timeline, (phase, time it ended), written after the first step to
# <run_dir>/launch-timing-rank<r>.json (bench/launch_overhead.py reads it).
LAUNCH = [("interpreter ready", T_START), ("imports", time.time())]
OP_LOAD: list[float] = []  # start and end of loading DeepSpeed's CPU shm op (inside the process group init)


# The first save's arena is made before training only when it takes at most this share of the host's available
# memory (else the first save makes it, as it would without a prewarm): a 300M-parameter relaunch on a 23 GB host
# was OOM-killed with its restored tier, its engine and a prewarmed 6.1 GB arena. A standby world
# (train.launch.spares) asks for less: the training world's engine, arenas and tier are beside it.
ARENA_SHARE, STANDBY_ARENA_SHARE = 0.5, 0.25


def phase(name: str) -> None:
    LAUNCH.append((name, time.time()))


def ds_config(cfg: TrainConfig) -> dict:
    """DeepSpeed config. The optimizer (torch AdamW) and the LambdaLR schedule are built in `Trainer`."""
    return {
        "train_batch_size": cfg.global_batch,
        "train_micro_batch_size_per_gpu": cfg.batch.micro_batch_size,
        "gradient_accumulation_steps": cfg.batch.grad_accum,
        "gradient_clipping": cfg.optimizer.grad_clip,
        "zero_optimization": {"stage": cfg.engine.zero_stage},
        "bf16": {"enabled": cfg.engine.precision == "bf16"},
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


def keep_mlflow_out() -> None:
    """DeepSpeed 0.19's `import deepspeed` reaches its autotuner, which imports MLflow when it is installed
    (`try: import mlflow` in deepspeed/autotuning/autotuner.py), and MLflow brings pandas and its GenAI modules:
    most of `import deepspeed` in each rank (bench/launch_overhead.py). A rank never autotunes and never logs to
    MLflow (the supervisor forwards metrics.jsonl), so make that import fail: with `sys.modules["mlflow"] = None`
    it raises ImportError, which DeepSpeed catches (`has_mlflow = False`). Left alone where MLflow is loaded."""
    sys.modules.setdefault("mlflow", None)


LAYOUT_SAMPLER_FIELDS = ("world_size", "micro_batch_size", "grad_accum")
"""The sampler-state fields that are layout: a resume under another layout (same global batch) may differ in them."""


def sampler_state(cfg: TrainConfig, next_step: int, world: int, skipped: list[int] = ()) -> dict:
    """`skipped`: data steps thrown away by loss-spike rollbacks; step s reads data step
    `loader.data_step(s, skipped)`."""
    return {"kind": "uniform_windows", "next_step": next_step, "seed": cfg.seed, "world_size": world,
            "micro_batch_size": cfg.batch.micro_batch_size, "grad_accum": cfg.batch.grad_accum,
            "seq_len": cfg.model.seq_len,
            "skipped": sorted(skipped)}


def select_device(cfg: TrainConfig) -> tuple[torch.device, str]:
    """(device, process-group backend) for `train.engine.accelerator`: the CPU with gloo, or this rank's GPU
    (LOCAL_RANK, set by the launcher) with NCCL."""
    if cfg.engine.accelerator == "cpu":
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        raise RuntimeError("train.engine.accelerator=cuda, but torch sees no CUDA device on this host "
                           f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use accelerator: cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    # fp32 matmuls and convolutions on the Tensor Cores (TF32), as nanoGPT and torchtitan train; the MFU of an
    # fp32 run is then counted against the TF32 peak (lifecycle.tasks.train.hardware)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return device, "nccl"


def measure_peak_flops(device: torch.device, seconds: float = 0.3, n: int = 512,
                       dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n×n matmul in `dtype` on `device` (on the CPU, this process's threads): the MFU
    denominator when none is configured."""
    if device.type == "cuda":
        n = max(n, 4096)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
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


def profile_step() -> int | None:
    """The step to profile with torch.profiler (benchmarks only): LIFECYCLE_PROFILE_STEP=25 writes
    <run_dir>/profile-step25.json (rank 0: its top kernels, the step's wall time and the time outside kernels)."""
    raw = os.environ.get("LIFECYCLE_PROFILE_STEP", "")
    return int(raw) if raw.strip() else None


def kernel_summary(prof, wall_s: float, top: int = 15) -> dict:
    """Top device kernels of a profiled step by total time, and the share of the step no kernel ran in."""
    events = [e for e in prof.key_averages() if getattr(e, "device_type", None) is not None
              and str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
    total_us = sum(e.self_device_time_total for e in events)
    rows = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    return {"wall_s": wall_s, "kernel_s": total_us / 1e6, "outside_kernels_frac": max(0.0, 1 - total_us / 1e6 / wall_s),
            "top": [{"name": e.key[:120], "calls": e.count, "ms": e.self_device_time_total / 1e3,
                     "share": e.self_device_time_total / max(total_us, 1)} for e in rows]}


def get_batch(shards: TokenShards, cfg: TrainConfig, step: int, dp_rank: int, micro: int, pin: bool = False):
    """(x, y) int64 tensors (B, T) of random windows: the micro-batch `micro` of data-parallel rank `dp_rank`
    (lifecycle.tasks.train.sampler: sequence j of a step's global batch is a pure function of (seed, step, j), so
    every layout with the same global batch trains on the same sequences)."""
    T, B = cfg.model.seq_len, cfg.batch.micro_batch_size
    # We recreate np.memmap every batch to avoid a memory leak (nanoGPT): a long-lived map keeps every
    # page it ever touched accounted to the process.
    data = shards.memmap("train")
    first = first_sequence(dp_rank, micro, cfg.batch.grad_accum, B)
    wins = windows([len(d) for d in data], T, cfg.seed, step, first, B)
    x = np.stack([data[k][i : i + T] for k, i in wins]).astype(np.int64)
    y = np.stack([data[k][i + 1 : i + 1 + T] for k, i in wins]).astype(np.int64)
    if pin:  # page-locked, so the step's copy to the GPU is asynchronous (the prefetch thread pays for the pinning)
        return torch.from_numpy(x).pin_memory(), torch.from_numpy(y).pin_memory()
    return torch.from_numpy(x), torch.from_numpy(y)


def val_batches(shards: TokenShards, cfg: TrainConfig, rank: int, world: int):
    """Fixed non-overlapping validation windows, a disjoint slice per data-parallel rank (`rank` of `world`
    data-parallel ranks; wrapping on a short shard)."""
    T, B = cfg.model.seq_len, cfg.batch.micro_batch_size
    data = np.concatenate(shards.memmap("val"))
    n_win = (len(data) - 1) // T
    for b in range(cfg.logging.eval_batches):
        idx = [((b * world + rank) * B + j) % n_win for j in range(B)]
        x = np.stack([data[i * T : i * T + T] for i in idx]).astype(np.int64)
        y = np.stack([data[i * T + 1 : i * T + T + 1] for i in idx]).astype(np.int64)
        yield torch.from_numpy(x), torch.from_numpy(y)


def rng_state(device: torch.device) -> dict:
    """This process's Python, NumPy and torch RNG states (and `device`'s, on a GPU): DeepSpeed saves none."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_rng(world: int, device: torch.device) -> list[dict]:
    """Every rank's `rng_state`, in rank order (collective)."""
    states: list = [None] * world
    dist.all_gather_object(states, rng_state(device))
    return states


def mean_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


class DeviceValue:
    """A scalar the device is still computing, read without stalling the device: on a GPU the value is copied
    to page-locked host memory behind the work that produces it, and `get()` waits for that copy only, not
    for the kernels queued after it (a plain `.item()` waits for everything queued on the stream). So the
    training thread can queue step s+1 before it looks at step s's loss."""

    def __init__(self, t: torch.Tensor):
        self.t, self.event = t, None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def get(self) -> float:
        if self.event is None:
            return self.t.item()
        self.event.synchronize()
        return self.host.item()


def mean_over_ranks_async(t: torch.Tensor) -> DeviceValue:
    """The mean of a float64 scalar tensor over every rank, queued (no host synchronisation)."""
    t = t.reshape(1)
    dist.all_reduce(t)
    return DeviceValue(t / dist.get_world_size())


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


class Trainer:
    """One rank's training run, torchtitan-style: the engine, data, checkpointer and metrics are attributes, and
    each phase of a step is a short method. `Trainer(launch)` builds everything and restores the newest
    committed checkpoint; `train_step()` runs one optimizer step and whatever is due after it (log, eval,
    save), or rolls back on a bad loss; `close()` commits the last save. Every rank calls the same methods
    at the same steps (they are collective)."""

    def __init__(self, launch: dict):
        self.launch = launch
        self.cfg = cfg = TrainConfig.model_validate(launch["train"])
        self.shards = TokenShards.model_validate(launch["tokens"])
        self.run_dir = Path(launch["run_dir"])
        self.world_name = os.environ.get(WORLD_ENV, "")  # "" for a launch's first world, "spare<k>" for a standby
        self.world_suffix = f"-{self.world_name}" if self.world_name else ""  # of the files each world writes apart
        go = os.environ.get(STANDBY_ENV)  # a standby world's go file (train.launch.spares): wait for it to train
        self.standby = Path(go) if go else None
        self.device, backend = self._init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != cfg.batch.num_ranks:
            raise RuntimeError(f"launched with {self.world} ranks but train.batch.num_ranks={cfg.batch.num_ranks}")
        self.grid = Grid.of(cfg)
        self.dp_rank = self.grid.coords(self.rank)["dp"]  # the data shard: shared by a tp/sp/pp group
        # DeepSpeed's mpu for tp/sp; a pipeline engine builds its own groups (it refuses an mpu)
        self.mesh = Mesh(self.grid, self.rank) if cfg.parallel.tp * cfg.parallel.sp > 1 else None
        self.sp = None
        if cfg.parallel.sp > 1:
            from lifecycle.tasks.train.parallel.sp import SequenceParallel

            self.sp = SequenceParallel(self.mesh)
        self.engine, self.scheduler = self._build_engine()
        phase("engine build")
        dtype = torch.bfloat16 if cfg.engine.precision == "bf16" else torch.float32
        # probed at every launch, under the load the run itself meets: a value cached from a busier moment made MFU > 1;
        # not at all when the peak is configured (the probe is 0.3 s of every launch)
        self.measured_peak = None if cfg.logging.peak_flops_per_rank else measure_peak_flops(self.device, dtype=dtype)
        self.peak, source = self.mfu_peak()
        self.say(mfu_basis(self.flops_per_token, self.n_matmul, cfg.model.n_layer, cfg.model.n_embd,
                           cfg.model.seq_len, self.peak, source))
        phase("peak FLOPS probe")
        self.checkpointer = make_checkpointer(cfg.checkpoint, self.engine, self.run_dir / "checkpoints", log=self.say,
                                              tier=launch.get("memory_tier"))
        sizing = self.run_dir / f".checkpoint-sizing{self.world_suffix}"
        if self.standby is not None:  # everything but the restore is done before the promotion
            # the arena too, unless it would crowd the training world's host (then the first save makes it)
            self.wait_for_promotion(self.checkpointer.prewarm(sizing, memory_share=STANDBY_ARENA_SHARE) or "")
        torch.manual_seed(cfg.seed + 1 + self.rank)  # per-rank stream for dropout
        self.step, self.elapsed, self.skipped = 0, 0.0, []
        self.layout_change: dict | None = None
        if (found := self.restore()) is not None:
            self.say(f"resumed from {found} at step {self.step}")
        self.metrics = Metrics(self.run_dir / "metrics.jsonl", self.step, enabled=self.rank == 0)
        if found is not None:  # which tier the restore read, and why not memory (tests and benches read it)
            info = self.checkpointer.last_restore
            self.say(f"restored step {self.step} from {info['tier']} in {info['seconds']:.3f}s"
                     + (f" (memory tier not used: {info['reason']})" if info["reason"] else ""))
            self.metrics.write({"kind": "restore", "step": self.step, **info})
            if self.layout_change:
                self.metrics.write(self.layout_change)
        if self.world_name and not self.checkpointer.prewarmed:  # a standby world's rank, promoted by now
            # a takeover resumes training first: faulting a 350M arena in here is seconds of page faults
            self.say("checkpoint arena left to the first save: a promoted standby resumes training first")
        elif not self.checkpointer.prewarmed and self.step < cfg.max_steps and \
                (line := self.checkpointer.prewarm(sizing, memory_share=ARENA_SHARE)):
            self.say(line)
        self.schedule = SaveSchedule(cfg.checkpoint, self.step)
        self.faults = injected_faults()
        self.profile_at = profile_step()
        self.engine.train()
        self.tokens_per_step = cfg.global_batch * cfg.model.seq_len
        self.first = self.step  # the first step of this launch is always logged
        self.window_start, self.window_steps = time.perf_counter(), 0  # the steps the next train record averages
        phase("checkpointer and restore")
        self.loader = self.batches()
        self.recent: list[float] = []  # healthy losses for the spike test
        self.unchecked: tuple[int, int, DeviceValue] | None = None  # (step, data step, loss) not yet checked
        self.rollbacks = 0
        self.beat()
        phase("data loader start")

    def mfu_peak(self) -> tuple[float, str]:
        """(peak FLOP/s per rank, where it comes from): `logging.peak_flops_per_rank`, else the GPU's datasheet
        peak for the precision (lifecycle.tasks.train.hardware), else the matmul this rank measured."""
        if self.cfg.logging.peak_flops_per_rank:
            return self.cfg.logging.peak_flops_per_rank, "peak set in train.logging.peak_flops_per_rank"
        if self.device.type == "cuda" and (found := datasheet_peak(torch.cuda.get_device_name(self.device),
                                                                   self.cfg.engine.precision)):
            return found
        return self.measured_peak, (f"peak of a {self.cfg.engine.precision} matmul measured on this rank at start-up "
                                    f"(no datasheet peak for {self.device.type} devices of this name)")

    def beat(self, step_time: float | None = None) -> None:
        """This rank's heartbeat for the supervisor's stall watchdog (lifecycle.tasks.train.supervise.Heartbeats)."""
        write_heartbeat(self.run_dir, self.rank, self.step, step_time, world=self.world_name)

    def say(self, message: str) -> None:
        """A line in train.log, from rank 0 only (a standby world's marked with its name until it is promoted)."""
        if self.rank == 0:
            print(f"[{self.world_name} standby] {message}" if self.standby else message, flush=True)

    def wait_for_promotion(self, prewarmed: str, poll_s: float = 0.005) -> None:
        """A standby world's rank (train.launch.spares), built and ready: say so in `rank<r>.ready` and wait for
        the supervisor's go file. It is written when the training world fails; the ranks then restore its newest
        commit and train on. Polled (a stat every 5 ms costs nothing next to a step); the liveness beat goes on
        meanwhile, so the supervisor still sees a stopped or dead standby rank."""
        if prewarmed:
            self.say(prewarmed)
        self.say(f"ready after {time.time() - T_START:.1f}s; waiting to take over ({self.standby})")
        atomic_write_json(ready_path(self.run_dir, self.rank, self.world_name),
                          {"time": time.time(), "pid": os.getpid()})
        while not self.standby.exists():
            time.sleep(poll_s)
        self.standby = None
        self.say(f"promoted: standby world {self.world_name} takes over, {time.time() - T_START:.1f}s after it started")
        phase("promoted")

    # ----------------------------------------------------------------------------------------------
    # set-up

    def _init_distributed(self) -> tuple[torch.device, str]:
        import importlib

        keep_mlflow_out()
        import deepspeed

        ds_comm = importlib.import_module("deepspeed.comm.torch")  # `import a.b.torch as x` gives torch itself here
        phase("import deepspeed")
        build = ds_comm.build_shm_op

        def timed_build():  # DeepSpeed loads its CPU comm op while it creates the process group: time it apart
            OP_LOAD.append(time.time())
            op = build()
            OP_LOAD.append(time.time())
            return op

        ds_comm.build_shm_op = timed_build
        stub_muon()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        device, backend = select_device(self.cfg)
        deepspeed.init_distributed(dist_backend=backend)
        phase("process group init")
        return device, backend

    def _build_engine(self):
        """The model (same initial weights on every rank), AdamW with the warmup-cosine schedule, and the
        DeepSpeed engine over them. Rank 0 writes the DeepSpeed config it used beside the run."""
        import deepspeed

        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        base = self.launch.get("base_model")
        self.model_cfg = cfg.model_arch  # train.model, plus the experts of train.moe
        if base and cfg.engine.zero_stage == 3:  # each rank holds only its partition of the base model's weights
            with deepspeed.zero.Init(config_dict_or_path=ds_config(cfg)):
                model = GPT(cfg.model)
        else:
            model = GPT(self.model_cfg)
        if base:  # continue a Hugging Face checkpoint (a resume overwrites these with the checkpoint's)
            from lifecycle.tasks.train import hf_import

            hf_import.load_weights(model, base, gathered=cfg.engine.zero_stage == 3, rank=self.rank)
            self.say(f"loaded the weights of {base}")
        if self.launch.get("init_weights"):  # warm start; a resume overwrites these with the checkpoint's
            from safetensors.torch import load_file

            model.load_export(load_file(self.launch["init_weights"]))
        if self.sp is not None:
            self.sp.wrap(model)
        model.to(self.device)
        model.activation_checkpointing = cfg.engine.activation_checkpointing
        n_params = model.num_params()  # before ZeRO-3 partitions the parameters
        self.n_matmul, self.flops_per_token = model.num_params(exclude_embeddings=True), model.flops_per_token()
        if cfg.parallel.pp > 1:  # this rank's pipeline stage of the model (lifecycle.tasks.train.parallel.pp)
            from lifecycle.tasks.train.parallel import pp

            model = pp.pipeline_module(model, cfg.parallel.pp, cfg.dp, cfg.engine.activation_checkpointing)
        if cfg.parallel.tp > 1:  # slice the dense initial weights: the same start as a single-rank run
            from lifecycle.tasks.train.parallel.tp import TPGroup, shard_model

            model = shard_model(model, TPGroup.of(self.mesh))
        if cfg.moe.num_experts:  # this rank's experts in DeepSpeed MoE layers (expert-parallel groups made here)
            moe.install(model, cfg)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = cfg.optimizer
        groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # on a GPU, the fused AdamW kernel (one launch for every tensor) as DeepSpeed's client optimizer
        fused = {"fused": True} if self.device.type == "cuda" else {}
        optimizer = torch.optim.AdamW(moe.param_groups(groups) if cfg.moe.num_experts else groups, lr=opt.lr,
                                      betas=opt.betas, **fused)
        schedule = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: cfg.lr_at(s) / opt.lr)  # noqa: E731
        engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                                       config=ds_config(cfg), mpu=self.mesh)
        if self.rank == 0:
            atomic_write_json(self.run_dir / "ds_config.json", ds_config(cfg))
        if cfg.engine.compiled and cfg.parallel.pp == 1:  # compiled lazily, at the first forward
            from deepspeed.accelerator import get_accelerator

            backend = get_accelerator().get_compile_backend()
            engine.compile(backend=backend)
            self.say(f"model compiled with torch.compile (backend {backend}; kernels built at the first step)")
        self.say(f"{n_params:,} parameters, ranks ready after {time.time() - T_START:.1f}s")
        return engine, scheduler

    def batches(self) -> Prefetcher:
        """This rank's micro-batches from the current step to max_steps, prepared ahead by a thread."""
        cfg = self.cfg
        keys = ((s, data_step(s, self.skipped), m) for s in range(self.step, cfg.max_steps)
                for m in range(cfg.batch.grad_accum))
        pin = self.device.type == "cuda"
        return Prefetcher(lambda k: get_batch(self.shards, cfg, k[1], self.dp_rank, k[2], pin), keys,
                          cfg.launch.prefetch)

    # ----------------------------------------------------------------------------------------------
    # the step

    def train_step(self) -> None:
        """One optimizer step, then what is due after it: a train record, an eval, a checkpoint. A non-finite or
        spiking loss rolls back to the last commit instead.

        The loss is checked one step late, except on a step that logs, evaluates or saves: step s+1 is queued on
        the device before the host waits for step s's loss, so the device never idles while the host prepares a
        step (no host synchronisation per step). A bad loss found late rolls back the same way: to the last
        commit, which is never later than the bad step (a save checks its own step's loss first), with the bad
        step's data skipped; the step queued after it is thrown away with everything else past the commit."""
        if self.step + 1 == self.profile_at and self.device.type == "cuda":
            return self.profiled_step()
        t0 = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        dstep = data_step(self.step, self.skipped)
        self.aux_sum = 0.0
        if self.cfg.moe.num_experts:  # the route counts of this step only
            moe.take_counts(self.engine.module)
        pending = self.forward_backward(dstep)
        earlier, self.unchecked = self.unchecked, (self.step + 1, dstep, pending)
        if earlier is not None and self.check(*earlier) is None:
            return
        self.step += 1
        if self.step == self.first + 1:
            phase("first step")
            import psutil

            atomic_write_json(self.run_dir / f"launch-timing-rank{self.rank}{self.world_suffix}.json", {
                "process_created": psutil.Process().create_time(), "phases": LAUNCH, "op_load": OP_LOAD})
        self.elapsed += time.perf_counter() - t0
        if self.step > self.first + 1:  # the launch's first step warms up
            self.schedule.step_time(time.perf_counter() - t0)
        self.window_steps += 1
        self.checkpointer.poll()
        last = self.step == self.cfg.max_steps
        commit = self.schedule.due(self.step) or last
        logs = self.step % self.cfg.logging.every == 0 or self.step == self.first + 1 or commit  # same on every rank
        evals = self.cfg.logging.eval_every and (self.step % self.cfg.logging.eval_every == 0 or last)
        if logs or evals:
            if (loss := self.check(*self.unchecked)) is None:
                return
            if logs:
                self.log(loss, lr)
            if evals:
                self.eval()
            if commit:
                self.save(loss, last)
        self.beat(time.perf_counter() - t0)

    def profiled_step(self) -> None:
        """`train_step` under torch.profiler, between two device synchronisations (LIFECYCLE_PROFILE_STEP)."""
        from torch.profiler import ProfilerActivity, profile

        self.profile_at = None
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            self.train_step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        if self.rank == 0:
            try:
                summary = kernel_summary(prof, wall)
            except Exception as e:  # noqa: BLE001 - a benchmark's extra: never the run's failure
                summary = {"wall_s": wall, "error": f"{type(e).__name__}: {e}"}
            atomic_write_json(self.run_dir / f"profile-step{self.step}.json", summary)
        self.window_start, self.window_steps = time.perf_counter(), 0  # the profiler's cost stays out of the records

    def check(self, step: int, dstep: int, pending: DeviceValue) -> float | None:
        """Wait for step `step`'s loss; a healthy one joins the spike window and is returned. A bad one rolls
        back (None)."""
        loss = pending.get()
        if self.unchecked is not None and self.unchecked[0] == step:
            self.unchecked = None  # checked now
        if self.is_bad(loss):
            self.unchecked = None  # a step queued after the bad one goes with everything past the commit
            self.rollback(loss, dstep, step)
            self.beat()
            return None
        self.recent = (self.recent + [loss])[-self.cfg.guard.spike_window:]
        return loss

    def forward_backward(self, dstep: int) -> DeviceValue:
        """grad_accum micro-batches through the engine (it steps the optimizer on the last); returns the
        rank-averaged loss, every step (the spike test needs it on all ranks), still on its way from the device."""
        if self.cfg.parallel.pp > 1:  # the pipeline schedule takes the step's micro-batches at once
            from lifecycle.tasks.train.parallel import pp

            batches = [self.loader.get((self.step, dstep, m)) for m in range(self.cfg.batch.grad_accum)]
            if self.step == self.first:
                phase("first batch")
            loss = pp.forward_backward(self.engine, batches, poison=dstep in self.faults)
            return DeviceValue(torch.tensor(loss, dtype=torch.float64))
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for micro in range(self.cfg.batch.grad_accum):
            x, y = self.loader.get((self.step, dstep, micro))
            if self.sp is not None:  # this rank's slice of every sequence
                x, y = self.sp.shard(x, y)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            if self.step == self.first and micro == 0:
                phase("first batch")
            _, loss = self.engine(x, y)
            if self.sp is not None:  # the full-sequence mean: the sp group's mean of the slice means
                loss = self.sp.loss(loss)
            if dstep in self.faults:
                loss = loss * float("nan")
            if (aux := moe.aux_loss(self.engine.module)) is not None:  # load balancing, beside the logged LM loss
                self.aux_sum += aux.item()
                self.engine.backward(loss + self.cfg.moe.aux_loss_weight * aux)
            else:
                self.engine.backward(loss)
            self.engine.step()
            loss_sum += loss.detach().double()  # the float64 sum of the fp32 losses, in order, as .item() gave it
        return mean_over_ranks_async(loss_sum / self.cfg.batch.grad_accum)

    def is_bad(self, loss: float) -> bool:
        """Non-finite, or more than spike_factor times the mean of the last spike_window healthy losses."""
        g = self.cfg.guard
        return not math.isfinite(loss) or (
            g.spike_factor is not None and len(self.recent) >= g.spike_window
            and loss > g.spike_factor * sum(self.recent[-g.spike_window:]) / g.spike_window)

    # ----------------------------------------------------------------------------------------------
    # what a step may trigger

    def log(self, loss: float, lr: float) -> None:
        """A train record over the steps since the last one: loss, lr, throughput, MFU, data stall."""
        now = time.perf_counter()
        window = now - self.window_start
        wait = mean_over_ranks(self.loader.take_wait(), self.device)
        step_time = window / self.window_steps
        achieved = self.flops_per_token * self.tokens_per_step / step_time / self.world  # FLOP/s per rank
        extra = moe.step_record(self.engine.module, self.aux_sum, self.cfg.batch.grad_accum, self.device) \
            if self.cfg.moe.num_experts else {}  # collective
        self.metrics.write({"kind": "train", "step": self.step, "loss": loss, "lr": lr,
                            "tokens": self.step * self.tokens_per_step, "elapsed": round(self.elapsed, 3),
                            "step_time": step_time, "data_wait": wait / self.window_steps, "stall_frac": wait / window,
                            "tokens_per_s": self.tokens_per_step / step_time,
                            "mfu": achieved / self.peak,
                            **({"mfu_measured": achieved / self.measured_peak} if self.measured_peak else {}),
                            "params": self.n_matmul, "flops_per_token": self.flops_per_token, **extra})
        self.window_start, self.window_steps = now, 0

    @torch.no_grad()
    def eval(self) -> None:
        """Validation loss over eval_batches fixed windows per rank; its time is left out of the next record."""
        self.engine.eval()
        shard = self.sp.shard if self.sp is not None else (lambda x, y: (x, y))
        if self.cfg.parallel.pp > 1:
            from lifecycle.tasks.train.parallel.pp import eval_loss
        else:
            eval_loss = lambda e, x, y: e(x.to(self.device), y.to(self.device))[1].item()  # noqa: E731
        losses = [eval_loss(self.engine, x, y)  # averaged over every rank below
                  for x, y in (shard(*b) for b in val_batches(self.shards, self.cfg, self.dp_rank, self.grid.dp))]
        self.engine.train()
        val_loss = mean_over_ranks(sum(losses) / len(losses), self.device)
        self.metrics.write({"kind": "eval", "step": self.step, "val_loss": val_loss})
        self.window_start = time.perf_counter()
        self.loader.take_wait()

    def save(self, loss: float, last: bool) -> None:
        """Checkpoint this step: RNG states and sampler position in client_state, run facts in the marker."""
        cfg, shards = self.cfg, self.shards
        client_state = {"step": self.step, "elapsed": self.elapsed,
                        "sampler": sampler_state(cfg, self.step, self.world, self.skipped),
                        "rng": gather_rng(self.world, self.device), "config": self.launch["train"],
                        "dataset_sha256": shards.dataset_sha256, "tokenizer_sha256": shards.tokenizer_sha256}
        marker = {"loss": loss, "tokens": self.step * self.tokens_per_step, "world_size": self.world,
                  "zero_stage": cfg.engine.zero_stage, "precision": cfg.engine.precision,
                  "layout": layout_of(cfg), "format": "deepspeed",
                  "fingerprint": self.launch["fingerprint"],
                  "dataset_sha256": shards.dataset_sha256, "tokenizer_sha256": shards.tokenizer_sha256}
        t_save = time.perf_counter()
        self.checkpointer.save(self.step, client_state, self.model_cfg, marker, wait=last)
        stall = time.perf_counter() - t_save
        self.say(f"save stall {stall:.3f}s at step {self.step}")
        if self.schedule.auto and not last:
            self.choose_interval(stall)
        self.window_start = time.perf_counter()
        self.loader.take_wait()

    def choose_interval(self, stall: float) -> None:
        """`checkpoint.every: auto`: the next interval from the slowest rank's stall and median step time."""
        worst = torch.tensor([stall, self.schedule.median_step()], dtype=torch.float64, device=self.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank then picks the same next save
        stall, step_time = worst.tolist()
        interval = self.schedule.observe(self.step, stall, step_time)
        share = self.cfg.checkpoint.auto_overhead
        self.say(f"checkpoint interval (auto): {interval} steps (save stall {stall:.3f}s, median step "
                 f"{step_time:.3f}s, overhead {share:.1%})")
        self.metrics.write({"kind": "checkpoint_interval", "step": self.step, "interval": interval,
                            "stall": stall, "step_time": step_time, "overhead": share})

    def restore(self) -> Path | None:
        """Load the newest committed checkpoint whose hashes verify into the engine, this rank's RNG states and
        the sampler position; returns its tag directory (None: nothing committed, start at step 0)."""
        got = self.checkpointer.restore(max_step=self.cfg.max_steps)
        if got is None:
            self.step, self.elapsed, self.skipped = 0, 0.0, []
            return None
        tag_dir, state = got
        skipped = state["sampler"].get("skipped", [])
        expected = sampler_state(self.cfg, state["step"], self.world, skipped)
        saved_cfg = TrainConfig.model_validate(state["config"])
        marker = read_marker(tag_dir)
        changed = (saved := marker.get("layout", layout_of(saved_cfg))) != layout_of(self.cfg)
        if changed:  # the sampler's layout fields are the saved layout's; the sequences of a step are not
            expected.update({k: state["sampler"].get(k) for k in LAYOUT_SAMPLER_FIELDS})
        if state["sampler"] != expected or state["dataset_sha256"] != self.shards.dataset_sha256:
            raise RuntimeError(f"checkpoint {tag_dir} was written for another sampler/dataset: {state['sampler']}")
        if saved_cfg.global_batch != self.cfg.global_batch:
            raise RuntimeError(f"checkpoint {tag_dir} was written with a global batch of {saved_cfg.global_batch} "
                               f"sequences ({describe(saved)}); this run's is {self.cfg.global_batch} "
                               f"({describe(layout_of(self.cfg))})")
        if changed:
            # get_batch is keyed on (seed, step, sequence index in the global batch): the same global batch
            # draws the same sequences under any layout. RNG states: rank r takes old rank r's (dropout masks
            # are per rank, so a run with dropout follows another trajectory after a layout change; without
            # dropout nothing draws from them); a rank the old layout did not have keeps its seeded stream.
            self.say(f"layout change at step {state['step']}: {describe(saved)} -> {describe(layout_of(self.cfg))}"
                     f" ({marker.get('converter', 'native')} checkpoint {tag_dir})")
            self.layout_change = {"kind": "layout_change", "step": state["step"], "from": describe(saved),
                                  "to": describe(layout_of(self.cfg)), "checkpoint": str(tag_dir)}
        if self.rank < len(state["rng"]):
            set_rng_state(state["rng"][self.rank], self.device)
        self.step, self.elapsed, self.skipped = state["step"], state["elapsed"], skipped
        return tag_dir

    def rollback(self, loss: float, dstep: int, bad_step: int) -> None:
        """Back to the last commit, with the bad step's data (and spike_skip - 1 data steps before it) skipped
        from now on; the metrics past that commit are dropped and a rollback record says why."""
        g = self.cfg.guard
        self.rollbacks += 1
        if self.rollbacks > g.max_rollbacks:
            raise RuntimeError(f"loss {loss} at step {self.step + 1}: more than max_rollbacks={g.max_rollbacks}")
        self.loader.close()
        skipped_before = self.skipped
        throw = list(range(max(0, dstep - g.spike_skip + 1), dstep + 1))
        found = self.restore()
        if found is None:
            raise RuntimeError(f"loss {loss} at step {bad_step} and no committed checkpoint to roll back to")
        self.skipped = sorted(set(self.skipped) | set(skipped_before) | set(throw))
        self.metrics.truncate(self.step)
        self.metrics.write({"kind": "rollback", "step": self.step, "bad_step": bad_step,
                            "bad_loss": loss if math.isfinite(loss) else None,
                            "reason": "nan" if not math.isfinite(loss) else "spike",
                            "skipped_data_steps": throw, "checkpoint": str(found)})
        self.recent, self.loader = [], self.batches()
        self.window_start, self.window_steps = time.perf_counter(), 0

    def close(self) -> None:
        """Stop the loader, commit the save in flight, leave the process group."""
        self.loader.close()
        self.checkpointer.close()
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="launch config written by lifecycle.tasks.train.launch.run_train")
    ap.add_argument("--local_rank", type=int, default=None, help="ignored (passed by some launchers)")
    args = ap.parse_args(argv)
    trainer = Trainer(json.loads(Path(args.config).read_text()))
    while trainer.step < trainer.cfg.max_steps:
        trainer.train_step()
    trainer.close()


if __name__ == "__main__":
    main()
