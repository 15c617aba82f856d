"""Sharded stages: plan -> `run_shard` for each shard (in parallel, on any worker that shares the work dir)
-> `commit_plan`. Built on the dataset store (`lifecycle.core.dataset`).

A stage package exports its code as one object, `STAGE` in its `stage.py`, which the registry
(`lifecycle.tasks.stages`) finds: a `StageCode` of callables, or a `PerFileStage`, the shape of every stage that
maps each file of its parent to one output file (filter, scrub, decontaminate, select, dedup's signatures)."""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import json
import mmap
import os
import pickle
import select
import shutil
import signal
import sys
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from lifecycle.core.code import code_version
from lifecycle.core.dataset import DatasetRef, DatasetWriter, RawFile, StageStats, _FileWriter, dataset_dir, find_committed, fingerprint, read_parquet
from lifecycle.core.fs import atomic_write_json, fsync_path



SHARD_MARKER = "_shard.json"


class StagePlan(BaseModel):
    """A sharded stage, planned and not yet committed. The flow maps `run_shard(plan, i)` over the shards
    (on Dask workers, which may be other processes or machines sharing the work dir), then `commit_plan`.

    Shards are built in `.building-<fp>/shard-NNNNN/`, each published by an atomic rename after its
    `_shard.json` (entries with sha256, stats) is fsynced. A killed run leaves finished shards behind; the
    rerun plans the same fingerprint and builds only the shards that have no marker. Shard outputs are a
    pure function of (config, code, shard inputs), so the committed dataset is byte-identical either way.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    stage: str
    workdir: str
    fingerprint: str
    code: str
    config: Any
    shard_fn: str  # "module:function", called as fn(config, items, writer: ShardWriter) -> StageStats
    shards: list[list[str]]
    warm_fn: str | None = None  # "module:function", called as fn(config) once per worker before its shards fork
    parents: list[DatasetRef] = []
    inputs: list[RawFile] = []

    @property
    def building(self) -> Path:
        d = dataset_dir(self.workdir, self.stage, self.fingerprint)
        return d.with_name(f".building-{d.name}")

    def shard_dir(self, index: int) -> Path:
        return self.building / f"shard-{index:05d}"

    def done_shards(self) -> list[int]:
        return [i for i in range(len(self.shards)) if (self.shard_dir(i) / SHARD_MARKER).exists()]


class ShardWriter(_FileWriter):
    """Writes one shard into a private directory; `finish` publishes it with one rename."""

    def __init__(self, plan: StagePlan, index: int):
        super().__init__()
        self.index = index
        self.final = plan.shard_dir(index)
        self.tmp = plan.building / f".tmp-{self.final.name}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=True)

    def write_table(self, table: pa.Table, kind: str = "files", name: str | None = None) -> None:
        super().write_table(table, kind, name)
        heartbeat()

    def finish(self, stats: StageStats) -> None:
        atomic_write_json(self.tmp / SHARD_MARKER, {"index": self.index, "entries": self._entries,
                                                    "stats": stats.to_dict()})
        fsync_path(self.tmp)
        try:
            os.rename(self.tmp, self.final)
        except OSError:  # a twin attempt (a retry after a timeout) published it first
            if not (self.final / SHARD_MARKER).exists():
                raise
            shutil.rmtree(self.tmp)
        fsync_path(self.final.parent)


def by_name(fn: Callable) -> str:
    """"module:qualname" of a module-level function, which a shard worker (another process, or another machine
    sharing the work dir) imports by that name (`resolve`)."""
    name = f"{fn.__module__}:{fn.__qualname__}"
    try:
        found = resolve(name)
    except (ImportError, AttributeError):
        found = None
    if found is not fn:
        raise TypeError(f"{name} is not a module-level function: a shard worker could not import it by name")
    return name


def resolve(name: str) -> Any:
    """The object a "module:qualname" string names (the module imported if need be)."""
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def plan_stage(
    workdir: str | Path,
    stage: str,
    config: Any,
    code: str,
    shard_fn: Callable,
    shards: list[list[str]],
    parents: Iterable[DatasetRef] = (),
    inputs: Iterable[RawFile] = (),
    warm: Callable | None = None,
) -> StagePlan | DatasetRef:
    """The committed dataset if there is one, else the plan to build it (leftover temporary shard
    directories of a killed run are removed; finished shards are kept). `warm(config)`: what a worker loads
    once before its shard processes fork (`warm_worker`)."""
    parents, inputs = list(parents), list(inputs)
    fp = fingerprint(stage, config, code, parents, inputs)
    done = find_committed(workdir, stage, fp)
    if done is not None:
        return done
    plan = StagePlan(stage=stage, workdir=str(workdir), fingerprint=fp, code=code, config=config,
                     shard_fn=by_name(shard_fn), shards=shards, parents=parents, inputs=inputs,
                     warm_fn=by_name(warm) if warm is not None else None)
    plan.building.mkdir(parents=True, exist_ok=True)
    for stale in plan.building.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return plan


def run_shard(plan: StagePlan, index: int) -> dict:
    """Build shard `index` of `plan` unless a finished copy exists. Idempotent; safe to retry."""
    if (plan.shard_dir(index) / SHARD_MARKER).exists():
        return {"index": index, "reused": True}
    fn = resolve(plan.shard_fn)
    writer = ShardWriter(plan, index)
    try:
        stats = fn(plan.config, plan.shards[index], writer)
        writer.finish(stats)
    except BaseException:
        writer.abort()
        raise
    return {"index": index, "reused": False, "rows_in": stats.rows_in, "rows_kept": stats.rows_kept}


# --------------------------------------------------------------------------------------------------
# the per-shard watchdog: a shard runs in a forked child that the caller kills when it stops making progress


class ShardTimeout(RuntimeError):
    """A shard made no progress for `orchestration.shard_timeout_s`; its process was killed (a retry resumes)."""


_beats: ctypes.c_uint64 | None = None  # the progress counter shared with the supervising parent (in a child)


def heartbeat() -> None:
    """Say that the shard running in this process made progress (a record read, a file written). Cheap: one
    increment in shared memory; a no-op outside a watched shard."""
    if _beats is not None:
        _beats.value += 1


def _child(plan: StagePlan, index: int, beats: mmap.mmap, out: int) -> None:
    """Body of the forked shard process: run the shard, send ("ok", result) or ("error", exception), exit."""
    global _beats
    _beats = ctypes.c_uint64.from_buffer(beats)
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the supervisor
    except (OSError, AttributeError):
        pass
    try:
        msg = ("ok", run_shard(plan, index))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, which raises it
        e.add_note(f"in shard process {os.getpid()}:\n{traceback.format_exc()}")
        try:
            pickle.loads(pickle.dumps(e))
            msg = ("error", e)
        except Exception:  # an exception that does not survive pickling: send its text
            msg = ("error", RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    data = pickle.dumps(msg)
    with os.fdopen(out, "wb") as f:
        f.write(data)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_warmed: set[tuple[str, str]] = set()  # (stage module, fingerprint) already warmed in this process


def warm_worker(plan: StagePlan) -> None:
    """Load, once in this process, what each forked shard process would otherwise load again for itself and
    lose at its exit: the stage's module, pandas (which pyarrow imports when it builds its first table),
    and whatever the stage's `warm(config)` loads (its stage object's, carried by the plan as `warm_fn`; filter:
    the language-ID model and the n-gram kernels; dedup's signatures: the MinHash kernel). What that saves:
    docs/benchmarks.md, "Issue 25: shards as plain futures on a forkserver pool"."""
    module = plan.shard_fn.partition(":")[0]
    if (module, plan.fingerprint) in _warmed:
        return
    resolve(plan.shard_fn)
    pa.table({"warm": [0]})
    if plan.warm_fn is not None:
        resolve(plan.warm_fn)(plan.config)
    _warmed.add((module, plan.fingerprint))


# a frozen object is never freed: at exit, nanobind (DuckDB's bindings) would report each of its own as "leaked" on
# stderr, into every run's log; unfreezing what nothing froze is a no-op
atexit.register(gc.unfreeze)


def freeze_heap() -> None:
    """Before a fork: collect this process's garbage, then move what survives into the collector's permanent
    generation (`gc.freeze`), so that a forked child's collections never visit the objects it inherited. A visit
    writes into each object's header, which makes the kernel copy every page of the parent's heap into the child
    (copy-on-write): docs/benchmarks.md, "Issue 25: 2.3 GB, the same mix at every size, and three fixes it found",
    measures what a shard process forked from a pool worker that had run filter held of such copies."""
    gc.collect()
    gc.freeze()


def run_shard_watched(plan: StagePlan, index: int, timeout_s: float | None = None,
                      limit_s: float | None = None) -> dict:
    """`run_shard` in a forked child process that is killed when it makes no progress (no `heartbeat`, no file
    written) for `timeout_s` seconds, or when it has run for `limit_s` seconds in all (the stage's timeout,
    `orchestration.stage_timeout_s`): then ShardTimeout names the stage and shard. A blocking read, a hung
    library or a stopped process is killed, as no thread timeout can; the shard's partial output is removed, and
    a retry or rerun builds it again (finished shards are kept). Neither bound: run here, unwatched."""
    if (timeout_s is None and limit_s is None) or (plan.shard_dir(index) / SHARD_MARKER).exists():
        return run_shard(plan, index)
    timeout_s = timeout_s if timeout_s is not None else float("inf")
    started = time.monotonic()
    warm_worker(plan)
    beats = mmap.mmap(-1, 8)
    counter = ctypes.c_uint64.from_buffer(beats)
    r, w = os.pipe()
    freeze_heap()
    with warnings.catch_warnings():  # Python 3.12 warns on fork in a threaded process; the child runs no thread's code
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(plan, index, beats, w)
    os.close(w)
    chunks, seen, last, ended = [], -1, time.monotonic(), False
    try:
        while True:
            ready, _, _ = select.select([r], [], [], min(1.0, timeout_s / 4, limit_s or 1.0))
            if ready:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    ended = True
                    break
                chunks.append(chunk)
                last = time.monotonic()
                continue
            if counter.value != seen:
                seen, last = counter.value, time.monotonic()
            now = time.monotonic()
            if now - last > timeout_s or (limit_s is not None and now - started > limit_s):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pid = 0
                raise _shard_timeout(plan, index, now - last > timeout_s, timeout_s, limit_s)
    finally:
        os.close(r)
        del counter
        if pid:
            if not ended:  # this thread was interrupted: the shard's process does not outlive it
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
    if not chunks:
        raise RuntimeError(f"{plan.stage}: the process of shard {index} of {len(plan.shards)} died "
                           f"({_exit_text(status)}) before it reported; a retry or a rerun builds it again")
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "error":
        raise value
    return value


def _shard_timeout(plan: StagePlan, index: int, stalled: bool, timeout_s: float,
                   limit_s: float | None) -> ShardTimeout:
    """A killed shard (it stalled, or ran past the stage's limit): its partial output removed, and the ShardTimeout
    that names the stage, the shard and its inputs."""
    for tmp in plan.building.glob(f".tmp-{plan.shard_dir(index).name}-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    why = (f"made no progress for {timeout_s:g} s (orchestration.shard_timeout_s)" if stalled
           else f"ran for more than {limit_s:g} s (orchestration.stage_timeout_s)")
    return ShardTimeout(
        f"{plan.stage}: shard {index} of {len(plan.shards)} {why}, so its process was killed; a retry or "
        f"a rerun builds it again (finished shards are kept). Its inputs: "
        f"{', '.join(plan.shards[index])[:300]}")


def _exit_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def commit_plan(plan: StagePlan) -> DatasetRef:
    """Merge every shard's entries and stats (in shard order) into one manifest and commit the dataset."""
    done = find_committed(plan.workdir, plan.stage, plan.fingerprint)
    if done is not None:
        return done
    missing = sorted(set(range(len(plan.shards))) - set(plan.done_shards()))
    if missing:
        raise RuntimeError(f"{plan.stage}: cannot commit, shards {missing} of {len(plan.shards)} are not "
                           f"finished in {plan.building}")
    writer = DatasetWriter(plan.workdir, plan.stage, plan.fingerprint, tmp=plan.building)
    stats = StageStats()
    for i in range(len(plan.shards)):
        marker = json.loads((plan.shard_dir(i) / SHARD_MARKER).read_text())
        for kind, entries in marker["entries"].items():
            writer._entries[kind] += [{**e, "path": f"{plan.shard_dir(i).name}/{e['path']}"} for e in entries]
        stats = stats + StageStats.from_dict(marker["stats"])
    return writer.commit(config=plan.config, code=plan.code, parents=plan.parents, inputs=plan.inputs,
                         stats=stats, extra={"shards": len(plan.shards)})


def run_plan(plan: StagePlan | DatasetRef) -> DatasetRef:
    """Build every shard here, one after another, and commit (library use and tests; the flow maps the
    shards over its task runner instead)."""
    if isinstance(plan, DatasetRef):
        return plan
    for i in range(len(plan.shards)):
        run_shard(plan, i)
    return commit_plan(plan)


PER_FILE_SHARD_BYTES = 1 << 20  # consecutive parent files smaller than this share a shard


def group_files(files: list[tuple[str, int]], size: int) -> list[list[str]]:
    """(path, bytes) in order -> shards: consecutive files while their bytes stay within `size`; a larger file
    is a shard of its own (collect's input files; a per-file stage's parent files, where a shard costs a task
    and a process, more than scrubbing a small file: docs/benchmarks.md, "Issue 25: shards as plain futures on a
    forkserver pool")."""
    shards: list[list[str]] = []
    held = size
    for path, n in files:
        if held + n > size or not shards:
            shards.append([])
            held = 0
        shards[-1].append(path)
        held += n
    return shards


# --------------------------------------------------------------------------------------------------
# stage objects: what a stage package exports as `STAGE` (`lifecycle.tasks.stages.Stage.entry` finds it)


@dataclass(frozen=True)
class StageCode:
    """A stage's callables, exported by its package as `STAGE` in its `stage.py`:

    - `run(*parents, config, workdir, **kw)`: the whole stage in this process, returning its committed output (a
      sharded stage plans, builds every shard here and commits: library use and tests). The flow runs it as one
      task where the registry says `run` (dedup: after its sharded part, passed as the registry's `sharded_arg`);
    - `plan(*parents, config, workdir, **kw) -> StagePlan | DatasetRef`: the sharded part, if the stage has one;
    - `shard(config, items, writer) -> StageStats`: one shard of that plan. A module-level function: the plan
      carries it by name and shard workers import it (`by_name`, `resolve`);
    - `warm(config)`: what a worker loads once before its shard processes fork (`warm_worker`), if anything."""

    run: Callable
    plan: Callable | None = None
    shard: Callable | None = None
    warm: Callable | None = None


@dataclass(frozen=True)
class PerFileStage:
    """A sharded stage that maps each kept file of its parent to one output file, rejected rows beside it
    (filter, scrub, decontaminate, select, dedup's signatures): one declaration gives its `plan`, `run`, `shard`
    and `warm`, e.g. `STAGE = PerFileStage("scrub", __package__, scrub_shard)`.

    Its plan shards the parent's files: consecutive files together up to `PER_FILE_SHARD_BYTES` (`group_files`, so
    the shards depend on the parent alone), or one file per shard when not `grouped`. Its fingerprint is
    the stage `name`, `config(parent, section)` (default: the section itself), the code version of `package`, the
    parent, and the raw files `inputs(section)` names (decontaminate's eval sets)."""

    name: str
    """The dataset's name under `<workdir>/datasets/` (dedup's sharded half: dedup-signatures)."""
    package: str
    """The package whose code version is fingerprinted: the stage module's `__package__`."""
    shard: Callable[[Any, list[str], Any], StageStats]
    """fn(config, files, writer) -> StageStats, module-level (shard workers import it by name)."""
    warm: Callable[[Any], None] | None = None
    """fn(config), module-level: loaded once per worker before its shard processes fork."""
    config: Callable[[DatasetRef, Any], Any] | None = None
    """fn(parent, section) -> the config the shards get and the fingerprint holds (select: the resolved cut)."""
    inputs: Callable[[Any], list[RawFile]] | None = None
    """fn(section) -> raw files beside the parent in the fingerprint."""
    grouped: bool = True
    """Small consecutive files share a shard (up to `PER_FILE_SHARD_BYTES`); False: one file per shard."""

    def plan(self, parent: DatasetRef, cfg: Any, workdir: str | Path) -> StagePlan | DatasetRef:
        """One shard per file of `parent`, or per group of small files; the committed dataset instead if it exists."""
        if self.grouped:
            files = [(str(Path(parent.path) / f["path"]), f["bytes"]) for f in parent.manifest()["files"]]
            shards = group_files(files, PER_FILE_SHARD_BYTES)
        else:
            shards = [[str(p)] for p in parent.files()]
        return plan_stage(workdir, self.name, self.config(parent, cfg) if self.config is not None else cfg,
                          code_version(self.package), self.shard, shards, parents=[parent],
                          inputs=self.inputs(cfg) if self.inputs is not None else (), warm=self.warm)

    def run(self, parent: DatasetRef, cfg: Any, workdir: str | Path) -> DatasetRef:
        """Every file of `parent`, one file at a time, into the committed dataset (here, shard after shard)."""
        return run_plan(self.plan(parent, cfg, workdir))


def map_tables(paths: list[str], writer: _FileWriter,
               fn: Callable[[pa.Table], tuple[pa.Table, pa.Table, StageStats]]) -> StageStats:
    """`fn(table) -> (kept, rejected, stats)` over each file, one file in memory at a time; one kept file out
    per file in, rejected rows beside it."""
    stats = StageStats()
    for path in paths:
        heartbeat()
        kept, rejected, part = fn(read_parquet(path))
        writer.write_table(kept)
        if rejected.num_rows:
            writer.write_table(rejected, kind="rejected")
        stats = stats + part
    return stats
