"""The rank grid (lifecycle.tasks.train.parallel.mesh) and the parallel config sections."""

from __future__ import annotations

import pytest

from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.parallel.mesh import Grid


def test_ranks_are_laid_out_pipe_data_sequence_tensor_with_tensor_innermost():
    g = Grid(pp=2, dp=2, sp=1, tp=2)
    assert g.world == 8
    assert [g.coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [g.coords(r)["dp"] for r in range(8)] == [0, 0, 1, 1] * 2
    assert [g.coords(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4
    assert all(g.rank(**g.coords(r)) == r for r in range(8))
    with pytest.raises(ValueError, match="outside a world of 8"):
        g.coords(8)


def test_groups_partition_the_world_along_each_axis():
    g = Grid(pp=2, dp=3, sp=2, tp=2)
    for axes in (("tp",), ("sp",), ("dp",), ("pp",), ("dp", "sp"), ("pp", "tp")):
        groups = g.groups(*axes)
        size = 1
        for a in axes:
            size *= getattr(g, a)
        assert all(len(x) == size for x in groups)
        assert sorted(r for x in groups for r in x) == list(range(g.world))  # a partition
        for x in groups:  # members differ only along `axes`
            fixed = [a for a in ("pp", "dp", "sp", "tp") if a not in axes]
            assert len({tuple(g.coords(r)[a] for a in fixed) for r in x}) == 1
    assert g.groups("tp")[0] == [0, 1] and g.group_of(5, "dp") == [1, 5, 9]
    with pytest.raises(ValueError, match="unknown axes"):
        g.groups("ep")


def test_grid_of_a_config_takes_dp_from_the_ranks_left():
    cfg = TrainConfig.model_validate({"batch": {"num_ranks": 2}})
    assert Grid.of(cfg) == Grid(dp=2) and cfg.dp == 2 and cfg.global_batch == 16 * 2


@pytest.mark.parametrize("over, message", [
    ({"batch": {"num_ranks": 3}, "parallel": {"tp": 2}}, "must be a multiple of train.parallel"),
    ({"batch": {"num_ranks": 2}, "parallel": {"pp": 2}}, "pipeline engine runs ZeRO-0 and ZeRO-1 only"),
    ({"moe": {"num_experts": 4}, "engine": {"zero_stage": 3}}, "train.moe.num_experts=4"),
    ({"batch": {"num_ranks": 4}, "parallel": {"tp": 2, "pp": 2}, "engine": {"zero_stage": 2}},
     "pipeline engine runs ZeRO-0 and ZeRO-1 only"),  # tp x pp composes (issue 45), with ZeRO-0/1
    ({"batch": {"num_ranks": 4}, "parallel": {"tp": 2, "sp": 2}, "engine": {"zero_stage": 1},
      "model": {"n_head": 4, "dropout": 0.0}}, "Ulysses sequence parallelism inside a tp group is not built"),
])
def test_parallel_layouts_the_trainer_cannot_run_are_refused_when_the_config_is_built(over, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.model_validate(over)


def _mesh_worker(rank: int, world: int, init: str, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    from lifecycle.tasks.train.parallel.mesh import Mesh

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = Mesh(Grid(pp=1, dp=2, sp=1, tp=2), rank)
    got = {}
    for name, group in (("tp", mesh.get_model_parallel_group()), ("dp", mesh.get_data_parallel_group()),
                        ("sp", mesh.get_sequence_parallel_group()), ("world", None)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        got[name] = t.item()
    got["ranks"] = [mesh.get_data_parallel_rank(), mesh.get_model_parallel_rank(), mesh.dp_rank,
                    mesh.get_sequence_data_parallel_world_size()]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()


def test_mesh_groups_reduce_over_their_own_ranks_only(tmp_path):
    """Four gloo ranks as dp=2 × tp=2: a sum over the tp group adds the two neighbours, over the dp group the
    two ranks one tp position apart, and a group of one (sp) leaves the value alone (None would be the world)."""
    import json

    import torch.multiprocessing as mp

    out = str(tmp_path / "r")
    mp.spawn(_mesh_worker, args=(4, f"file://{tmp_path / 'store'}", out), nprocs=4, join=True)
    got = [json.loads(open(f"{out}.{r}").read()) for r in range(4)]
    assert [g["tp"] for g in got] == [1, 1, 5, 5]
    assert [g["dp"] for g in got] == [2, 4, 2, 4]
    assert [g["sp"] for g in got] == [0, 1, 2, 3]
    assert [g["world"] for g in got] == [6] * 4
    assert [g["ranks"] for g in got] == [[0, 0, 0, 2], [0, 1, 0, 2], [1, 0, 1, 2], [1, 1, 1, 2]]
