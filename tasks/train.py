"""Train task: write a launch config, run `deepspeed --module tasks.train_loop` on CPU ranks, supervise it.

One run directory `<workdir>/train/<fingerprint[:20]>/` per trajectory: config.json (read by every rank),
ds_config.json, train.log (appended per launch), metrics.jsonl (rank 0), checkpoints/step_<8 digits>/.

The fingerprint covers what determines the trajectory: token dataset, code, model and optimisation
fields. It leaves out where the run stops (`max_steps`) and how it is operated (checkpoint cadence,
logging, port, timeout). So a larger `max_steps` resumes from the last committed checkpoint of the same
directory, and the same config again launches nothing. The cosine horizon is `decay_steps`: set it to extend a
run later; left null it follows `max_steps`, so a longer run is a new run (its lr curve differs).

No torch here (the CLI imports this module for its config): the ranks import it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lifecycle import dataset as ds
from tasks import checkpoint as ckpt
from tasks.tokenizer import token_shards

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parent.parent
# Fields that do not change the trajectory, so they are not part of the run fingerprint.
OPERATIONAL = {"max_steps", "checkpoint_every", "keep_last", "eval_every", "eval_batches", "log_every",
               "master_port", "timeout_s", "threads_per_rank", "max_epochs", "peak_flops_per_rank", "prefetch",
               "async_save", "hostfile", "master_addr", "num_nodes", "include", "exclude", "launcher", "init_from"}
LOCAL_HOSTS = {"localhost", "127.0.0.1", socket.gethostname()}


class ModelConfig(BaseModel):
    """Architecture of the decoder in tasks.model (kept here, torch-free). Every field is in the run fingerprint."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    vocab_size: int | None = Field(None, ge=2)
    """Vocabulary size. Left null in a training config: the train task fills it from the tokenizer."""
    n_layer: int = Field(4, ge=1)
    """Number of transformer blocks."""
    n_head: int = Field(4, ge=1)
    """Attention heads per block; must divide `n_embd`."""
    n_embd: int = Field(128, ge=8)
    """Residual stream width."""
    seq_len: int = Field(128, ge=2)
    """Context length in tokens (the longest sequence `forward` accepts)."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalisation before each sublayer and before the output head."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """Feed-forward type. SwiGLU uses a hidden width of 8/3·n_embd (rounded up to 32) to match GELU's 4·n_embd in parameters."""
    pos: Literal["rope", "learned"] = "rope"
    """Position encoding: rotary (applied to q and k in attention) or a learned absolute table."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on attention weights and residual branches (0 for short pretraining runs)."""
    init: Literal["normal", "gpt2_scaled", "ds_init"] = "gpt2_scaled"
    """normal: N(0, 0.02) everywhere; gpt2_scaled: residual output projections get 0.02/sqrt(2·n_layer) (GPT-2);
    ds_init: depth-scaled init for deep stacks (Zhang, Titov & Sennrich 2019, "Improving Deep Transformer with
    Depth-Scaled Initialization and Merged Attention", eq. 7): every matrix of block l (1-based) is drawn from
    U(-γ, γ) with γ = α·sqrt(6 / (d_in + d_out)) / sqrt(l), α = 1, so deeper blocks start with smaller
    residual updates; embeddings stay N(0, 0.02)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head (see module docstring)."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""
    norm_eps: float = Field(1e-5, gt=0)
    """Epsilon of the norm layers."""

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.pos == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"pos='rope' needs an even head dim, got n_embd/n_head = {self.n_embd // self.n_head}")
        return self

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        if self.mlp == "gelu":
            return 4 * self.n_embd
        return 32 * math.ceil(8 * self.n_embd / 3 / 32)


class TrainConfig(BaseModel):
    """Training hyperparameters and how the DeepSpeed ranks are run."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    model: ModelConfig = ModelConfig()
    """Architecture. `model.vocab_size` null = take it from the tokenizer at run time."""
    init_from: Literal["scratch", "champion"] = "scratch"
    """`champion`: start from the weights of the registry's champion version (and tokenize with its tokenizer)
    when its architecture equals `model`; otherwise from scratch, and the run says why. Only the weights carry
    over: optimizer state and LR schedule start fresh. The weights' sha256 is part of the run fingerprint."""
    model_size: Literal["fixed", "auto"] = "fixed"
    """fixed: `model` as given. auto: keep `model`'s recipe (norm, mlp, pos, seq_len, ...) but pick n_layer,
    n_embd and n_head for the compute-optimal N = D/20 of the token dataset's actual train tokens D
    (tasks.plan; Chinchilla's 20 tokens per parameter)."""
    max_epochs: float = Field(4.0, gt=0)
    """Warn when max_steps would pass over the train tokens more than this many times (repeated data
    is worth less: Muennighoff et al. 2023 find up to ~4 epochs nearly as good as fresh data)."""
    peak_flops_per_rank: float | None = Field(None, gt=0)
    """Peak FLOP/s of one rank's device, the MFU denominator (e.g. 989e12 for an H100's dense bf16).
    Null = measured at start-up with an fp32 matmul on the rank's threads, so MFU is relative to what
    this CPU can do."""
    prefetch: int = Field(4, ge=0)
    """Micro-batches a background thread prepares ahead of the training step (0 = load in the step)."""
    async_save: bool = True
    """Checkpoints are snapshotted to host memory and persisted in the background (tasks.async_ckpt);
    false = the synchronous save of tasks.checkpoint. Either way the commit marker comes last."""
    spike_factor: float | None = Field(4.0, gt=1)
    """Roll back when a step's rank-averaged loss exceeds this many times the mean of the last
    `spike_window` losses (a NaN or infinite loss always rolls back). Null = only NaN/inf."""
    spike_window: int = Field(20, ge=2)
    """Losses averaged for the spike test (it starts once the window is full)."""
    spike_skip: int = Field(1, ge=1)
    """Data steps skipped at a rollback: the offending step's batches and the ones just before it."""
    max_rollbacks: int = Field(5, ge=0)
    """Fail the run after this many rollbacks (something other than a bad batch is wrong)."""
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per rank per forward/backward."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step. Global batch = micro_batch_size·grad_accum·num_ranks."""
    max_steps: int = Field(200, ge=1)
    """Optimizer steps to reach. Not part of the run fingerprint: raising it extends the run."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = Field(1e-4, ge=0)
    """Learning rate at the end of the cosine decay and after it."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warmup steps: lr = lr·(step+1)/(warmup_steps+1)."""
    decay_steps: int | None = Field(None, ge=1)
    """Step at which the cosine reaches min_lr. Null = max_steps (see the module docstring)."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW decoupled weight decay on matrices (2-D weights); norms and biases get none."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip (DeepSpeed `gradient_clipping`); 0 disables it."""
    zero_stage: int = Field(2, ge=0, le=3)
    """DeepSpeed ZeRO stage: 0 plain data parallel, 1 optimizer state, 2 + gradients, 3 + parameters sharded."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 weights/activations with fp32 master weights. fp16 does not run on CPU."""
    accelerator: Literal["cpu", "cuda"] = "cpu"
    """Where the ranks run: `cpu` (DeepSpeed's CPU accelerator, gloo) or `cuda` (one GPU per rank, NCCL; the
    launcher's `--num_gpus` picks the local GPUs). Every rank fails at start-up, naming this field, when `cuda`
    is asked for and torch sees no GPU."""
    activation_checkpointing: bool = False
    """Keep only each transformer block's input in forward and recompute the block in backward
    (torch.utils.checkpoint, non-reentrant): activation memory drops from every intermediate of every block
    to one (B, T, n_embd) tensor per block, for about one extra forward of compute. Gradients are the same
    up to rounding; it stays in the run fingerprint, so switching it starts a new run rather than mixing
    two numerics in one trajectory."""
    num_ranks: int = Field(2, ge=1)
    """Data-parallel processes started by the deepspeed launcher on this machine."""
    threads_per_rank: int | None = Field(None, ge=1)
    """OMP/torch threads per rank. Null = CPU cores // num_ranks (at least 1)."""
    checkpoint_every: int = Field(100, ge=1)
    """Commit a checkpoint every this many steps; one is always committed at max_steps."""
    keep_last: int = Field(3, ge=1)
    """Committed checkpoints kept (K newest); older ones are deleted after each commit."""
    seed: int = 1337
    """Seeds the initial weights (same on every rank) and the batch sampler (seed, step, rank, micro)."""
    eval_every: int = Field(0, ge=0)
    """Validation loss every this many steps during training (0 = never; the evaluate task does it after)."""
    eval_batches: int = Field(4, ge=1)
    """Micro-batches per rank for each in-training validation."""
    log_every: int = Field(10, ge=1)
    """Append a metrics record (rank-averaged loss) every this many steps, and at the first and last."""
    master_port: int | None = Field(None, ge=1024, le=65535)
    """torch.distributed rendezvous port; null = pick a free one at launch."""
    timeout_s: float | None = Field(None, gt=0)
    """Kill the ranks and fail after this many seconds (null = no limit)."""
    hostfile: str | None = None
    """DeepSpeed hostfile (`<host> slots=<ranks>` per line, `#` comments) to run the ranks across the listed
    hosts; null = `num_ranks` ranks on this machine. With a hostfile `num_ranks` is the total number of
    ranks the (filtered) hostfile gives, and every host needs the same run directory (a shared file system)
    and the same Python environment at the same path, reachable by passwordless ssh (pdsh by default)."""
    master_addr: str | None = None
    """Address of the rank-0 host for the rendezvous. Null: 127.0.0.1 when every rank is on one host, else
    the DeepSpeed launcher asks the first host over ssh (`hostname -I`)."""
    num_nodes: int | None = Field(None, ge=1)
    """Use only the first this many hosts of the hostfile (launcher `--num_nodes`)."""
    include: str | None = None
    """Hosts/slots to use, DeepSpeed syntax `node1@node2:0,1` (launcher `--include`)."""
    exclude: str | None = None
    """Hosts/slots to leave out, same syntax (launcher `--exclude`)."""
    launcher: Literal["pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm"] = "pdsh"
    """How the DeepSpeed launcher starts the ranks on other hosts (launcher `--launcher`)."""

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.warmup_steps >= self.horizon:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below decay_steps/max_steps ({self.horizon})")
        if self.hostfile is None and (self.num_nodes or self.include or self.exclude):
            raise ValueError("num_nodes/include/exclude select hosts of a hostfile: set train.hostfile too")
        if self.include and self.exclude:
            raise ValueError("train.include and train.exclude are mutually exclusive")
        if self.num_nodes and (self.include or self.exclude):
            raise ValueError("train.num_nodes cannot be combined with include/exclude (the DeepSpeed launcher refuses it)")
        return self

    @property
    def horizon(self) -> int:
        return self.decay_steps or self.max_steps

    def lr_at(self, step: int) -> float:
        """Learning rate of update `step` (0-based): linear warmup, cosine to min_lr at `horizon`, then flat."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        if step >= self.horizon:
            return self.min_lr
        ratio = (step - self.warmup_steps) / (self.horizon - self.warmup_steps)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (self.lr - self.min_lr)

    def run_key(self) -> dict:
        """The config part of the run fingerprint (operational fields out, cosine horizon resolved)."""
        key = self.model_dump(mode="json", exclude=OPERATIONAL)
        key["decay_steps"] = self.horizon
        return key


class TrainResult(BaseModel):
    model_config = ConfigDict(frozen=True)
    checkpoint_dir: str
    """The committed checkpoint at `steps` (tag directory with COMMITTED.json and model.safetensors)."""
    steps: int
    final_loss: float | None
    """Rank-averaged training loss of the last step, from the commit marker."""
    metrics_path: str
    resumed_from: int | None
    """Step the launched ranks resumed from; None for a fresh start or when nothing was launched."""
    launched: bool
    run_dir: str
    log_path: str
    model_params: int | None = None
    """Non-embedding parameters N of the trained model (the N of 6·N FLOPs per token)."""
    flops_per_token: int | None = None
    """Training FLOPs per token (tasks.plan.flops_per_token)."""
    epochs: float | None = None
    """Passes over the train tokens that max_steps makes."""


def _result(tag_dir: Path, run_dir: Path, resumed_from: int | None, launched: bool, sizing: dict) -> TrainResult:
    marker = ckpt.read_marker(tag_dir)
    return TrainResult(checkpoint_dir=str(tag_dir), steps=marker["step"], final_loss=marker.get("loss"),
                       metrics_path=str(run_dir / "metrics.jsonl"), resumed_from=resumed_from,
                       launched=launched, run_dir=str(run_dir), log_path=str(run_dir / "train.log"), **sizing)


def resolve_model(cfg: TrainConfig, vocab_size: int, train_tokens: int) -> tuple[TrainConfig, dict]:
    """Fill vocab_size, size the model under `model_size: auto`, and warn about repeated data.
    Returns the resolved config and the sizing fields of TrainResult."""
    from tasks import plan

    if cfg.model.vocab_size is None:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": vocab_size})})
    if cfg.model_size == "auto":
        target = plan.compute_optimal(tokens=train_tokens).n_params
        sized = plan.model_for_params(target, cfg.model)
        log.info("model_size=auto: %s train tokens -> N = %.4g -> n_layer=%d n_embd=%d n_head=%d (N = %d)",
                 train_tokens, target, sized.n_layer, sized.n_embd, sized.n_head, plan.non_embedding_params(sized))
        cfg = cfg.model_copy(update={"model": sized})
    tokens_per_step = cfg.micro_batch_size * cfg.grad_accum * cfg.num_ranks * cfg.model.seq_len
    epochs = cfg.max_steps * tokens_per_step / max(train_tokens, 1)
    if epochs > cfg.max_epochs:
        msg = (f"training repeats the data {epochs:.1f} times (max_steps {cfg.max_steps} x {tokens_per_step} tokens "
               f"per step over {train_tokens} train tokens), more than train.max_epochs={cfg.max_epochs}")
        log.warning(msg)
        warnings.warn(msg, RepeatedDataWarning, stacklevel=3)
    sizing = {"model_params": plan.non_embedding_params(cfg.model), "flops_per_token": plan.flops_per_token(cfg.model),
              "epochs": epochs}
    return cfg, sizing


class RepeatedDataWarning(UserWarning):
    """max_steps passes over the train tokens more often than train.max_epochs."""


class _MetricsTail:
    """Feeds complete new metrics.jsonl records past the resume step to a callback, each (kind, step) once."""

    def __init__(self, path: Path, after_step: int, callback: Callable[[dict], None] | None):
        self.path, self.after, self.callback, self.offset, self.seen = path, after_step, callback, 0, set()

    def poll(self) -> None:
        if self.callback is None or not self.path.exists():
            return
        if self.path.stat().st_size < self.offset:  # rank 0 truncated it to the resume step
            self.offset = 0
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]
        self.offset += len(data)
        for rec in map(json.loads, data.splitlines()):
            if rec["step"] > self.after and (rec["kind"], rec["step"]) not in self.seen:
                self.seen.add((rec["kind"], rec["step"]))
                self.callback(rec)


def run_train(tokens: ds.DatasetRef, cfg: TrainConfig, workdir: str,
              on_metrics: Callable[[dict], None] | None = None, init_weights: str | None = None) -> TrainResult:
    """Train to `cfg.max_steps` (resuming from the run's last committed checkpoint) and return the final one.

    `on_metrics(record)` is called from this process for each new metrics record while the ranks run.
    `init_weights`: a consolidated `model.safetensors` to start from instead of a fresh initialisation."""
    meta = token_shards(tokens)
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < meta.vocab_size:
        raise ValueError(f"model.vocab_size {cfg.model.vocab_size} < tokenizer vocab {meta.vocab_size} ({tokens.path})")
    cfg, sizing = resolve_model(cfg, meta.vocab_size, meta.num_tokens["train"])
    need = cfg.model.seq_len + 1
    for split in ("train", "val") if cfg.eval_every else ("train",):
        if meta.num_tokens[split] < need:
            raise ValueError(f"{split} shard of {tokens.path} has {meta.num_tokens[split]} tokens, a window needs "
                             f"{need}" + (" (set eval_every=0 or raise tokenize.val_fraction)" if split == "val" else ""))
    here = Path(__file__).resolve().parent
    code = ds.code_version(*(here / f for f in ("train.py", "train_loop.py", "model.py", "checkpoint.py",
                                                "async_ckpt.py", "loader.py")))
    init = {"init_weights_sha256": ds.sha256_file(init_weights)} if init_weights else {}
    fp = ds.fingerprint("train", {**cfg.run_key(), **init}, code, [tokens])
    run_dir = Path(workdir).resolve() / "train" / fp[:20]
    ckpt_root, log_path = run_dir / "checkpoints", run_dir / "train.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".lock", "w") as lock:
        try:  # one supervisor per run directory; the OS drops the lock if this process dies
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another run_train is supervising {run_dir}") from None
        latest = ckpt.latest_valid(ckpt_root, max_step=cfg.max_steps)
        if latest is not None and ckpt.step_of(latest) == cfg.max_steps:
            return _result(latest, run_dir, None, launched=False, sizing=sizing)
        resumed_from = ckpt.step_of(latest) if latest is not None else None
        config_path = run_dir / "config.json"
        ds.atomic_write_json(config_path, {"train": cfg.model_dump(mode="json"), "fingerprint": fp, "code_version": code,
                                           "run_dir": str(run_dir), "tokens": meta.model_dump(),
                                           "token_dataset": tokens.path, "init_weights": init_weights, **init})
        with socket.socket() as s:  # a free port, unless one is configured
            s.bind(("127.0.0.1", 0))
            port = cfg.master_port or s.getsockname()[1]
        launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
        if launcher is None:
            raise RuntimeError(f"the deepspeed launcher is neither next to {sys.executable} nor on PATH")
        threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // cfg.num_ranks)
        cmd = [launcher, *launch_args(cfg, port, run_dir, threads), "--module", "--no_local_rank",
               "tasks.train_loop", "--config", str(config_path)]
        env = {**os.environ, "DS_ACCELERATOR": cfg.accelerator, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
               "LIFECYCLE_SUPERVISOR_PID": str(os.getpid()),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        tail = _MetricsTail(run_dir / "metrics.jsonl", resumed_from or 0, on_metrics)
        release_shm()  # buffers leaked by earlier launches whose supervisor was killed
        with open(log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} resume_from={resumed_from}: {' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            start = time.monotonic()
            try:
                while proc.poll() is None:
                    tail.poll()
                    if cfg.timeout_s is not None and time.monotonic() - start > cfg.timeout_s:
                        raise TimeoutError(f"training exceeded timeout_s={cfg.timeout_s}; ranks killed")
                    time.sleep(0.5)
            except BaseException as e:
                _stop(proc)
                if isinstance(e, TimeoutError):
                    raise RuntimeError(f"{e}. Last lines of {log_path}:\n{_tail(log_path)}") from e
                raise
            finally:
                release_shm()
        tail.poll()
        if proc.returncode != 0:
            raise RuntimeError(f"deepspeed exited with code {proc.returncode}. Last lines of {log_path}:\n{_tail(log_path)}")
        final = ckpt.latest_valid(ckpt_root, max_step=cfg.max_steps)
        if final is None or ckpt.step_of(final) != cfg.max_steps:
            raise RuntimeError(f"ranks exited cleanly but {ckpt_root} has no valid commit at step {cfg.max_steps}")
        return _result(final, run_dir, resumed_from, launched=True, sizing=sizing)


def read_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots} of a DeepSpeed hostfile, validated line by line (DeepSpeed's own parser names neither
    the file nor the line, and accepts trailing garbage after `slots=N`)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"train.hostfile {path}: cannot read it ({e.strerror})") from None
    hosts: dict[str, int] = {}
    for n, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit() or int(parts[1][6:]) < 1:
            raise ValueError(f"hostfile {path}, line {n}: expected '<host> slots=<ranks >= 1>', got {raw.strip()!r}")
        if parts[0] in hosts:
            raise ValueError(f"hostfile {path}, line {n}: host {parts[0]!r} is listed twice")
        hosts[parts[0]] = int(parts[1][6:])
    if not hosts:
        raise ValueError(f"hostfile {path}: no '<host> slots=<ranks>' line")
    return hosts


def select_hosts(hosts: dict[str, int], cfg: TrainConfig) -> dict[str, int]:
    """{host: ranks} that the launcher's `--include`/`--exclude`/`--num_nodes` leave of a hostfile (the
    selection rules of deepspeed/launcher/runner.py), so the world size is checked before anything starts."""
    def parse(spec: str) -> dict[str, int | None]:  # "node1@node2:0,2" -> {node1: None (all), node2: 2}
        out = {}
        for part in spec.split("@"):
            host, _, slots = part.partition(":")
            if host not in hosts:
                raise ValueError(f"host {host!r} of {spec!r} is not in hostfile {cfg.hostfile}")
            out[host] = len(slots.split(",")) if slots else None
        return out

    if cfg.include:
        return {h: n or hosts[h] for h, n in parse(cfg.include).items()}
    if cfg.exclude:
        drop = parse(cfg.exclude)
        left = {h: hosts[h] - (drop[h] or hosts[h]) if h in drop else hosts[h] for h in hosts}
        return {h: n for h, n in left.items() if n > 0}
    return dict(list(hosts.items())[: cfg.num_nodes or len(hosts)])


def launch_args(cfg: TrainConfig, port: int, run_dir: Path, threads: int) -> list[str]:
    """Arguments of the `deepspeed` launcher before the module: `--num_gpus` local ranks, or the hostfile
    with its host selection. With a hostfile, the rank environment that the launcher does not forward over
    ssh itself (it forwards PYTHON* variables) is written to `<run_dir>/.deepspeed_env`, which it reads
    from its working directory."""
    if cfg.hostfile is None:
        return ["--num_gpus", str(cfg.num_ranks), "--master_port", str(port)]
    chosen = select_hosts(read_hostfile(cfg.hostfile), cfg)
    if sum(chosen.values()) != cfg.num_ranks:
        raise ValueError(f"hostfile {cfg.hostfile} gives {sum(chosen.values())} ranks "
                         f"({', '.join(f'{h}: {n}' for h, n in chosen.items())}) but train.num_ranks={cfg.num_ranks}")
    args = ["--hostfile", str(Path(cfg.hostfile).resolve()), "--master_port", str(port), "--launcher", cfg.launcher]
    one_host = len(chosen) == 1
    master = cfg.master_addr or ("127.0.0.1" if one_host and next(iter(chosen)) in LOCAL_HOSTS else None)
    if master:
        args += ["--master_addr", master]
    if one_host:  # DeepSpeed starts a single host's ranks locally, but would still try ssh to it first
        args.append("--no_ssh_check")
    for flag, value in (("--num_nodes", cfg.num_nodes), ("--include", cfg.include), ("--exclude", cfg.exclude)):
        if value:
            args += [flag, str(value)]
    (run_dir / ".deepspeed_env").write_text(f"DS_ACCELERATOR={cfg.accelerator}\nOMP_NUM_THREADS={threads}\n")
    return args


SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"  # deepspeed/ops/csrc/cpu/comm/shm.cpp


def release_shm() -> list[str]:
    """Unlink DeepSpeed's CPU all-reduce buffers that no live process maps.

    DeepSpeed 0.19's CPU comm op creates two POSIX shared-memory buffers per launch (66 MiB each here) and
    never unlinks them, not even on a clean exit; killed ranks leak them too. Left alone they fill
    /dev/shm (RAM) launch after launch. A buffer still mapped by a running rank is left in place.
    """
    if not SHM_DIR.is_dir():
        return []
    candidates = {p.name for p in SHM_DIR.glob(f"{SHM_PREFIX}_*")}
    if not candidates:
        return []
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:
            continue
        candidates -= {name for name in candidates if name in text}
    for name in candidates:
        (SHM_DIR / name).unlink(missing_ok=True)
    return sorted(candidates)


def _tail(path: Path, n: int = 60) -> str:
    with open(path, "rb") as f:
        return b"".join(deque(f, maxlen=n)).decode(errors="replace")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher's process group (launcher and ranks), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
