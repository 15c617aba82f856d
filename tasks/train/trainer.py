"""One DeepSpeed rank: `python -m lifecycle.tasks.train.trainer --config <run_dir>/config.json`, with the rank
environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) of DeepSpeed's launcher.

Started by `lifecycle.tasks.train.launch.run_train` (never imports Prefect or MLflow). Every rank reads the same launch
config, builds the same initial model (same seed), and draws its batches from a stateless sampler:
micro-batch `m` of update `s` on rank `r` is `default_rng([seed, s, r, m])` windows over the train shards.
So a resumed run sees exactly the batches an uninterrupted run would have seen; the sampler state in the
checkpoint is just its position plus the settings it depends on, checked on resume. Python, NumPy and
torch RNG states of every rank go into `client_state` too (DeepSpeed saves none of them), so dropout
also replays.

The parts: `engine` (process group, model, DeepSpeed engine), `parallel.parallelism` (the layout: how the model is
split and how a step runs under it), `loader` (batches), `checkpointer` (saves and restores), `metrics`
(metrics.jsonl). Beside the step, not in it: `standby` (hot spares), `timeline` and `profiling` (benchmarks),
`faults` (tests).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

T_START = time.time()

if __name__ == "__main__":  # a rank: die with the process that started it and with the run, before the slow imports
    from lifecycle.core.procs import die_with_parent, watch_parent_run
    from lifecycle.tasks.train.heartbeats import SUPERVISOR_BEAT, rank_alive_beat, run_dir_of

    die_with_parent()
    watch_parent_run(beat=None if (run_dir := run_dir_of(sys.argv)) is None else run_dir / SUPERVISOR_BEAT)
    rank_alive_beat(sys.argv)  # the supervisor's start-up watchdog sees this rank alive until its first step

import torch
import torch.distributed as dist

from lifecycle.tasks.data.tokenize.stage import TokenShards
from lifecycle.tasks.train.commit import read_marker
from lifecycle.tasks.train.checkpointer import SaveSchedule, make_checkpointer
from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.distributed import (DeviceValue, gather_rng, mean_over_ranks, measure_peak_flops,
                                               set_rng_state)
from lifecycle.tasks.train.engine import build_engine, init_distributed
from lifecycle.tasks.train.faults import Faults
from lifecycle.tasks.train.hardware import mfu_basis, mfu_peak
from lifecycle.tasks.train.layout import layout_of
from lifecycle.tasks.train.loader import Prefetcher, get_batch, val_batches
from lifecycle.tasks.train.metrics import Metrics
from lifecycle.tasks.train.parallel.parallelism import Parallelism
from lifecycle.tasks.train.profiling import profile_step, profiled
from lifecycle.tasks.train.resume import check_resume
from lifecycle.tasks.train.sampler import data_step, sampler_state
from lifecycle.tasks.train.standby import Standby, prewarm_first_save, world_name
from lifecycle.tasks.train.heartbeats import write_heartbeat
from lifecycle.tasks.train.timeline import Timeline

TIMELINE = Timeline(T_START)  # this rank's launch phases, recorded when a benchmark asks (tasks/train/timeline.py)


class Trainer:
    """One rank's training run, torchtitan-style: `Trainer(launch)` builds the parts and restores the newest
    commit; `train_step()` runs one optimizer step and what is due after it, or rolls back on a bad loss;
    `close()` commits the last save. Every rank calls the same methods at the same steps (they are collective)."""

    def __init__(self, launch: dict, timeline: Timeline = TIMELINE):
        self.launch, self.timeline, self.standby = launch, timeline, None
        self.cfg = cfg = TrainConfig.model_validate(launch["train"])
        self.shards = TokenShards.model_validate(launch["tokens"])
        self.run_dir = Path(launch["run_dir"])
        self.world_name = world_name()
        self.world_suffix = f"-{self.world_name}" if self.world_name else ""  # of the files each world writes apart
        self.device, _ = init_distributed(cfg, timeline)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != cfg.batch.num_ranks:
            raise RuntimeError(f"launched with {self.world} ranks but train.batch.num_ranks={cfg.batch.num_ranks}")
        self.standby = Standby.of_env(self.run_dir, self.rank, self.say)
        self.par = Parallelism(cfg, self.rank, self.device)
        built = build_engine(cfg, launch, self.par, self.rank, self.run_dir, self.say, T_START)
        self.engine, self.scheduler, self.model_cfg = built.engine, built.scheduler, built.model_cfg
        self.n_matmul, self.flops_per_token = built.n_matmul, built.flops_per_token
        timeline.phase("engine build")
        self._mfu_basis()
        timeline.phase("peak FLOPS probe")
        self.checkpointer = make_checkpointer(cfg.checkpoint, self.engine, self.run_dir / "checkpoints", log=self.say,
                                              tier=launch.get("memory_tier"))
        sizing = self.run_dir / f".checkpoint-sizing{self.world_suffix}"
        if self.standby is not None:  # everything but the restore is done before the promotion
            self.standby.wait(self.checkpointer, sizing, T_START)
            self.standby = None
            self.say(f"promoted: standby world {self.world_name} takes over, {time.time() - T_START:.1f}s after start")
            timeline.phase("promoted")
        torch.manual_seed(cfg.seed + 1 + self.rank)  # per-rank stream for dropout
        self.step, self.elapsed, self.skipped = 0, 0.0, []
        self.layout_change: dict | None = None
        found = self.restore()
        self.metrics = Metrics(self.run_dir / "metrics.jsonl", self.step, enabled=self.rank == 0)
        if found is not None:
            self._say_restored(found)
        if line := prewarm_first_save(self.checkpointer, self.world_name, self.step < cfg.max_steps, sizing):
            self.say(line)
        self.schedule = SaveSchedule(cfg.checkpoint, self.step)
        self.faults = Faults.from_env()
        self.profile_at = profile_step()
        self.engine.train()
        self.tokens_per_step = cfg.global_batch * cfg.model.seq_len
        self.first = self.step  # the first step of this launch is always logged
        self.window_start, self.window_steps = time.perf_counter(), 0  # the steps the next train record averages
        timeline.phase("checkpointer and restore")
        self.loader = self.batches()
        self.recent: list[float] = []  # healthy losses for the spike test
        self.unchecked: tuple[int, int, DeviceValue] | None = None  # (step, data step, loss) not yet checked
        self.rollbacks = 0
        self.beat()
        timeline.phase("data loader start")

    def _mfu_basis(self) -> None:
        """The MFU denominator (hardware.mfu_peak). The matmul probe runs at every launch, under the run's own
        load (a cached value from a busier moment made MFU > 1); not at all when the peak is configured."""
        cfg = self.cfg
        dtype = torch.bfloat16 if cfg.engine.precision == "bf16" else torch.float32
        self.measured_peak = None if cfg.logging.peak_flops_per_rank else measure_peak_flops(self.device, dtype=dtype)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.peak, source = mfu_peak(cfg, name, self.measured_peak)
        self.say(mfu_basis(self.flops_per_token, self.n_matmul, cfg.model.n_layer, cfg.model.n_embd,
                           cfg.model.seq_len, self.peak, source))

    def _say_restored(self, found: Path) -> None:
        """Which tier the restore read, and why not memory (tests and benches read it)."""
        self.say(f"resumed from {found} at step {self.step}")
        info = self.checkpointer.last_restore
        self.say(f"restored step {self.step} from {info['tier']} in {info['seconds']:.3f}s"
                 + (f" (memory tier not used: {info['reason']})" if info["reason"] else ""))
        self.metrics.write({"kind": "restore", "step": self.step, **info})
        if self.layout_change:
            self.metrics.write(self.layout_change)

    def beat(self, step_time: float | None = None) -> None:
        """This rank's heartbeat for the supervisor's stall watchdog (lifecycle.tasks.train.heartbeats.Heartbeats)."""
        write_heartbeat(self.run_dir, self.rank, self.step, step_time, world=self.world_name)

    def say(self, message: str) -> None:
        """A line in train.log, from rank 0 only (a standby world's marked with its name until it is promoted)."""
        if self.rank == 0:
            print(f"[{self.world_name} standby] {message}" if self.standby else message, flush=True)

    def batches(self) -> Prefetcher:
        """This rank's micro-batches from the current step to max_steps, prepared ahead by a thread."""
        cfg = self.cfg
        keys = ((s, data_step(s, self.skipped), m) for s in range(self.step, cfg.max_steps)
                for m in range(cfg.batch.grad_accum))
        pin = self.device.type == "cuda"
        return Prefetcher(lambda k: get_batch(self.shards, cfg, k[1], self.par.dp_rank, k[2], pin), keys,
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
            self.profile_at = None
            profiled(self.train_step, self.run_dir / f"profile-step{self.step + 1}.json" if self.rank == 0 else None)
            self.window_start, self.window_steps = time.perf_counter(), 0  # the profiler's cost stays out
            return
        t0 = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        dstep = data_step(self.step, self.skipped)
        self.par.begin_step(self.engine)
        pending = self.par.forward_backward(self.engine, lambda m: self._batch(dstep, m), self.faults.poisons(dstep))
        earlier, self.unchecked = self.unchecked, (self.step + 1, dstep, pending)
        if earlier is not None and self.check(*earlier) is None:
            return
        self.step += 1
        if self.step == self.first + 1:
            self.timeline.phase("first step")
            self.timeline.write(self.run_dir / f"launch-timing-rank{self.rank}{self.world_suffix}.json")
        self.elapsed += time.perf_counter() - t0
        if self.step > self.first + 1:  # the launch's first step warms up
            self.schedule.step_time(time.perf_counter() - t0)
        self.window_steps += 1
        self.checkpointer.poll()
        self._after_step(lr)
        self.beat(time.perf_counter() - t0)

    def _batch(self, dstep: int, micro: int):
        """Micro-batch `micro` of this step, from the prefetch thread."""
        if self.step == self.first and micro == 0:
            self.timeline.phase("first batch")
        return self.loader.get((self.step, dstep, micro))

    def _after_step(self, lr: float) -> None:
        """What is due after this step (the same on every rank): a train record, an eval, a save."""
        last = self.step == self.cfg.max_steps
        commit = self.schedule.due(self.step) or last
        logs = self.step % self.cfg.logging.every == 0 or self.step == self.first + 1 or commit
        evals = self.cfg.logging.eval_every and (self.step % self.cfg.logging.eval_every == 0 or last)
        if not (logs or evals) or (loss := self.check(*self.unchecked)) is None:
            return
        if logs:
            self.log(loss, lr)
        if evals:
            self.eval()
        if commit:
            self.save(loss, last)

    def check(self, step: int, dstep: int, pending: DeviceValue) -> float | None:
        """Wait for step `step`'s loss; a healthy one joins the spike window and is returned. A bad one rolls
        back (None)."""
        loss = pending.get()
        if self.unchecked is not None and self.unchecked[0] == step:
            self.unchecked = None  # checked now
        if self.cfg.guard.is_bad(loss, self.recent):
            self.unchecked = None  # a step queued after the bad one goes with everything past the commit
            self.rollback(loss, dstep, step)
            self.beat()
            return None
        self.recent = (self.recent + [loss])[-self.cfg.guard.spike_window:]
        return loss

    # ----------------------------------------------------------------------------------------------
    # what a step may trigger

    def log(self, loss: float, lr: float) -> None:
        """A train record over the steps since the last one: loss, lr, throughput, MFU, data stall."""
        now = time.perf_counter()
        window = now - self.window_start
        wait = mean_over_ranks(self.loader.take_wait(), self.device)
        step_time = window / self.window_steps
        achieved = self.flops_per_token * self.tokens_per_step / step_time / self.world  # FLOP/s per rank
        extra = self.par.step_record(self.engine)  # collective
        self.metrics.write({"kind": "train", "step": self.step, "loss": loss, "lr": lr,
                            "tokens": self.step * self.tokens_per_step, "elapsed": round(self.elapsed, 3),
                            "step_time": step_time, "data_wait": wait / self.window_steps, "stall_frac": wait / window,
                            "tokens_per_s": self.tokens_per_step / step_time,
                            "mfu": achieved / self.peak,
                            **({"mfu_measured": achieved / self.measured_peak} if self.measured_peak else {}),
                            "params": self.n_matmul, "flops_per_token": self.flops_per_token, **extra})
        self.window_start, self.window_steps = now, 0

    def eval(self) -> None:
        """Validation loss over eval_batches fixed windows per rank; its time is left out of the next record."""
        self.engine.eval()
        losses = self.par.eval_losses(self.engine, val_batches(self.shards, self.cfg, self.par.dp_rank,
                                                               self.par.grid.dp))
        self.engine.train()
        val_loss = mean_over_ranks(sum(losses) / len(losses), self.device)  # averaged over every rank
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
        if self.schedule.auto and not last:  # checkpoint.every: auto
            record = self.schedule.choose(self.step, stall, self.device)
            self.say(f"checkpoint interval (auto): {record['interval']} steps (save stall {record['stall']:.3f}s, "
                     f"median step {record['step_time']:.3f}s, overhead {record['overhead']:.1%})")
            self.metrics.write(record)
        self.window_start = time.perf_counter()
        self.loader.take_wait()

    def restore(self) -> Path | None:
        """Load the newest committed checkpoint whose hashes verify into the engine, this rank's RNG states and
        the sampler position; returns its tag directory (None: nothing committed, start at step 0)."""
        got = self.checkpointer.restore(max_step=self.cfg.max_steps)
        if got is None:
            self.step, self.elapsed, self.skipped = 0, 0.0, []
            return None
        tag_dir, state = got
        change = check_resume(state, read_marker(tag_dir), tag_dir, self.cfg, self.world, self.shards.dataset_sha256)
        if change is not None:
            # RNG states: rank r takes old rank r's (dropout masks are per rank, so a run with dropout follows
            # another trajectory after a layout change; without dropout nothing draws from them); a rank the old
            # layout did not have keeps its seeded stream
            self.say(f"layout change at step {change['step']}: {change['from']} -> {change['to']}"
                     f" ({change.pop('converter')} checkpoint {tag_dir})")
            self.layout_change = change
        if self.rank < len(state["rng"]):
            set_rng_state(state["rng"][self.rank], self.device)
        self.step, self.elapsed, self.skipped = state["step"], state["elapsed"], state["sampler"].get("skipped", [])
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
