"""The operational sections of `TrainConfig` (torch-free): `checkpoint`, `logging` and `launch` say how a run is
saved, logged and launched, never what it computes, so each stays out of the run fingerprint as a whole
(`Section.operational`). `Section` is the base of every section (lifecycle.tasks.train.config)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    """A group of `TrainConfig` fields. A section whose class sets `operational = True` holds only settings that do
    not change the trajectory (how the run is launched, logged, checkpointed), so the whole section stays out of
    the run fingerprint; every field of any other section is in it."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
    operational: ClassVar[bool] = False


class CheckpointConfig(Section):
    """When and how committed checkpoints are written (lifecycle.tasks.train.checkpointer). Operational."""

    operational: ClassVar[bool] = True

    every: int | Literal["auto"] = 100
    """Commit a checkpoint every this many steps; one is always committed at max_steps. `auto`: pick the
    interval so that saving costs at most `auto_overhead` of training time (CheckFreq): a first save a few
    steps into each launch measures its stall, then interval = ceil(stall / (auto_overhead x median step
    time)), re-estimated at every save from the numbers of all ranks (the slowest), and logged."""
    auto_overhead: float = Field(0.035, gt=0, lt=1)
    """With `every: auto`, the share of training time checkpointing may cost (CheckFreq's 3.5 %)."""

    @field_validator("every", mode="before")
    @classmethod
    def _every(cls, v: Any) -> Any:  # one error under `checkpoint.every`, not one per member of the union
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError(f"must be a whole number of steps >= 1 or 'auto', got {v!r}")
    keep_last: int = Field(3, ge=1)
    """Committed checkpoints kept (K newest); older ones are deleted after each commit."""
    async_save: bool = True
    """Checkpoints are snapshotted to host memory and persisted in the background (lifecycle.tasks.train.async_saver);
    false = the synchronous save of lifecycle.tasks.train.commit. Either way the commit marker comes last and
    the files are the same."""
    memory_tier: bool = True
    """Keep the latest committed checkpoint in host memory (tmpfs, /dev/shm), outside the ranks, so that a
    relaunch after a rank failure restores from memory instead of disk (Gemini, CheckFreq); the disk commit
    stays the source of truth, and a tier that is older than the newest commit or fails its checksums is
    skipped (the restore reads the disk, and says why). Needs `async_save` (the async saver's staging
    buffers are the tier). Memory: up to two model+optimizer states per host (the committed one and the one
    being saved), in place of the one staging buffer the async saver keeps anyway. Removed when the run
    succeeds."""


class LoggingConfig(Section):
    """What rank 0 appends to metrics.jsonl, and how often. Operational."""

    operational: ClassVar[bool] = True

    every: int = Field(10, ge=1)
    """Append a metrics record (rank-averaged loss) every this many steps, and at the first and last."""
    eval_every: int = Field(0, ge=0)
    """Validation loss every this many steps during training (0 = never; the evaluate task does it after)."""
    eval_batches: int = Field(4, ge=1)
    """Micro-batches per rank for each in-training validation."""
    peak_flops_per_rank: float | None = Field(None, gt=0)
    """Peak FLOP/s of one rank's device, the MFU denominator (e.g. 989e12 for an H100's dense bf16).
    Null = measured at start-up with a matmul on the rank's device and threads, so MFU is relative to what
    this hardware can do."""


class LaunchConfig(Section):
    """How the ranks are started and supervised (hostfile and the deepspeed runner, threads, time limit). Operational."""

    operational: ClassVar[bool] = True

    hostfile: str | None = None
    """DeepSpeed hostfile (`<host> slots=<ranks>` per line, `#` comments) to run the ranks across the listed
    hosts; null = `train.batch.num_ranks` ranks on this machine. Every host needs the same run directory (a
    shared file system) and the same Python environment at the same path, reachable by passwordless ssh (pdsh
    by default)."""
    master_addr: str | None = None
    """Address of the rank-0 host for the rendezvous. Null: 127.0.0.1 when every rank is on one host, else
    the DeepSpeed launcher asks the first host over ssh (`hostname -I`)."""
    master_port: int | None = Field(None, ge=1024, le=65535)
    """torch.distributed rendezvous port; null = pick a free one at launch."""
    num_nodes: int | None = Field(None, ge=1)
    """Use only the first this many hosts of the hostfile (launcher `--num_nodes`)."""
    include: str | None = None
    """Hosts/slots to use, DeepSpeed syntax `node1@node2:0,1` (launcher `--include`)."""
    exclude: str | None = None
    """Hosts/slots to leave out, same syntax (launcher `--exclude`)."""
    launcher: Literal["pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm"] = "pdsh"
    """How the DeepSpeed launcher starts the ranks on other hosts (launcher `--launcher`)."""
    threads_per_rank: int | None = Field(None, ge=1)
    """OMP/torch threads per rank. Null = CPU cores // num_ranks (at least 1)."""
    prefetch: int = Field(4, ge=0)
    """Micro-batches a background thread of each rank prepares ahead of the training step (0 = load in the step)."""
    timeout_s: float | None = Field(None, gt=0)
    """Kill the ranks and fail after this many seconds (null = no limit)."""
    stall_s: float = Field(60, gt=0)
    """Heartbeat watchdog: a rank that makes no step for max(stall_s, 10 x the median step time) gets the ranks
    killed and the attempt failed, naming it and its last step (the train stage's retry resumes from the last
    commit). Covers a step with its eval and its checkpoint save."""
    startup_s: float = Field(900, gt=0)
    """The same watchdog before a rank's first heartbeat: imports, DeepSpeed's engine set-up, a JIT build of its
    CPU comm op by a rank, the restore of a checkpoint. Much longer than a step, so it has its own bound. Within
    it, a rank whose liveness beat (every 2 s, from its first lines) goes quiet for `stall_s` (a stopped, dead or
    wedged rank) stalls the launch at once."""
    spares: int = Field(0, ge=0)
    """Hot spares: how many rank failures (an exit, or a stall the watchdog above names) one launch recovers from
    without a relaunch. Once the ranks train, a standby world of `num_ranks` ranks starts beside them on this
    host: imports done, process group and DeepSpeed engine built, first checkpoint arena made, waiting. A failure
    promotes it: the failed world is stopped, and the standby restores the newest commit (from host memory with
    `checkpoint.memory_tier`) and trains on. A new standby is started once the promoted world steps, while
    failures remain. 0 = off: a failure fails the attempt and the stage's retry relaunches. Costs a second copy of
    every rank's model, optimizer and first checkpoint arena in this host's memory (device memory on a GPU), and
    CPU while a standby starts. Local ranks only (no `hostfile`)."""

    @model_validator(mode="after")
    def _check(self) -> "LaunchConfig":
        if self.spares and self.hostfile is not None:
            raise ValueError("train.launch.spares keeps standby ranks on this host; it cannot be combined with "
                             "train.launch.hostfile")
        if self.hostfile is None and (self.num_nodes or self.include or self.exclude):
            raise ValueError("train.launch.num_nodes/include/exclude select hosts of a hostfile: "
                             "set train.launch.hostfile too")
        if self.include and self.exclude:
            raise ValueError("train.launch.include and train.launch.exclude are mutually exclusive")
        if self.num_nodes and (self.include or self.exclude):
            raise ValueError("train.launch.num_nodes cannot be combined with include/exclude "
                             "(the DeepSpeed launcher refuses it)")
        return self
