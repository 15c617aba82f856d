"""Training config, torch-free: `ModelConfig` (the decoder's shape) and `TrainConfig` (everything a run needs).

The CLI, the flow and the sizing planner import this module without loading torch; the ranks read the same
config from the launch file the supervisor writes.

`TrainConfig` is grouped in sections, as torchtitan's job config is: `optimizer`, `batch`, `engine`, `guard`
(trajectory: in the run fingerprint) and `checkpoint`, `logging`, `launch` (operational: out of it as a
whole), plus a few top-level fields (`model`, `seed`, `max_steps`, ...). A YAML file or an override names a
field by its dotted path: `train.optimizer.lr`, `--set train.checkpoint.every=50`, `train.max_steps`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo

from lifecycle.tasks.train.model_config import ModelConfig, MoEArch, RopeScaling  # noqa: F401  (re-exported)
from lifecycle.tasks.train.parallel import rules
from lifecycle.tasks.train.run_sections import (  # noqa: F401  (the operational sections, re-exported)
    CheckpointConfig, LaunchConfig, LoggingConfig, Section,
)


class OptimizerConfig(Section):
    """The optimizer (AdamW, or Muon with AdamW beside it) and its learning-rate schedule: linear warmup, then a cosine decay (`schedule: cosine`) or a stable
    phase and a short decay (`schedule: wsd`), reaching min_lr at the horizon, then flat."""

    name: Literal["adamw", "muon"] = "adamw"
    """`adamw`: torch AdamW on every parameter. `muon`: DeepSpeed's `MuonWithAuxAdam`
    (deepspeed/runtime/zero/muon; Jordan et al. 2024): Muon (momentum, then a Newton-Schulz orthogonalised
    update) on the blocks' 2-D weights at `muon_lr`, AdamW at `lr` (betas, weight_decay) on the embeddings, the
    head, norms and biases, as modded-nanogpt and nanochat split it; the schedule scales both. Under ZeRO 0-3 and
    every layout (tp, pp, sp, experts and their compositions; docs/training.md, Recipe); refused with ZeRO-3 and a
    base model (zero.Init) and, under ZeRO 1-3, with `grad_clip` > 0 (`_check_muon` says why)."""
    muon_lr: float = Field(0.02, gt=0)
    """`muon`: peak learning rate of the Muon half (its update has unit spectral scale, hence the larger value)."""
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    """`muon`: Nesterov momentum of the Muon half."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate, reached at the end of warmup (of the AdamW half under `name: muon`)."""
    min_lr: float = Field(1e-4, ge=0)
    """Learning rate at the end of the cosine decay and after it; at most `lr`."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warmup steps: lr = lr·(step+1)/(warmup_steps+1). Below the cosine horizon."""
    decay_steps: int | None = Field(None, ge=1)
    """Step at which the cosine reaches min_lr. Null = `train.max_steps`, so raising max_steps then changes the
    lr curve and starts a new run; set it to be able to extend a run later (see lifecycle.tasks.train.launch)."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """`cosine`: from lr after warmup down to min_lr at the horizon. `wsd`: warmup-stable-decay (Hu et al. 2024,
    MiniCPM; Hägele et al. 2024): lr held after warmup, then decayed to min_lr over the last `decay_fraction` of
    the horizon. The stable phase does not depend on the horizon, so a WSD run can be continued further and its
    anneal branched off any step of it (docs/training.md, "Recipe")."""
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """`wsd`: share of the horizon spent decaying (the decay starts at horizon - round(fraction·horizon), never
    before the end of warmup). Ignored by `cosine`."""
    decay_shape: Literal["linear", "sqrt", "cosine"] = "sqrt"
    """`wsd`: the decay's shape over its steps, progress p in [0, 1]: `linear` lr·(1-p), `sqrt` lr·(1-sqrt(p))
    (Hägele et al. 2024's best), `cosine` lr·(1+cos(πp))/2; all from lr to min_lr. Ignored by `cosine`."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW decoupled weight decay on matrices (2-D weights); norms and biases get none."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip (DeepSpeed `gradient_clipping`); 0 disables it."""

    @field_validator("min_lr")
    @classmethod
    def _min_lr_below_lr(cls, v: float, info: ValidationInfo) -> float:
        if "lr" in info.data and v > info.data["lr"]:
            raise ValueError(f"min_lr ({v}) must not exceed lr ({info.data['lr']})")
        return v


class BatchConfig(Section):
    """What one optimizer step sees. Global batch = micro_batch_size·grad_accum·dp sequences, where dp =
    num_ranks / (parallel.tp·parallel.pp·parallel.sp) is the data-parallel degree."""

    micro_batch_size: int = Field(16, ge=1)
    """Sequences per rank per forward/backward."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step."""
    num_ranks: int = Field(2, ge=1)
    """All ranks (the world size): data-parallel degree × `train.parallel` tp·pp·sp. Without a hostfile, processes the train stage starts on this machine
    (one per rank, with DeepSpeed's rank environment); with `train.launch.hostfile`, the total number of ranks the (filtered) hostfile gives."""
    window_starts: Literal["anywhere", "documents"] = "anywhere"
    """Where a training window may start (lifecycle.tasks.train.sampler): `anywhere` in a shard (uniform), or
    `documents`: at a document's first token or a whole number of seq_len past it inside the document (a long
    document is read in chunks from its start; no token is dropped), uniform over those starts. In the
    fingerprint; a run whose config.json predates the field resumes as `anywhere` (sampler.window_mode)."""


class EngineConfig(Section):
    """The DeepSpeed engine: sharding, numerics and the device. All of it changes the numbers a step computes."""

    zero_stage: int = Field(2, ge=0, le=3)
    """DeepSpeed ZeRO stage: 0 plain data parallel, 1 optimizer state, 2 + gradients, 3 + parameters sharded."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 weights/activations with fp32 master weights. fp16 does not run on CPU."""
    optimizer_states: Literal["fp32", "bf16"] = "fp32"
    """Master weights, the gradients the step reads and AdamW's two moments in fp32, or in bf16 (DeepSpeed's
    `bf16_master_weights_and_grads` and `bf16_optimizer_states`): 6 bytes of optimizer state per parameter
    instead of 12. Needs `precision: bf16` and ZeRO 1-3; not with pipeline stages. In the fingerprint."""
    accelerator: Literal["cpu", "cuda"] = "cpu"
    """Where the ranks run: `cpu` (DeepSpeed's CPU accelerator, gloo) or `cuda` (one GPU per rank, NCCL; the
    launcher's `--num_gpus` picks the local GPUs). Every rank fails at start-up, naming this field, when `cuda`
    is asked for and torch sees no GPU. In the fingerprint: a GPU run's numerics differ from a CPU run's."""
    activation_checkpointing: bool | Literal["selective"] = False
    """true: keep only each transformer block's input in forward and recompute the block in backward
    (torch.utils.checkpoint, non-reentrant): activation memory drops from every intermediate of every block
    to one (B, T, n_embd) tensor per block, for about one extra forward of compute. `selective`: torchtitan's
    per-op policy: inside each block keep the outputs of the attention kernel and of every other matmul (the
    1st and 3rd: q/k/v and the MLP's up projection), recompute the rest in backward (norms, RoPE, activation
    functions, the output and down projections), which costs two of the block's four matmuls again instead of
    all of them. The gradients are the same as without recomputation; it is layout, not trajectory (a run may
    resume with another setting)."""
    compile: bool | Literal["auto"] = "auto"
    """Compile the model with `torch.compile` (inductor) under DeepSpeed (`engine.compile()`: the module's
    forward and backward become fused kernels; parameter names and checkpoints are unchanged). `auto`: on for
    `accelerator: cuda` without pipeline parallelism, off on the CPU, where the demo's model is too small for the
    compile time to pay back within a run (docs/benchmarks.md, "Compile", has the figures).
    `true` compiles on the CPU too. Refused with pipeline parallelism (DeepSpeed's pipeline engine runs its
    stages itself). In the fingerprint: compiled kernels round differently from eager ones."""

    @property
    def compiled(self) -> bool:
        """Whether the ranks compile the model (`compile`, with `auto` resolved)."""
        return self.accelerator == "cuda" if self.compile == "auto" else bool(self.compile)


class ParallelConfig(Section):
    """Model parallelism beside data parallelism (lifecycle.tasks.train.parallel.mesh): the ranks form a grid
    pp × dp × sp × tp, tp innermost (Megatron's and DeepSpeed's order), and dp is what `batch.num_ranks` leaves.
    Every rank of one tp/sp/pp group reads the same micro-batches; only dp splits the data. In the fingerprint:
    the degrees change the reduction order of every step."""

    tp: int = Field(1, ge=1)
    """Tensor parallelism (Megatron's 1-D column/row split of attention and MLP): ranks per tp group."""
    pp: int = Field(1, ge=1)
    """Pipeline parallelism (DeepSpeed PipelineModule, 1F1B; lifecycle.tasks.train.parallel.pp): pipeline stages, each
    a contiguous run of blocks. ZeRO-0 or ZeRO-1 only (DeepSpeed's pipeline engine); grad_accum micro-batches fill
    the pipeline."""
    sp: int = Field(1, ge=1)
    """Sequence parallelism (DeepSpeed-Ulysses all-to-all attention): ranks that split each sequence."""
    tp_sequence_parallel: bool = False
    """Megatron's sequence parallelism inside each tp group (Korthikanti et al. 2022): between the matmuls each tp
    rank keeps 1/tp of the sequence, so the norms' and residual adds' activations shrink by tp; the all-reduces
    around each block become an all-gather and a reduce-scatter of the same volume. Needs tp > 1 and seq_len
    divisible by tp; not with pipeline stages."""

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model between them (tp·pp·sp)."""
        return self.tp * self.pp * self.sp


class MoEConfig(Section):
    """Mixture of experts (GShard/Switch routing, DeepSpeed-MoE layers): the MLP of every `every`-th block
    becomes `num_experts` experts with a learned top-k router. In the fingerprint."""

    num_experts: int = Field(0, ge=0)
    """Experts per MoE layer; 0 = a dense model (no MoE layers)."""
    top_k: int = Field(1, ge=1)
    """Experts each token is routed to (1: Switch; 2: GShard, Mixtral)."""
    ep: int = Field(1, ge=1)
    """Expert-parallel degree: ranks of one data-parallel group that split the experts between them."""
    capacity_factor: float = Field(1.25, gt=0)
    """Tokens an expert accepts per step, as a multiple of an even share (tokens·top_k/num_experts); the tokens
    past it are dropped from that expert (they pass through the residual) and counted."""
    aux_loss_weight: float = Field(0.01, ge=0)
    """Weight of the load-balancing loss (Switch Transformer's) added to the language-model loss."""
    every: int = Field(1, ge=1)
    """An MoE MLP in every `every`-th block (1: all blocks; 2: blocks 1, 3, 5, ..., as GShard)."""


class GuardConfig(Section):
    """Loss-spike and non-finite-loss rollback: restore the last commit and skip the offending batches. In the
    fingerprint: a rollback changes which batches the run trains on."""

    spike_factor: float | None = Field(4.0, gt=1)
    """Roll back when a step's rank-averaged loss exceeds this many times the mean of the last
    `spike_window` losses (a NaN or infinite loss always rolls back). Null = only NaN/inf."""
    spike_window: int = Field(20, ge=2)
    """Losses averaged for the spike test (it starts once the window is full)."""
    spike_skip: int = Field(1, ge=1)
    """Data steps skipped at a rollback: the offending step's batches and the ones just before it."""
    max_rollbacks: int = Field(5, ge=0)
    """Fail the run after this many rollbacks (something other than a bad batch is wrong)."""

    def is_bad(self, loss: float, recent: list[float]) -> bool:
        """Non-finite, or more than spike_factor times the mean of the last spike_window healthy losses."""
        return not math.isfinite(loss) or (
            self.spike_factor is not None and len(recent) >= self.spike_window
            and loss > self.spike_factor * sum(recent[-self.spike_window:]) / self.spike_window)


class Operational:
    """Marks a top-level `TrainConfig` field that does not change the trajectory: `Annotated[T, OPERATIONAL]`."""

    def __repr__(self) -> str:
        return "OPERATIONAL"


OPERATIONAL = Operational()


def is_operational(field: FieldInfo) -> bool:
    """Whether a `TrainConfig` field stays out of the run fingerprint: an operational section, or a top-level
    field marked `OPERATIONAL`."""
    kind = field.annotation
    if isinstance(kind, type) and issubclass(kind, Section):
        return kind.operational
    return any(isinstance(m, Operational) for m in field.metadata)


class TrainConfig(BaseModel):
    """Training hyperparameters and how the DeepSpeed ranks are run, in sections (`train.<section>.<field>`).

    The run fingerprint (`run_key`) holds every field of the sections that are not `operational`, plus the
    top-level fields not marked `OPERATIONAL`: what determines the trajectory, never where it stops
    (`max_steps`) or how it is run."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    model: ModelConfig = ModelConfig()
    """Architecture. `model.vocab_size` null = take it from the tokenizer at run time."""
    model_size: Literal["fixed", "auto"] = "fixed"
    """fixed: `model` as given. auto: keep `model`'s recipe (norm, mlp, pos, seq_len, ...) but pick n_layer,
    n_embd and n_head for the compute-optimal N = D/20 of the token dataset's actual train tokens D
    (lifecycle.tasks.train.sizing; Chinchilla's 20 tokens per parameter)."""
    layout: Annotated[str, OPERATIONAL] = "fixed"
    """How the ranks share the work. `fixed`: `batch` and `engine` as given. `auto`: keep the ranks and the global
    batch, and let the planner (lifecycle.tasks.train.planner) pick the ZeRO stage, the micro-batch (grad_accum
    follows) and activation checkpointing: the fastest layout its memory and step-time model says fits
    `layout_memory` per rank; the run logs what it chose and why. `tp=T,pp=P,sp=S[,dp=D]` names a layout (as
    `lifecycle plan layout` prints it): it sets `train.parallel`, and dp must be what the ranks leave. Operational:
    the fields it resolves to are in the fingerprint."""
    layout_memory: Annotated[str | None, OPERATIONAL] = None
    """Memory per rank that `layout: auto` plans for (`8GiB`, `80GB`). Null: on cpu, half of MemAvailable divided
    by the ranks (the async checkpoint's staging buffers and memory tier take host memory too); on cuda, the
    GPU's memory (nvidia-smi)."""
    resume_across_layouts: Annotated[bool, OPERATIONAL] = True
    """Resume a run saved under another layout (train.batch.num_ranks, micro_batch_size, grad_accum,
    train.engine.zero_stage) with the same global batch: its newest commit is converted for this layout
    (lifecycle.tasks.train.layout) and grad_accum adjusts when only the ranks or the ZeRO stage changed. False: a
    layout change starts a new run."""
    init_from: Annotated[str, Field(pattern=r"^(scratch|champion|hf:.+)$"), OPERATIONAL] = "scratch"
    """`champion`: start from the weights of the registry's champion version (and tokenize with its tokenizer)
    when its architecture equals `model`; otherwise from scratch, and the run says why. `hf:<dir>`: continue
    pretraining a Hugging Face checkpoint directory (Llama 2/3, Mistral, Qwen2, SmolLM; safetensors, sharded
    or not): the architecture comes from its config.json (`model` may set only seq_len, dropout and attention), the
    tokenize stage uses its tokenizer (lifecycle.tasks.train.hf_import). Only the weights carry over:
    optimizer state and LR schedule start fresh. Operational: the weights' sha256 is what enters the
    run fingerprint."""
    vocab_multiple: int = Field(1, ge=1)
    """Round the vocabulary that the train stage fills in from the tokenizer up to a multiple of this: 64 or 128 on
    a GPU, so the output head's matmul runs on whole Tensor Core tiles (nanoGPT pads GPT-2's 50,257 to 50,304). The
    extra rows are never targets, their logits learn to be low, and decoding skips their ids. 1 (the default) keeps
    the tokenizer's size: `tokenize.vocab_size`'s defaults are multiples of 64 already. No effect where
    `model.vocab_size` is set, as an imported checkpoint's is."""
    seed: int = 1337
    """Seeds the initial weights (same on every rank) and the batch sampler (seed, step, sequence index in the global batch)."""
    max_steps: Annotated[int, Field(ge=1), OPERATIONAL] = 200
    """Optimizer steps to reach. Not part of the run fingerprint: raising it extends the run (with
    `optimizer.decay_steps` set; null makes the cosine follow max_steps, and that is in the fingerprint)."""
    max_epochs: Annotated[float, Field(gt=0), OPERATIONAL] = 4.0
    """Warn when max_steps would pass over the train tokens more than this many times (repeated data
    is worth less: Muennighoff et al. 2023 find up to ~4 epochs nearly as good as fresh data)."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW and the learning-rate schedule."""
    batch: BatchConfig = BatchConfig()
    """Micro-batch, gradient accumulation and the number of data-parallel ranks."""
    engine: EngineConfig = EngineConfig()
    """DeepSpeed ZeRO stage, precision, device and activation checkpointing."""
    parallel: ParallelConfig = ParallelConfig()
    """Tensor, pipeline and sequence parallel degrees; data parallelism takes the rest of the ranks."""
    moe: MoEConfig = MoEConfig()
    """Mixture-of-experts layers and expert parallelism (off by default)."""
    guard: GuardConfig = GuardConfig()
    """Rollback on a non-finite or spiking loss."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoint cadence, retention and sync/async saving (operational)."""
    logging: LoggingConfig = LoggingConfig()
    """Metrics and in-training evaluation cadence (operational)."""
    launch: LaunchConfig = LaunchConfig()
    """Hosts, rendezvous, threads and time limit of the ranks (operational)."""

    @model_validator(mode="before")
    @classmethod
    def _from_base_model(cls, data: Any) -> Any:
        """`init_from: hf:<dir>`: the model section comes from the checkpoint's config.json, read (and refused
        where our model cannot compute it exactly) now, before any work starts."""
        if not isinstance(data, dict) or not str(data.get("init_from", "")).startswith("hf:"):
            return data
        from lifecycle.tasks.train.hf_config import base_dir, check_base

        given = data.get("model") or {}
        given = given.model_dump(exclude_unset=True) if isinstance(given, BaseModel) else dict(given)
        if data.get("model_size", "fixed") != "fixed":
            raise ValueError("train.model_size must be 'fixed' with train.init_from hf:<dir> (the checkpoint fixes "
                             "the architecture)")
        seq_len = given.get("seq_len", ModelConfig.model_fields["seq_len"].default)
        own = {k: given[k] for k in ("attention",) if k in given}  # how windows are attended: not the checkpoint's
        base = ModelConfig(**{**check_base(base_dir(data["init_from"]), seq_len), "dropout": given.get("dropout", 0.0),
                              **own})
        theirs = base.model_dump()
        if clash := [f"train.model.{k}={v!r} (config.json gives {theirs[k]!r})" for k, v in given.items()
                     if theirs.get(k) != v and not (k == "init")]:
            raise ValueError(f"with train.init_from {data['init_from']} the architecture comes from its "
                             f"config.json; remove or match: " + "; ".join(clash))
        return {**data, "model": base}

    @model_validator(mode="before")
    @classmethod
    def _layout(cls, data: Any) -> Any:
        """`layout: tp=T,pp=P,sp=S[,dp=D]` (what `lifecycle plan layout` prints) sets `train.parallel`; a degree
        that `parallel` also sets, differently, is refused. `dp` is checked against the ranks after validation."""
        if not isinstance(data, dict) or not isinstance(data.get("layout"), str) or data["layout"] in ("fixed", "auto"):
            return data
        v, degrees = data["layout"], {}
        for part in v.split(","):
            key, _, value = part.partition("=")
            if key.strip() not in ("tp", "pp", "sp", "dp") or not value.strip().isdigit() or int(value) < 1:
                raise ValueError(f"train.layout must be 'fixed', 'auto' or degrees like 'tp=1,pp=1,sp=1', got {v!r}")
            degrees[key.strip()] = int(value)
        given = data.get("parallel") or {}
        given = given.model_dump(exclude_unset=True) if isinstance(given, BaseModel) else dict(given)
        if clash := [f"train.parallel.{k}={given[k]} but train.layout {k}={n}" for k, n in degrees.items()
                     if k in given and given[k] != n]:
            raise ValueError("; ".join(clash))
        return {**data, "parallel": {**given, **{k: n for k, n in degrees.items() if k != "dp"}}}

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        rules.check(self)  # each parallelism's own (lifecycle.tasks.train.parallel.rules)
        eng = self.engine
        if eng.optimizer_states == "bf16" and (eng.precision != "bf16" or eng.zero_stage == 0):
            raise ValueError(f"train.engine.optimizer_states=bf16 needs train.engine.precision=bf16 (got {eng.precision})"
                             f" and train.engine.zero_stage 1-3 (got {eng.zero_stage}; DeepSpeed keeps bf16 master "
                             "weights and moments in its ZeRO optimizers only, runtime/config.py)")
        if self.model.norm == "none" and self.parallel.tp_sequence_parallel:
            raise ValueError("train.model.norm=none with train.parallel.tp_sequence_parallel: Megatron's sequence "
                             "parallelism splits the norms' activations along the sequence, and this model has no "
                             "norms; set train.parallel.tp_sequence_parallel=false")
        self._check_muon()
        if "dp=" in self.layout and int(self.layout.split("dp=")[1].split(",")[0]) != self.dp:
            raise ValueError(f"train.layout {self.layout!r}: dp must equal train.batch.num_ranks / (tp·pp·sp) "
                             f"({self.batch.num_ranks} / {self.parallel.model_parallel} = {self.dp}), the "
                             "data-parallel ranks")
        if self.optimizer.warmup_steps >= self.horizon:
            raise ValueError(f"train.optimizer.warmup_steps ({self.optimizer.warmup_steps}) must be below the cosine "
                             f"horizon, train.optimizer.decay_steps or else train.max_steps ({self.horizon})")
        return self

    def _check_muon(self) -> None:
        """Where DeepSpeed's Muon would not compute what `optimizer.name: muon` says, refused with the reason."""
        if self.optimizer.name != "muon":
            return
        why, fix = None, "use train.optimizer.name=adamw"
        if self.engine.zero_stage == 3 and self.init_from.startswith("hf:"):
            why = ("ZeRO-3 with a base model (built under zero.Init, where DeepSpeed's own Muon tagging reads the "
                   "partitioned 1-D shapes and silently trains every parameter with AdamW; not verified here)")
        elif self.engine.zero_stage >= 1 and self.optimizer.grad_clip > 0:
            why = (f"train.optimizer.grad_clip={self.optimizer.grad_clip} under ZeRO-{self.engine.zero_stage}: DeepSpeed's "
                   "ZeRO optimizers put Muon's orthogonalised update where the gradient was before they take the "
                   "clipping norm (stage_1_and_2.py get_flat_partition, stage3.py _apply_muon_to_accumulated_grads), "
                   "so clipping shrinks every Muon step by that norm instead of bounding a gradient")
            fix = ("set train.optimizer.grad_clip=0 (Muon's update has a fixed size; ZeRO-0 clips the raw gradients "
                   "and may keep it)")
        if why:
            raise ValueError(f"train.optimizer.name=muon with {why}; {fix}")

    @property
    def model_arch(self) -> ModelConfig:
        """The architecture a run trains: `model`, plus the experts `moe` gives (ModelConfig.moe). A checkpoint's
        model_config.json holds it, so evaluate and export rebuild the experts; `model` itself when dense."""
        m = self.moe
        if not m.num_experts:
            return self.model
        return self.model.model_copy(update={"moe": MoEArch(num_experts=m.num_experts, top_k=m.top_k, every=m.every)})

    @property
    def horizon(self) -> int:
        """Step at which the cosine reaches min_lr: `optimizer.decay_steps`, or `max_steps` when that is null."""
        return self.optimizer.decay_steps or self.max_steps

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return self.batch.micro_batch_size * self.batch.grad_accum * self.dp

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks left after tensor, pipeline and sequence parallelism."""
        return self.batch.num_ranks // self.parallel.model_parallel

    @property
    def decay_start(self) -> int:
        """First step of the decay: the end of warmup for `cosine`; for `wsd` the end of the stable phase,
        horizon - round(decay_fraction·horizon), at least warmup_steps."""
        opt = self.optimizer
        if opt.schedule == "cosine":
            return opt.warmup_steps
        return max(opt.warmup_steps, self.horizon - round(opt.decay_fraction * self.horizon))

    def lr_at(self, step: int) -> float:
        """Learning rate of update `step` (0-based): linear warmup, lr until `decay_start` (wsd), the decay to
        min_lr at `horizon` (cosine, or wsd's `decay_shape`), then flat."""
        opt = self.optimizer
        if step < opt.warmup_steps:
            return opt.lr * (step + 1) / (opt.warmup_steps + 1)
        if step >= self.horizon:
            return opt.min_lr
        start = self.decay_start
        if step < start:
            return opt.lr
        p = (step - start) / (self.horizon - start)
        shape = "cosine" if opt.schedule == "cosine" else opt.decay_shape
        keep = {"linear": 1.0 - p, "sqrt": 1.0 - math.sqrt(p), "cosine": 0.5 * (1.0 + math.cos(math.pi * p))}[shape]
        return opt.min_lr + keep * (opt.lr - opt.min_lr)

    def run_key(self) -> dict:
        """The config part of the run fingerprint: every field that is not operational (`is_operational`), with
        the cosine horizon resolved (decay_steps null and max_steps N give the key of decay_steps N)."""
        fields = type(self).model_fields
        key = self.model_dump(mode="json", exclude={name for name, f in fields.items() if is_operational(f)})
        key["optimizer"]["decay_steps"] = self.horizon
        return key
