"""The layout search (`lifecycle plan layout`, `train.layout: auto`): every candidate layout of a model on N
ranks, its memory (lifecycle.tasks.train.planner.memory) and step time (lifecycle.tasks.train.step_time), the
fitting ones first, fastest first. Torch-free."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from lifecycle.tasks.train.config import ModelConfig
from lifecycle.tasks.train.parallel.mesh import RECOMPUTE, Layout
from lifecycle.tasks.train.planner import GiB, Estimate, gib, memory, parse_bytes
from lifecycle.tasks.train.step_time import Hardware, step_time


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=4096)
def trainer_refusal(m: ModelConfig, tp: int, pp: int, sp: int, zero: int, recompute: str,
                    optimizer: str = "adamw") -> str | None:
    """Why the trainer refuses this combination (lifecycle.tasks.train.parallel.rules), None when it runs it;
    the batch does not matter to the rules, so one rank per model-parallel group stands for any dp."""
    from lifecycle.tasks.train.config import TrainConfig
    from lifecycle.tasks.train.parallel import rules

    ac = {"none": False, "full": True, "selective": "selective"}[recompute]
    model = m.model_dump()
    experts = model.pop("moe", None) or {}  # a training config sets its experts in train.moe (MoEConfig)
    try:
        cfg = TrainConfig.model_validate({
            "model": model, "batch": {"num_ranks": tp * pp * sp}, "parallel": {"tp": tp, "pp": pp, "sp": sp},
            "engine": {"zero_stage": zero, "activation_checkpointing": ac}, "moe": experts,
            "optimizer": {"name": optimizer, **({"grad_clip": 0.0} if optimizer == "muon" else {})}})
    except ValueError as e:
        return str(e)
    return rules.refusal(cfg)


def tp_seq_runs(m: ModelConfig, tp: int, pp: int) -> bool:
    """Whether the trainer runs Megatron sequence parallelism in this layout (parallel.rules.tp)."""
    return tp > 1 and pp == 1 and m.seq_len % tp == 0


def candidates(m: ModelConfig, gpus: int, global_batch: int, hw: Hardware, *, tps=None, pps=None, sps=None,
               zeros=(0, 1, 2, 3), recomputes=RECOMPUTE, offloads=(False,), micro_batches=None,
               trainer_only: bool = True, optimizer: str = "adamw"):
    """Every layout the search considers: tp within a node and dividing the heads, sp dividing the heads
    left, pp dividing the layers, dp the rest; ZeRO-2/3 not under pp (DeepSpeed's pipeline engine runs
    ZeRO-0/1 only); offload only with ZeRO >= 1; micro-batches dividing the per-replica batch. `trainer_only`:
    only what this trainer runs (`trainer_refusal` is None; it has no optimizer offload, and it runs Megatron's
    sequence parallelism inside tp groups without pipeline stages, `tp_seq_runs`)."""
    for tp in tps or [d for d in divisors(min(hw.gpus_per_node, gpus)) if m.n_head % d == 0]:
        for sp in sps or [d for d in divisors(gpus // tp) if (m.n_head // tp) % d == 0 and d <= hw.gpus_per_node]:
            for pp in pps or [d for d in divisors(gpus // (tp * sp)) if d <= m.n_layer]:
                dp = gpus // (tp * sp * pp)
                if dp * tp * sp * pp != gpus or global_batch % dp:
                    continue
                for zero, rc, off in itertools.product(zeros, recomputes, offloads):
                    if (pp > 1 and zero >= 2) or (off and zero == 0):
                        continue
                    if trainer_only and (off or trainer_refusal(m, tp, pp, sp, zero, rc, optimizer) is not None):
                        continue
                    for b in micro_batches or [d for d in divisors(global_batch // dp) if d <= 64]:
                        yield Layout(dp=dp, tp=tp, pp=pp, sp=sp, zero=zero, micro_batch=b, accum=global_batch // (dp * b),
                                     recompute=rc, offload=off,
                                     tp_sequence_parallel=not trainer_only or tp_seq_runs(m, tp, pp))


@dataclass(frozen=True)
class Option:
    layout: Layout
    memory: Estimate
    time: dict
    fits: bool

    def as_dict(self) -> dict:
        return {**self.memory.as_dict(), "fits": self.fits, "step_time": {k: round(x, 6) for k, x in self.time.items()}}


def search(m: ModelConfig, gpus: int, gpu_memory: float, global_batch: int, hw: Hardware = Hardware(),
           precision: str = "bf16", seq_len: int | None = None, device: str = "cuda", optimizer: str = "adamw",
           **space) -> list[Option]:
    """All candidate layouts, the fitting ones first, fastest first (ties: bigger micro-batch, lower ZeRO stage,
    no offload, less recomputation). `optimizer`: adamw or muon (its states, and the layouts it runs under)."""
    out = []
    for lay in candidates(m, gpus, global_batch, hw, optimizer=optimizer, **space):
        mb = global_batch // (lay.dp * lay.micro_batch)
        est = memory(m, lay, precision, seq_len, micro_batches=mb, device=device, optimizer=optimizer)
        t = step_time(m, lay, global_batch, hw, precision, seq_len)
        out.append(Option(lay, est, t, est.total_bytes <= gpu_memory - hw.reserve_bytes))
    out.sort(key=lambda o: (not o.fits, round(o.time["step_s"], 9), -o.layout.micro_batch, o.layout.zero,
                            o.layout.offload, RECOMPUTE.index(o.layout.recompute), o.layout.tp, o.layout.pp))
    return out


def runners_up(options: list[Option], n: int) -> list[Option]:
    """The fastest fitting option of each distinct (tp, pp, sp, ZeRO stage, offload), fastest first."""
    seen, out = set(), []
    for o in options:
        key = (o.layout.tp, o.layout.pp, o.layout.sp, o.layout.zero, o.layout.offload)
        if o.fits and key not in seen:
            seen.add(key)
            out.append(o)
        if len(out) == n:
            break
    return out


# --------------------------------------------------------------------------------------------------
# `train.layout: auto`


def rank_memory(cfg) -> tuple[float, str]:
    """(bytes per rank, where the figure comes from) for `train.layout: auto`."""
    import subprocess

    if cfg.layout_memory:
        return parse_bytes(cfg.layout_memory), "train.layout_memory"
    if cfg.engine.accelerator == "cuda":
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode or not out.stdout.strip():
            raise RuntimeError("train.layout=auto: nvidia-smi could not tell the GPU memory; set train.layout_memory")
        return float(out.stdout.split()[0]) * 2**20, "nvidia-smi memory.total"
    from lifecycle.core.procs import mem_available

    if (avail := mem_available()) is None:
        raise RuntimeError("train.layout=auto: /proc/meminfo gives no MemAvailable; set train.layout_memory")
    n = cfg.batch.num_ranks
    return avail / 2 / n, f"half of MemAvailable {avail / GiB:.1f} GiB over {n} ranks"


def _auto_hardware(cfg) -> Hardware:
    """The constants `train.layout: auto` plans with: an H100 node on cuda; on cpu a flat MFU (the matmul-shape
    model is a GPU's) and the loopback's bandwidths."""
    n, cuda = cfg.batch.num_ranks, cfg.engine.accelerator == "cuda"
    return Hardware(peak_flops=cfg.logging.peak_flops_per_rank or (989e12 if cuda else 1e11), mfu=None if cuda else 0.45,
                    gpus_per_node=n if cfg.launch.hostfile is None else Hardware().gpus_per_node,
                    **({} if cuda else {"intra_node_bw": 5e9, "inter_node_bw": 1e9, "reserve_bytes": 0.0}))


def apply_layout(cfg, lay: Layout):
    """`cfg` run under `lay` (same ranks and global batch), validated again."""
    from lifecycle.tasks.train.config import TrainConfig

    data = cfg.model_dump()
    data["layout"] = "fixed"
    data["parallel"] = {**data["parallel"], "tp": lay.tp, "pp": lay.pp, "sp": lay.sp,
                        "tp_sequence_parallel": lay.tp > 1 and lay.tp_sequence_parallel}
    data["batch"] = {**data["batch"], "micro_batch_size": lay.micro_batch, "grad_accum": lay.accum}
    ac = {"none": False, "full": True, "selective": "selective"}[lay.recompute]
    data["engine"] = {**data["engine"], "zero_stage": lay.zero, "activation_checkpointing": ac}
    return TrainConfig.model_validate(data).model_copy(update={"layout": cfg.layout})


def resolve_layout(cfg, memory_bytes: float | None = None):
    """`train.layout: auto`: the TrainConfig with the layout the search finds fastest among those that fit its
    ranks and per-rank memory (tp, pp, sp, ZeRO stage, micro-batch with grad_accum following, recomputation;
    only what the trainer runs), keeping the ranks and the global batch; and a sentence saying what was chosen
    and why."""
    if cfg.layout != "auto":
        return cfg, None
    source = "argument"
    if memory_bytes is None:
        memory_bytes, source = rank_memory(cfg)
    n, gb = cfg.batch.num_ranks, cfg.global_batch
    precision = "bf16-states" if cfg.engine.optimizer_states == "bf16" else cfg.engine.precision
    opts = search(cfg.model, n, memory_bytes, gb, _auto_hardware(cfg), precision,
                  device="cuda" if cfg.engine.accelerator == "cuda" else "cpu", optimizer=cfg.optimizer.name)
    fitting = [o for o in opts if o.fits]
    if not fitting:
        if not opts:
            raise ValueError(f"train.layout=auto: no layout of {n} ranks keeps the global batch of {gb}")
        small = min(opts, key=lambda o: o.memory.total_bytes)
        raise ValueError(f"train.layout=auto: no layout of {n} ranks fits {gib(memory_bytes)} per rank "
                         f"({source}); the smallest, {small.layout.describe()}, needs {gib(small.memory.total_bytes)}")
    best = fitting[0]
    nxt = next((o for o in fitting[1:] if o.layout != best.layout), None)
    why = (f"train.layout=auto: {n} ranks x {gib(memory_bytes)} ({source}), global batch {gb}: "
           f"{best.layout.describe()}; predicted {gib(best.memory.total_bytes)} per rank (model states "
           f"{gib(best.memory.model_states_bytes)}, activations {gib(best.memory.activation_bytes)}) and "
           f"{best.time['step_s']:.3g} s per step, the fastest of {len(fitting)} of {len(opts)} layouts that fit"
           + (f"; next: {nxt.layout.describe()} at {nxt.time['step_s']:.3g} s" if nxt else ""))
    return apply_layout(cfg, best.layout), why
