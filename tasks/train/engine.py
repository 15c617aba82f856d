"""A rank's DeepSpeed engine: the process group, then the model (the same initial weights on every rank), laid out
by the run's `Parallelism`, with AdamW (or DeepSpeed's Muon with AdamW beside it) and the learning-rate schedule.
Also what keeps a rank's start-up short: MLflow kept out of `import deepspeed`, DeepSpeed's Muon modules stubbed
when Muon is off."""

from __future__ import annotations

import importlib
import os
import sys
import time
from dataclasses import dataclass

import torch

from lifecycle.core.fs import atomic_write_json
from lifecycle.tasks.train.config import ModelConfig, TrainConfig
from lifecycle.tasks.train.distributed import select_device
from lifecycle.tasks.train.model import GPT
from lifecycle.tasks.train.timeline import Timeline


def ds_config(cfg: TrainConfig) -> dict:
    """DeepSpeed config. The optimizer (torch AdamW) and the LambdaLR schedule are built in `build_engine`."""
    return {
        "train_batch_size": cfg.global_batch,
        "train_micro_batch_size_per_gpu": cfg.batch.micro_batch_size,
        "gradient_accumulation_steps": cfg.batch.grad_accum,
        "gradient_clipping": cfg.optimizer.grad_clip,
        # DeepSpeed's ZeRO-3 runs Muon only with the gradients all-reduced, not reduce-scattered (stage3.py)
        "zero_optimization": {"stage": cfg.engine.zero_stage,
                              **({"reduce_scatter": False} if cfg.optimizer.name == "muon" and cfg.engine.zero_stage == 3
                                 else {})},
        "bf16": {"enabled": cfg.engine.precision == "bf16",
                 **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                    if cfg.engine.optimizer_states == "bf16" else {})},
        "zero_allow_untested_optimizer": True,  # our torch.optim.AdamW: no DeepSpeed optimizer op to JIT-build
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
    }


def stub_muon() -> None:
    """DeepSpeed 0.19's ZeRO and bf16 optimizers import its Muon modules (only to run isinstance checks
    when Muon is not in use), and those modules' @torch.compile decorators import inductor: seconds of CPU
    per rank on every launch (bench.launch_overhead measures the start-up). Unless `train.optimizer.name` is muon,
    register stand-ins first: a class nothing is an instance of, and an update function that refuses to run."""
    import types

    def muon_update(*args, **kwargs):
        raise RuntimeError("Muon is stubbed out in lifecycle.tasks.train.engine; this run trains with AdamW")

    for name, attrs in (("deepspeed.runtime.zero.muon.original_muon", {"muon_update": muon_update}),
                        ("deepspeed.runtime.zero.muon.muon_optimizer",
                         {"MuonWithAuxAdam": type("MuonWithAuxAdam", (), {})})):
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name, "stand-in registered by lifecycle.tasks.train.engine.stub_muon")
            vars(sys.modules[name]).update(attrs)


def keep_mlflow_out() -> None:
    """DeepSpeed 0.19's `import deepspeed` reaches its autotuner, which imports MLflow when it is installed
    (`try: import mlflow` in deepspeed/autotuning/autotuner.py), and MLflow brings pandas and its GenAI modules:
    most of `import deepspeed` in each rank (bench/launch_overhead.py). A rank never autotunes and never logs to
    MLflow (the supervisor forwards metrics.jsonl), so make that import fail: with `sys.modules["mlflow"] = None`
    it raises ImportError, which DeepSpeed catches (`has_mlflow = False`). Left alone where MLflow is loaded."""
    sys.modules.setdefault("mlflow", None)


def init_distributed(cfg: TrainConfig, timeline: Timeline) -> tuple[torch.device, str]:
    """Import DeepSpeed (without MLflow or Muon) and join the process group; (device, backend)."""
    keep_mlflow_out()
    import deepspeed

    timeline.phase("import deepspeed")
    # DeepSpeed loads its CPU comm op while it creates the process group: the benchmark times it apart
    timeline.time_shm_op(importlib.import_module("deepspeed.comm.torch"))  # `import a.b.torch as x` gives torch
    if cfg.optimizer.name != "muon":  # the real modules with Muon on (their import costs seconds)
        stub_muon()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device, backend = select_device(cfg)
    deepspeed.init_distributed(dist_backend=backend)
    timeline.phase("process group init")
    return device, backend


@dataclass
class Built:
    """The engine and what the trainer reports of the model it wraps."""
    engine: object
    scheduler: object
    model_cfg: ModelConfig  # train.model, plus the experts of train.moe
    n_params: int  # every parameter, before ZeRO-3 partitions them
    n_matmul: int  # the non-embedding parameters MFU counts
    flops_per_token: int


def initial_model(cfg: TrainConfig, launch: dict, rank: int, say) -> GPT:
    """The same initial weights on every rank: seeded, or a Hugging Face base model's, or a warm start's."""
    import deepspeed

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    base = launch.get("base_model")
    if base and cfg.engine.zero_stage == 3:  # each rank holds only its partition of the base model's weights
        with deepspeed.zero.Init(config_dict_or_path=ds_config(cfg)):
            model = GPT(cfg.model)
    else:
        model = GPT(cfg.model_arch)
    if base:  # continue a Hugging Face checkpoint (a resume overwrites these with the checkpoint's)
        from lifecycle.tasks.train import hf_import

        hf_import.load_weights(model, base, gathered=cfg.engine.zero_stage == 3, rank=rank)
        say(f"loaded the weights of {base}")
    if launch.get("init_weights"):  # warm start; a resume overwrites these with the checkpoint's
        from safetensors.torch import load_file

        model.load_export(load_file(launch["init_weights"]))
    if attention(launch) == "document":  # block-causal attention and positions per document (model.documents)
        model.doc_sep = int(launch["tokens"]["eot_id"])
    return model


def attention(launch: dict) -> str:
    """The run's `model.attention`: the launch file's, or `packed` when its config.json predates the field (a run
    started before document-aware attention existed resumes as it was trained)."""
    return launch["train"].get("model", {}).get("attention", "packed")


def adamw_optimizer(cfg: TrainConfig, model, par) -> torch.optim.Optimizer:
    """torch AdamW: weight decay on matrices, none on norms and biases (MoE experts grouped by `par`)."""
    opt = cfg.optimizer
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # on a GPU, the fused AdamW kernel (one launch for every tensor) as DeepSpeed's client optimizer
    fused = {"fused": True} if par.device.type == "cuda" else {}
    return torch.optim.AdamW(par.param_groups(groups), lr=opt.lr, betas=opt.betas, **fused)


def muon_optimizer(cfg: TrainConfig, model, par=None) -> torch.optim.Optimizer:
    """DeepSpeed's MuonWithAuxAdam as the client optimizer: Muon on the blocks' 2-D weights, AdamW (DeepSpeed's
    inline update) on the embeddings, head, norms and biases. Each parameter carries `use_muon`, which DeepSpeed's
    ZeRO optimizers read to orthogonalise the whole matrix before partitioning its update; the tagging is ours
    (by the layer's shape and our module names, a pipeline stage's mapped to GPT's), since DeepSpeed's own reads
    names with "embed"/"lm_head". MoE experts (`par`'s groups apart) are 2-D matrices held whole on their ep rank,
    each orthogonalised on its own as any other Muon matrix (DeepSpeed's MoE layer sets no `is_expert_group`)."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    from lifecycle.tasks.train.sizing import uses_muon

    opt = cfg.optimizer
    hidden, matrices, flat = [], [], []
    dense = model.dense_names() if hasattr(model, "dense_names") else {}  # a pipeline stage's GPT names
    for name, p in model.named_parameters():
        name = dense.get(name, name)
        shape = tuple(getattr(p, "ds_shape", p.shape))  # a layer's shape also under ZeRO-3's partitioning
        p.use_muon = uses_muon(name, shape)
        (hidden if p.use_muon else matrices if len(shape) >= 2 else flat).append(p)
    groups = [{"params": hidden, "use_muon": True, "lr": opt.muon_lr, "momentum": opt.muon_momentum,
               "weight_decay": opt.weight_decay},
              {"params": matrices, "use_muon": False, "lr": opt.lr, "betas": opt.betas, "eps": 1e-8,
               "weight_decay": opt.weight_decay},
              {"params": flat, "use_muon": False, "lr": opt.lr, "betas": opt.betas, "eps": 1e-8, "weight_decay": 0.0}]
    if par is not None:
        groups = par.param_groups(groups)
    optimizer = MuonWithAuxAdam([g for g in groups if g["params"]], adam_optimizer=None, adam_w_mode=True)
    if getattr(model, "tp", None) is not None:  # tp slices: Newton-Schulz of the whole matrices (muon_tp)
        from lifecycle.tasks.train import muon_tp

        muon_tp.tag(model)
    return optimizer


def build_engine(cfg: TrainConfig, launch: dict, par, rank: int, run_dir, say, t_start: float) -> Built:
    """The model laid out by `par` (a `Parallelism`), AdamW or Muon with the schedule, and the DeepSpeed
    engine over them. Rank 0 writes the DeepSpeed config it used beside the run."""
    import deepspeed

    model = par.prepare(initial_model(cfg, launch, rank, say))
    model.to(par.device)
    model.activation_checkpointing = cfg.engine.activation_checkpointing
    n_params = model.num_params()  # before ZeRO-3 partitions the parameters
    n_matmul, flops_per_token = model.num_params(exclude_embeddings=True), model.flops_per_token()
    model = par.wrap_model(model)
    opt = cfg.optimizer
    optimizer = muon_optimizer(cfg, model, par) if opt.name == "muon" else adamw_optimizer(cfg, model, par)
    schedule = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: cfg.lr_at(s) / opt.lr)  # noqa: E731
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                                   config=ds_config(cfg), mpu=par.mesh)
    if rank == 0:
        atomic_write_json(run_dir / "ds_config.json", ds_config(cfg))
    if cfg.engine.compiled and par.compiles:  # compiled lazily, at the first forward
        from deepspeed.accelerator import get_accelerator

        backend = get_accelerator().get_compile_backend()
        engine.compile(backend=backend)
        say(f"model compiled with torch.compile (backend {backend}; kernels built at the first step)")
    say(f"{n_params:,} parameters, ranks ready after {time.time() - t_start:.1f}s")
    arch = cfg.model_arch.model_copy(update={"attention": attention(launch)})
    return Built(engine, scheduler, arch, n_params, n_matmul, flops_per_token)
