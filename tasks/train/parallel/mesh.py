"""The rank grid: pp × dp × sp × tp, tp innermost.

This is Megatron's order and DeepSpeed's (`PipeModelDataParallelTopology` lays ranks out as pipe, data, model),
with Ulysses' sequence axis between data and tensor: ranks that talk most (tp, then sp) are neighbours, so on a
node they share the fastest links. `Grid` is pure arithmetic (the CLI, the planner and the tests use it without
torch); `Mesh` creates the torch.distributed groups of a grid and answers DeepSpeed's `mpu` questions
(`deepspeed.initialize(mpu=...)`: data-parallel group for gradient reduction and ZeRO partitioning,
model-parallel rank for checkpoint file names, sequence-parallel group for Ulysses).

Every rank must create every group, in the same order (`torch.distributed.new_group` is collective over the
whole world), even the groups it is not in.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import product

AXES = ("pp", "dp", "sp", "tp")  # outermost first


@dataclass(frozen=True)
class Grid:
    """Degrees of the four axes. rank = ((pp_i·dp + dp_i)·sp + sp_i)·tp + tp_i."""

    pp: int = 1
    dp: int = 1
    sp: int = 1
    tp: int = 1

    @classmethod
    def of(cls, cfg) -> "Grid":
        """The grid of a TrainConfig (lifecycle.tasks.train.config)."""
        return cls(pp=cfg.parallel.pp, dp=cfg.dp, sp=cfg.parallel.sp, tp=cfg.parallel.tp)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.sp * self.tp

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def coords(self, rank: int) -> dict[str, int]:
        """{axis: index} of a rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a world of {self.world} ({self})")
        out = {}
        for axis in reversed(AXES):
            n = getattr(self, axis)
            out[axis] = rank % n
            rank //= n
        return {a: out[a] for a in AXES}

    def rank(self, **coords: int) -> int:
        r = 0
        for axis in AXES:
            r = r * getattr(self, axis) + coords.get(axis, 0)
        return r

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group of ranks that differ only along `axes` (the others fixed), in a fixed order: the same
        list on every rank, as `new_group` needs."""
        unknown = set(axes) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; the grid has {AXES}")
        fixed = [a for a in AXES if a not in axes]
        out = []
        for kept in product(*(range(getattr(self, a)) for a in fixed)):
            base = dict(zip(fixed, kept))
            out.append(sorted(self.rank(**base, **dict(zip(axes, vary)))
                              for vary in product(*(range(getattr(self, a)) for a in axes))))
        return out

    def group_of(self, rank: int, *axes: str) -> list[int]:
        """The ranks of `rank`'s group along `axes`."""
        return next(g for g in self.groups(*axes) if rank in g)

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES)


RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """One way to run a model, the one type the config, the trainer, the planner and the checkpoints share:
    parallel degrees (the rank `grid`, plus ep: expert-parallel ranks inside dp), ZeRO stage, micro-batch and
    gradient accumulation, recomputation and optimizer offload.

    `describe()` is its one written form (`dp=2,zero=2,micro=8,accum=1`, then each degree above 1 and each
    option on), used in train.log, the MLflow tag, the planner's output and error messages; `as_dict()` its
    form in a checkpoint's marker (the same keys)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    """Ulysses sequence parallelism: the sequence is split over sp ranks (all-to-all around attention)."""
    ep: int = 1
    zero: int = 0
    micro_batch: int = 1
    accum: int = 1
    recompute: str = "none"
    """none, selective (attention's inner activations recomputed) or full (each block's input kept)."""
    offload: bool = False
    """ZeRO-Offload: optimizer states and the fp32 step on the CPU (ZeRO stage >= 1)."""
    tp_sequence_parallel: bool = True
    """Megatron sequence parallelism inside the tp group (Korthikanti et al.): the layer norms' and dropouts'
    activations are split over t too."""

    @classmethod
    def of(cls, cfg) -> "Layout":
        """The layout a TrainConfig (lifecycle.tasks.train.config) runs under."""
        ac = cfg.engine.activation_checkpointing
        recompute = "selective" if ac == "selective" else "full" if ac else "none"
        return cls(dp=cfg.dp, tp=cfg.parallel.tp, pp=cfg.parallel.pp, sp=cfg.parallel.sp, ep=cfg.moe.ep,
                   zero=cfg.engine.zero_stage, micro_batch=cfg.batch.micro_batch_size, accum=cfg.batch.grad_accum,
                   recompute=recompute, tp_sequence_parallel=cfg.parallel.tp_sequence_parallel)

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    @property
    def grid(self) -> Grid:
        return Grid(pp=self.pp, dp=self.dp, sp=self.sp, tp=self.tp)

    def as_dict(self) -> dict:
        """{dp, zero, micro, accum}, plus tp/pp/sp/ep when above 1, `ac` when recomputing (1: full) and `offload`
        when on: a data-parallel layout reads as it did before the other axes existed."""
        out: dict = {"dp": self.dp, "zero": self.zero, "micro": self.micro_batch, "accum": self.accum}
        out.update({axis: n for axis, n in (("tp", self.tp), ("pp", self.pp), ("sp", self.sp), ("ep", self.ep))
                    if n != 1})
        if self.recompute != "none":
            out["ac"] = 1 if self.recompute == "full" else self.recompute
        if self.offload:
            out["offload"] = "cpu"
        if self.tp > 1 and self.tp_sequence_parallel:
            out["tpsp"] = 1
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        ac = d.get("ac")
        return cls(dp=d["dp"], tp=d.get("tp", 1), pp=d.get("pp", 1), sp=d.get("sp", 1), ep=d.get("ep", 1),
                   zero=d["zero"], micro_batch=d["micro"], accum=d["accum"], offload=d.get("offload") == "cpu",
                   recompute="none" if not ac else "full" if ac == 1 else str(ac),
                   tp_sequence_parallel=bool(d.get("tpsp")))

    def describe(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.as_dict().items())

    def set_lines(self) -> list[str]:
        """The `--set` overrides that run this layout (what `lifecycle plan layout` prints)."""
        return [f"train.batch.num_ranks={self.ranks}", f"train.parallel.tp={self.tp}", f"train.parallel.pp={self.pp}",
                f"train.parallel.sp={self.sp}",
                f"train.parallel.tp_sequence_parallel={str(self.tp > 1 and self.tp_sequence_parallel).lower()}",
                f"train.engine.zero_stage={self.zero}",
                f"train.batch.micro_batch_size={self.micro_batch}", f"train.batch.grad_accum={self.accum}",
                "train.engine.activation_checkpointing="
                + {"none": "false", "full": "true", "selective": "selective"}[self.recompute]]


class Mesh:
    """The torch.distributed groups of a Grid for this rank, and DeepSpeed's mpu interface over them.

    DeepSpeed's "model parallel" is tensor parallelism; its "data parallel" group is the one gradients are
    averaged and ZeRO partitions over. With Ulysses, gradients are averaged over dp × sp (the sp ranks see
    different tokens of the same sequences), which DeepSpeed asks for as the sequence-data-parallel group."""

    def __init__(self, grid: Grid, rank: int):
        import torch.distributed as dist

        if dist.get_world_size() != grid.world:
            raise RuntimeError(f"the grid {grid} needs {grid.world} ranks, the process group has "
                               f"{dist.get_world_size()}")
        self.grid, self.global_rank = grid, rank
        self.coords = grid.coords(rank)
        self._groups: dict[tuple[str, ...], object] = {}
        for axes in (("tp",), ("sp",), ("dp",), ("pp",), ("dp", "sp"), ("pp", "tp"), ("sp", "tp")):
            for ranks in grid.groups(*axes):  # collective: every rank creates every group
                g = dist.new_group(ranks)  # a group of one too: `group=None` would mean the whole world
                if rank in ranks:
                    self._groups[axes] = (g, ranks)

    def group(self, *axes: str):
        """(process group, its ranks) of this rank along `axes`."""
        return self._groups[tuple(axes)]

    def _rank_in(self, *axes: str) -> int:
        return self._groups[tuple(axes)][1].index(self.global_rank)

    def _size(self, *axes: str) -> int:
        return len(self._groups[tuple(axes)][1])

    @cached_property
    def dp_rank(self) -> int:
        """The data shard this rank reads: equal across a tp/sp/pp group."""
        return self.coords["dp"]

    # DeepSpeed's mpu interface (deepspeed.utils.groups, runtime.engine)
    def get_data_parallel_group(self):
        return self._groups[("dp",)][0]

    def get_data_parallel_rank(self) -> int:
        return self._rank_in("dp")

    def get_data_parallel_world_size(self) -> int:
        return self._size("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._groups[("dp",)][1])

    def get_model_parallel_group(self):
        return self._groups[("tp",)][0]

    def get_model_parallel_rank(self) -> int:
        return self._rank_in("tp")

    def get_model_parallel_world_size(self) -> int:
        return self._size("tp")

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._groups[("tp",)][1][0]

    def get_pipe_parallel_group(self):
        return self._groups[("pp",)][0]

    def get_pipe_parallel_rank(self) -> int:
        return self._rank_in("pp")

    def get_pipe_parallel_world_size(self) -> int:
        return self._size("pp")

    def get_sequence_parallel_group(self):
        return self._groups[("sp",)][0]

    def get_sequence_parallel_rank(self) -> int:
        return self._rank_in("sp")

    def get_sequence_parallel_world_size(self) -> int:
        return self._size("sp")

    def get_sequence_data_parallel_group(self):
        return self._groups[("dp", "sp")][0]

    def get_sequence_data_parallel_rank(self) -> int:
        return self._rank_in("dp", "sp")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._size("dp", "sp")
