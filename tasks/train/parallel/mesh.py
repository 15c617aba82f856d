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
