"""The run's parallel layout as one object, built once from the config (as torchtitan's `parallelize_fn`): the
trainer asks it to lay the model out and to run a step's forward and backward passes and an evaluation, and its
step then reads the same under every layout. Each strategy's mechanics stay in its own module: `tp` (Megatron
tensor parallelism), `sp` (DeepSpeed-Ulysses sequence parallelism), `pp` (DeepSpeed's pipeline engine), `moe`
(DeepSpeed MoE experts over data-parallel ranks); `mesh` maps ranks to coordinates and process groups."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.distributed import DeviceValue, mean_over_ranks_async
from lifecycle.tasks.train.parallel import moe
from lifecycle.tasks.train.parallel.mesh import Grid, Mesh

Batch = tuple[torch.Tensor, torch.Tensor]


class Parallelism:
    """This rank's part of the layout: its coordinates (`grid`, `dp_rank`: the data shard, shared by a
    tp/sp/pp group), DeepSpeed's mpu for tp/sp (`mesh`; a pipeline engine builds its own groups and refuses an
    mpu), and the strategies the model and the step go through."""

    def __init__(self, cfg: TrainConfig, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.grid = Grid.of(cfg)
        self.dp_rank = self.grid.coords(rank)["dp"]
        # DeepSpeed's mpu for tp/sp; a pipeline engine makes its own groups from its topology (tp included)
        self.mesh = Mesh(self.grid, rank) if cfg.parallel.tp * cfg.parallel.sp > 1 and cfg.parallel.pp == 1 else None
        self.sp = None
        if cfg.parallel.sp > 1:
            from lifecycle.tasks.train.parallel.sp import SequenceParallel

            self.sp = SequenceParallel(self.mesh)
        self.pp, self.moe = cfg.parallel.pp > 1, bool(cfg.moe.num_experts)
        self.compiles = not self.pp  # torch.compile is refused with pipeline stages
        self.aux_sum = 0.0  # this step's MoE load-balancing losses (for the train record)

    # ---- the model

    def prepare(self, model):
        """Before the model moves to its device: sequence parallelism computes on this rank's slice."""
        return self.sp.wrap(model) if self.sp is not None else model

    def wrap_model(self, model):
        """This rank's part of the dense model: its pipeline stage, its tensor-parallel slices (of the dense
        initial weights: the same start as a single-rank run), its experts in DeepSpeed MoE layers."""
        cfg = self.cfg
        if self.pp:
            from lifecycle.tasks.train.parallel import pp

            model = pp.pipeline_module(model, cfg.parallel.pp, cfg.dp, cfg.engine.activation_checkpointing,
                                       tp=cfg.parallel.tp)  # its blocks split over tp by the stage itself
        elif cfg.parallel.tp > 1:
            from lifecycle.tasks.train.parallel.tp import TPGroup, shard_model

            model = shard_model(model, TPGroup.of(self.mesh), cfg.parallel.tp_sequence_parallel)
        if self.moe:  # expert-parallel groups made here
            for layer in moe.install(model, cfg):
                for p in layer.parameters() if self.pp else ():  # a stage's own: in ZeRO-0's norm (pp.pipeline_module)
                    p.model_parallel = True
        return model

    def param_groups(self, groups: list[dict]) -> list[dict]:
        """The optimizer's parameter groups (MoE experts apart, as DeepSpeed's MoE wants them)."""
        return moe.param_groups(groups) if self.moe else groups

    # ---- the step

    def begin_step(self, engine) -> None:
        self.aux_sum = 0.0
        if self.moe:  # the route counts and carried balancing losses of this step only
            moe.take_counts(engine.module)
            moe.take_carried_aux(engine.module)

    def forward_backward(self, engine, batch: Callable[[int], Batch], poison: bool = False) -> DeviceValue:
        """The step's grad_accum micro-batches (`batch(m)`) through the engine, which steps the optimizer on the
        last; returns the rank-averaged loss (the spike test needs it on every rank), still on its way from the
        device. `poison`: make the loss NaN (tests' fault injection)."""
        accum = self.cfg.batch.grad_accum
        if self.pp:  # the pipeline schedule takes the step's micro-batches at once
            from lifecycle.tasks.train.parallel import pp

            loss = pp.forward_backward(engine, [batch(m) for m in range(accum)], poison=poison)
            if self.moe:  # each stage's layers carried their balancing losses into backward (moe.AuxLossCarrier)
                self.aux_sum = moe.take_carried_aux(engine.module)
            return DeviceValue(torch.tensor(loss, dtype=torch.float64))
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for micro in range(accum):
            x, y = self._local(*batch(micro))
            _, loss = engine(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            if self.sp is not None:  # the full-sequence mean: the sp group's mean of the slice means
                loss = self.sp.loss(loss)
            if poison:
                loss = loss * float("nan")
            if (aux := moe.aux_loss(engine.module)) is not None:  # load balancing, beside the logged LM loss
                self.aux_sum += aux.item()
                engine.backward(loss + self.cfg.moe.aux_loss_weight * aux)
            else:
                engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().double()  # the float64 sum of the fp32 losses, in order, as .item() gave it
        return mean_over_ranks_async(loss_sum / accum)

    def step_record(self, engine) -> dict:
        """What the layout adds to a train record (MoE: auxiliary loss, routing and drops; collective)."""
        if not self.moe:
            return {}
        return moe.step_record(engine.module, self.aux_sum, self.cfg.batch.grad_accum, self.cfg.dp, self.device)

    @torch.no_grad()
    def eval_losses(self, engine, batches) -> list[float]:
        """This rank's loss on each validation batch (the caller averages over ranks)."""
        if self.pp:
            from lifecycle.tasks.train.parallel.pp import eval_loss

            return [eval_loss(engine, *self._local(x, y)) for x, y in batches]
        return [engine(*(t.to(self.device) for t in self._local(x, y)))[1].item() for x, y in batches]

    def _local(self, x: torch.Tensor, y: torch.Tensor) -> Batch:
        """This rank's part of a batch: with sequence parallelism, its slice of every sequence."""
        return self.sp.shard(x, y) if self.sp is not None else (x, y)
