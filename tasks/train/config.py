"""Training config, torch-free: `ModelConfig` (the decoder's shape) and `TrainConfig` (everything a run needs).

The CLI, the flow and the sizing planner import this module without loading torch; the ranks read the same
config from the launch file the supervisor writes.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Fields that do not change the trajectory, so they are not part of the run fingerprint.
OPERATIONAL = {"max_steps", "checkpoint_every", "keep_last", "eval_every", "eval_batches", "log_every",
               "master_port", "timeout_s", "threads_per_rank", "max_epochs", "peak_flops_per_rank", "prefetch",
               "async_save", "hostfile", "master_addr", "num_nodes", "include", "exclude", "launcher", "init_from"}


class ModelConfig(BaseModel):
    """Architecture of the decoder in lifecycle.tasks.train.model (kept here, torch-free). Every field is in the run fingerprint."""

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
    (lifecycle.tasks.train.sizing; Chinchilla's 20 tokens per parameter)."""
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
    """Checkpoints are snapshotted to host memory and persisted in the background (lifecycle.tasks.train.async_ckpt);
    false = the synchronous save of lifecycle.tasks.train.checkpoint. Either way the commit marker comes last."""
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
