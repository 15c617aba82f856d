"""The supervisor's side of a launch: `Supervision` watches the ranks that `launch.run_train` started
(`lifecycle.tasks.train.launcher`) to their end, promotes a standby world (`World`, `train.launch.spares`) when a
rank fails, and sees to it that no wait is unbounded:

- **Build lock.** DeepSpeed JIT-builds its CPU comm op under torch's `FileBaton`: a plain `lock` file in the build
  directory, created with O_EXCL and deleted after the build. A process killed during the build leaves it, and
  every later rank waits on it forever. `clear_stale_build_locks` removes such a lock when no compiler or ninja
  works in that directory (a shell parked there does not count), under an flock of ours (which the OS drops when its holder dies), and `prebuild_shm_op` builds the op once, under
  that flock, before the ranks start, so ranks never race each other through a build. A start-up that times out
  names the locks that exist then.
- **Shared memory.** DeepSpeed names its buffers `deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>`
  and never unlinks them. A launch releases exactly its own port's buffers when it ends, and records which port it
  owns (`Ownership`), so a later launch releases the leftovers of a supervisor that died, never a live one's.
- **Heartbeats** (`lifecycle.tasks.train.heartbeats`): a rank that makes no step, or shows no sign of life in
  start-up, for long enough fails the launch (or promotes the standby).

No torch here: the supervisor never imports it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

from lifecycle.core import fs
from lifecycle.core.procs import same_process, start_time
from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.heartbeats import STANDBY_ENV, WORLD_ENV, Heartbeats, ready_path
from lifecycle.tasks.train.launcher import Launch, RankFailed, local_rank_envs

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------ the JIT build lock

SHM_OP = "deepspeed_shm_comm"  # deepspeed/ops/op_builder/cpu/comm.py ShmCommBuilder.NAME


def extensions_root() -> Path:
    """Where torch builds JIT extensions: TORCH_EXTENSIONS_DIR, else torch's per-user cache (appdirs: XDG_CACHE_HOME or
    ~/.cache) /torch_extensions. Below it, one `<py tag>_<accelerator>` folder per interpreter and torch build."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"


def build_dirs(root: Path | None = None) -> list[Path]:
    """The shm op's build directories under `root` (`root/<name>` with TORCH_EXTENSIONS_DIR, `root/<tag>/<name>`
    without: torch adds the tag only to its default root)."""
    root = root or extensions_root()
    return [d for d in (root / SHM_OP, *root.glob(f"*/{SHM_OP}")) if d.is_dir()]


BUILDERS = re.compile(r"(?:[\w.]+-)*(?:c\+\+|g\+\+|gcc|cc|cc1plus|ninja|nvcc)(?:-[\d.]+)?")
"""A compiler or ninja, by file name (x86_64-linux-gnu-g++-12 too): what holds a live build's lock."""


def _building_in(build_dir: Path) -> bool:
    """Whether a compiler or ninja process works in `build_dir` (its working directory, or named on its command
    line). Any other process there (an operator's shell, a pager) does not keep a lock alive."""
    target = str(build_dir.resolve())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            names = {(proc / "comm").read_text().strip(), os.path.basename(argv[0].decode(errors="replace"))}
            if not any(BUILDERS.fullmatch(n) for n in names):
                continue
            cwd = os.readlink(proc / "cwd")
            if cwd == target or cwd.startswith(target + "/") or any(target.encode() in a for a in argv):
                return True
        except OSError:
            continue
    return False


def held_build_locks(root: Path | None = None) -> list[Path]:
    """torch's `lock` files in the shm op's build directories now (a rank or a build waits while one exists)."""
    return [d / "lock" for d in build_dirs(root) if (d / "lock").exists()]


def build_lock_note(root: Path | None = None) -> str:
    """A clause naming the build locks that exist now, for a start-up timeout's message ("" when none)."""
    locks = held_build_locks(root)
    if not locks:
        return ""
    states = {True: "a compiler or ninja works there", False: "no compiler or ninja works there: stale, remove it"}
    what = "; ".join(f"{lock} ({states[_building_in(lock.parent)]})" for lock in locks)
    return f"; torch's JIT build lock exists, and every rank waits while it does: {what}"


@contextmanager
def build_flock(root: Path | None = None):
    """Our own exclusive lock around checking and building the op: an flock, so the OS drops it if we die."""
    root = root or extensions_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lifecycle-build.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def clear_stale_build_locks(root: Path | None = None, settle_s: float = 2.0) -> list[Path]:
    """Remove torch's `lock` in the shm op's build directories when no process builds there (checked twice,
    `settle_s` apart: a live builder creates the lock a moment before it starts ninja). Returns what it removed,
    each with a warning naming the path. Call it under `build_flock`."""
    locks = held_build_locks(root)
    stale = []
    for lock in locks:
        if _building_in(lock.parent):
            continue
        time.sleep(settle_s)
        if lock.exists() and not _building_in(lock.parent):
            lock.unlink(missing_ok=True)
            log.warning("removed a stale JIT build lock %s (left by a build that was killed; nothing builds there "
                        "now); without this every rank would wait on it forever", lock)
            stale.append(lock)
    return stale


def prebuild_shm_op(accelerator: str, env: dict, timeout_s: float = 900) -> None:
    """Make sure the shm op is built before the ranks start: under `build_flock`, remove a stale lock, then, if no
    built op is there yet, build it once in a child process (which dies with us). The ranks then only load it."""
    if accelerator != "cpu":
        return  # the op is DeepSpeed's CPU accelerator's comm backend
    with build_flock():
        clear_stale_build_locks()
        if any((d / f"{SHM_OP}.so").exists() for d in build_dirs()):
            return
        from lifecycle.core.procs import die_with_parent

        code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"  # what each rank does
        t0 = time.monotonic()
        log.info("building DeepSpeed's CPU shm op once before the ranks start (%s)", extensions_root())
        try:
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                  timeout=timeout_s, preexec_fn=die_with_parent)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"building DeepSpeed's CPU shm op did not finish in {timeout_s:g} s under "
                               f"{extensions_root()}{build_lock_note()}") from None
        if done.returncode != 0:
            raise RuntimeError(f"building DeepSpeed's CPU shm op failed (exit {done.returncode}) under "
                               f"{extensions_root()}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        log.info("DeepSpeed's CPU shm op built in %.0f s", time.monotonic() - t0)


# ------------------------------------------------------------------------------------------ shared memory

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"  # deepspeed/ops/csrc/cpu/comm/shm.cpp: <prefix>_<uid>_<addr>_<port>_<rank>


def shm_buffers(port: int) -> list[Path]:
    """This user's DeepSpeed all-reduce buffers of the launch on `port`."""
    pattern = re.compile(rf"{SHM_PREFIX}_{os.getuid()}_.+_{port}_\d+")
    return sorted(p for p in SHM_DIR.glob(f"{SHM_PREFIX}_*") if pattern.fullmatch(p.name)) if SHM_DIR.is_dir() else []


def release_shm(port: int) -> list[str]:
    """Unlink the DeepSpeed all-reduce buffers of the launch on `port` (two per launch; DeepSpeed unlinks none, not
    even on a clean exit). Call it only once that launch's ranks are gone."""
    released = []
    for p in shm_buffers(port):
        p.unlink(missing_ok=True)
        released.append(p.name)
    return released


def state_dir() -> Path:
    """Per-user state of live supervisors: $XDG_RUNTIME_DIR/lifecycle, else /tmp/lifecycle-<uid>."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "lifecycle" if base else Path(f"/tmp/lifecycle-{os.getuid()}")


class Ownership:
    """The record `<state_dir>/supervisors/<pid>.json` that this process (pid + start time) owns the launch on
    `port` while it runs. `claim` first releases the buffers of every recorded supervisor that is dead (killed
    before it could release them), unless a live one owns the same port now."""

    def __init__(self, port: int, directory: Path | None = None):
        self.port, self.dir = port, (directory or state_dir()) / "supervisors"
        self.path = self.dir / f"{os.getpid()}-{port}.json"  # a supervisor with a standby world owns two ports

    def claim(self) -> list[str]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".flock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one claim at a time: a dead record is handled once
            records = [(p, self._read(p)) for p in self.dir.glob("*.json")]
            live = {r["port"] for _, r in records if r and same_process(r["pid"], r["start"])}
            released = []
            for path, rec in records:
                if rec and same_process(rec["pid"], rec["start"]):
                    continue
                if rec and rec["port"] not in live:
                    released += release_shm(rec["port"])
                path.unlink(missing_ok=True)
            if released:
                log.warning("released %d shared-memory buffer(s) left by dead supervisors: %s", len(released),
                            ", ".join(released))
            fs.atomic_write_json(self.path, {"pid": os.getpid(), "start": start_time(os.getpid()), "port": self.port})
        return released

    def release(self) -> list[str]:
        """Release this launch's buffers and drop the record (its ranks are gone)."""
        released = release_shm(self.port)
        self.path.unlink(missing_ok=True)
        return released

    @staticmethod
    def _read(path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # torn by a kill mid-write: nothing to release


# ------------------------------------------------------------------------------------------ worlds of ranks


def standby_ready(run_dir: Path, ranks: int, world: str) -> bool:
    """Every rank of standby world `world` is built and waiting."""
    return all(ready_path(run_dir, r, world).exists() for r in range(ranks))


class World:
    """One world of a launch's ranks: their processes (`Launch`), rendezvous port and shared-memory buffers
    (`Ownership`), and heartbeats. A launch's first world trains from the start. A standby world
    (`train.launch.spares`, `start_standby`) runs the same command with `LIFECYCLE_STANDBY` naming its go file:
    its ranks build everything up to the restore, write `rank<r>.ready` and wait; `promote` writes the go file,
    and they restore the newest commit and train on. Each world is its own process group on its own port, so
    stopping one leaves the other running."""

    def __init__(self, name: str, launch: Launch, owner: Ownership, beats: Heartbeats, go: Path | None = None):
        self.name, self.launch, self.owner, self.beats, self.go = name, launch, owner, beats, go
        self.run_dir = beats.dir.parent

    @classmethod
    def start_standby(cls, name: str, cmd: list[str], env: dict, ranks: int, run_dir: Path, log,
                      stall_s: float) -> "World":
        """`ranks` local ranks of standby world `name` on a free port. Until promoted, only their liveness is
        watched (a standby may wait for hours): a silent rank for `stall_s` is named, no start-up bound applies."""
        from lifecycle.core.procs import free_port

        beats = Heartbeats(run_dir, ranks, stall_s, startup_s=float("inf"), world=name)  # clears old beats
        go = beats.dir / "go"
        port = free_port()
        owner = Ownership(port)
        owner.claim()
        try:
            launch = Launch.start_local(cmd, local_rank_envs({**env, WORLD_ENV: name, STANDBY_ENV: str(go)}, ranks,
                                                             port), run_dir, log)
        except BaseException:
            owner.release()
            raise
        return cls(name, launch, owner, beats, go)

    @property
    def port(self) -> int:
        return self.owner.port

    def ready(self) -> bool:
        """Every rank of a standby world is built and waiting."""
        return standby_ready(self.run_dir, self.beats.ranks, self.name)

    def promote(self, startup_s: float) -> None:
        """Let a standby world train: from now on it is watched like a launch's first world (its start-up bound
        counts from here: the restore is what is left of its start-up)."""
        self.beats.started, self.beats.startup_s = time.time(), startup_s
        fs.atomic_write_bytes(self.go, b"")
        self.go = None

    def stop(self, term_timeout: float = 15) -> None:
        """Stop every process of the world and release its buffers."""
        self.launch.stop(term_timeout=term_timeout)
        self.owner.release()


class Supervision:
    """Watch a launch to its end. Its world of ranks fails the launch when a rank exits non-zero or stalls, or when
    `launch.timeout_s` passes; every process is stopped first. With `launch.spares`, a rank failure or stall
    instead promotes a standby world (`World`), which restores the newest commit and trains on, `spares` times at
    most. The standby is started once the training world steps (so it does not slow the ranks' own start-up), and
    again after each promotion while failures remain; a standby that fails itself is stopped and not replaced.
    Each promotion is a `[supervisor]` line in train.log and a line of `<run_dir>/promotions.jsonl`."""

    def __init__(self, world: World, cfg: TrainConfig, cmd: list[str], env: dict, run_dir: Path, log, tail):
        self.world, self.cfg, self.cmd, self.env, self.run_dir, self.log, self.tail = (
            world, cfg, cmd, env, run_dir, log, tail)
        self.spare: World | None = None
        self.promotions = self.standbys = 0
        self.log_path = run_dir / "train.log"

    def run(self) -> int:
        """Block until the ranks exit 0; returns how many standby worlds were promoted."""
        limit, start = self.cfg.launch.timeout_s, time.monotonic()
        try:
            while True:
                try:
                    if self.world.launch.poll():  # a rank that exits non-zero stops its world, raises RankFailed
                        break
                    if (stall := self.world.beats.check()) is not None:
                        note = "" if self.world.beats.stepping() else build_lock_note()
                        raise TimeoutError(f"{stall}; ranks killed{note}")
                except (TimeoutError, RankFailed) as failure:
                    if self.spare is None:
                        raise
                    self.promote(failure)
                    continue
                self.tail.poll()
                if limit is not None and time.monotonic() - start > limit:
                    raise TimeoutError(f"training exceeded train.launch.timeout_s={limit}; ranks killed")
                self.tend_spare()
                time.sleep(0.1 if self.cfg.launch.spares else 0.5)
        except BaseException as e:
            self.world.launch.stop()  # the standby, if any, is stopped below
            if isinstance(e, (TimeoutError, RankFailed)):
                raise RuntimeError(f"{e}. Last lines of {self.log_path}:\n{_tail(self.log_path)}") from e
            raise
        finally:
            self.world.owner.release()
            if self.spare is not None:
                self.spare.stop()  # still waiting: its ranks have nothing to keep
            for old in self.run_dir.glob("heartbeat-spare*"):
                shutil.rmtree(old, ignore_errors=True)
        return self.promotions

    def promote(self, failure: BaseException) -> None:
        failed, spare = self.world, self.spare
        t0 = time.time()
        failed.stop()  # after a rank exit its world is stopped already; after a stall it is stopped here
        spare.promote(self.cfg.launch.startup_s)
        self.world, self.spare = spare, None
        self.promotions += 1
        left = self.cfg.launch.spares - self.promotions
        failed.launch._say(f"{failure}: promoted standby world {spare.name} (port {spare.port}, "
                           f"{'ready' if spare.ready() else 'still starting'}) after {time.time() - t0:.2f}s; it "
                           f"restores the newest commit and trains on ({left} more failure(s) recovered this way)")
        with open(self.run_dir / "promotions.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "failed_at": t0, "world": spare.name, "port": spare.port,
                                "failure": str(failure), "left": left}) + "\n")

    def tend_spare(self) -> None:
        """Start a standby once the training world steps, while failures remain; drop one that fails."""
        if self.spare is None:
            if self.standbys < self.cfg.launch.spares and self.world.beats.stepping():  # each promotion used one
                self.standbys += 1
                name = f"spare{self.standbys}"
                self.spare = World.start_standby(name, self.cmd, self.env, self.cfg.batch.num_ranks, self.run_dir,
                                                 self.log, self.cfg.launch.stall_s)
                self.spare.launch._say(f"standby world {name} started on port {self.spare.port}")
            return
        try:
            self.spare.launch.poll()
            problem = self.spare.beats.check()
        except RankFailed as e:
            problem = str(e)
        if problem is not None:
            self.spare.stop()
            self.spare.launch._say(f"standby world {self.spare.name} failed ({problem}); the launch goes on "
                                   "without a standby")
            self.spare = None



def _tail(path: Path, n: int = 60) -> str:
    with open(path, "rb") as f:
        return b"".join(deque(f, maxlen=n)).decode(errors="replace")
