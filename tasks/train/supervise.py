"""What `launch.run_train` does around a launch so that no wait is unbounded: the JIT build lock of DeepSpeed's CPU
shm op, the shared-memory buffers a launch leaves behind, and the ranks' heartbeats.

- **Build lock.** DeepSpeed JIT-builds its CPU comm op under torch's `FileBaton`: a plain `lock` file in the build
  directory, created with O_EXCL and deleted after the build. A process killed during the build leaves it, and
  every later rank waits on it forever. `clear_stale_build_locks` removes such a lock when nothing is building,
  under an flock of ours (which the OS drops when its holder dies), and `prebuild_shm_op` builds the op once, under
  that flock, before the ranks start, so ranks never race each other through a build.
- **Shared memory.** DeepSpeed names its buffers `deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>`
  and never unlinks them. A launch releases exactly its own port's buffers when it ends, and records which port it
  owns (`Ownership`), so a later launch releases the leftovers of a supervisor that died, never a live one's.
- **Heartbeats.** Each rank writes `<run_dir>/heartbeat/rank<N>` after every step; `Heartbeats.check` fails the
  launch when a rank makes no step for `stall_bound` (see `LaunchConfig.stall_s`, `startup_s`). Before its first
  step (imports, engine set-up, a JIT build, a restore: up to `startup_s`), a rank shows it is alive instead: a
  thread started on its first lines rewrites `heartbeat/rank<N>.alive` every `ALIVE_EVERY_S`, so a rank that is
  stopped, dead or stuck holding the GIL in start-up is named after `stall_s`, not after `startup_s`.

No torch here: the supervisor never imports it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from lifecycle.core import fs
from lifecycle.core.procs import same_process, start_time

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


def _building_in(build_dir: Path) -> bool:
    """Whether a live process works in `build_dir`: ninja and the compilers run with it as their working directory
    or name it on their command line."""
    target = str(build_dir.resolve())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            if cwd == target or cwd.startswith(target + "/") or target.encode() in (proc / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


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
    locks = [d / "lock" for d in build_dirs(root) if (d / "lock").exists()]
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
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=timeout_s, preexec_fn=die_with_parent)
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
    """Unlink the DeepSpeed all-reduce buffers of the launch on `port` (two of 66 MiB per launch here; DeepSpeed
    unlinks none, not even on a clean exit). Call it only once that launch's ranks are gone."""
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


# ------------------------------------------------------------------------------------------ heartbeats


WORLD_ENV = "LIFECYCLE_WORLD"  # a rank's world: "" for the launch's first, "spare<k>" for its k-th standby world
STANDBY_ENV = "LIFECYCLE_STANDBY"  # a standby world's go file: its ranks wait for it before they restore and train


def heartbeat_dir(run_dir: Path, world: str = "") -> Path:
    """`heartbeat/` of the launch's first world of ranks, `heartbeat-<world>/` of a standby world (`launch.spares`)."""
    return Path(run_dir) / (f"heartbeat-{world}" if world else "heartbeat")


def write_heartbeat(run_dir: Path, rank: int, step: int, step_time: float | None, pid: int | None = None,
                    world: str = "") -> None:
    """A rank's `heartbeat/rank<N>`: its last completed step, when, its pid (this process's unless given), and how
    long that step took."""
    _write_beat(heartbeat_dir(run_dir, world) / f"rank{rank}",
                {"step": step, "time": time.time(), "pid": pid or os.getpid(), "step_time": step_time})


def _write_beat(path: Path, beat: dict) -> None:
    """`beat` as `path`'s whole content, never half of it (written beside it, then renamed over it)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(beat))
    os.replace(tmp, path)


ALIVE_EVERY_S = 2.0  # a rank's start-up liveness beat (`start_alive_beat`); silence is judged after 3 of them at least


def alive_path(run_dir: Path, rank: int, world: str = "") -> Path:
    return heartbeat_dir(run_dir, world) / f"rank{rank}.alive"


def ready_path(run_dir: Path, rank: int, world: str) -> Path:
    """Written by a standby world's rank once it is built and waits for its go file (`Trainer.wait_for_promotion`)."""
    return heartbeat_dir(run_dir, world) / f"rank{rank}.ready"


def standby_ready(run_dir: Path, ranks: int, world: str) -> bool:
    """Every rank of standby world `world` is built and waiting."""
    return all(ready_path(run_dir, r, world).exists() for r in range(ranks))


def start_alive_beat(run_dir: Path, rank: int, every: float = ALIVE_EVERY_S, world: str = "") -> None:
    """In a rank, from its first lines (stdlib only, before the slow imports): a daemon thread that rewrites
    `heartbeat/rank<N>.alive` every `every` seconds. It goes quiet when the rank is stopped (SIGSTOP), dead, or
    stuck in native code that holds the GIL; a rank merely waiting (a JIT build in a subprocess, a collective, a
    restore) keeps it going."""
    import threading

    path = alive_path(run_dir, rank, world)

    def beat() -> None:
        while True:
            try:
                _write_beat(path, {"time": time.time(), "pid": os.getpid()})
            except OSError:  # the run dir is gone (the launch is over) or full: the supervisor judges the silence
                pass
            time.sleep(every)

    threading.Thread(target=beat, name="lifecycle-alive", daemon=True).start()


def rank_alive_beat(argv: list[str]) -> None:
    """`start_alive_beat` for the rank that `argv` (`... --config <run_dir>/config.json`) and $RANK describe."""
    config = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if config is None and "--config" in argv[:-1]:
        config = argv[argv.index("--config") + 1]
    if config is not None:
        start_alive_beat(Path(config).parent, int(os.environ.get("RANK", "0")), world=os.environ.get(WORLD_ENV, ""))


def _state(pid: int) -> str:
    """`stopped`, `gone`, ... of a local pid, from /proc (empty where it cannot be read, e.g. a remote rank)."""
    try:
        code = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "D": "in uninterruptible I/O"}.get(code, "running")


class Heartbeats:
    """The supervisor's view of the ranks' heartbeats. A rank that made no step for `stall_bound()` seconds (or that
    sent none `startup_s` after the launch) stalls the launch; `check()` then returns a message naming it."""

    def __init__(self, run_dir: Path, ranks: int, stall_s: float, startup_s: float, world: str = ""):
        self.dir, self.ranks, self.stall_s, self.startup_s = heartbeat_dir(run_dir, world), ranks, stall_s, startup_s
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.iterdir():  # a previous launch's
            old.unlink(missing_ok=True)
        self.started = time.time()
        self.step_times: dict[tuple[int, int], float] = {}

    def read(self) -> dict[int, dict]:
        beats = {}
        for r in range(self.ranks):
            try:
                beats[r] = json.loads((self.dir / f"rank{r}").read_text())
            except (OSError, ValueError):
                continue
            if beats[r].get("step_time") is not None:
                self.step_times[(r, beats[r]["step"])] = beats[r]["step_time"]
        return beats

    def _silent_in_start_up(self, ranks: list[int], now: float) -> str | None:
        """A rank still starting whose liveness beat (`start_alive_beat`) is older than `stall_s` (3 beats at least),
        or that has sent none that long after the launch: it is stopped, dead or wedged, and the others wait on it."""
        silent, bound = [], max(self.stall_s, 3 * ALIVE_EVERY_S)
        for r in ranks:
            try:
                alive = json.loads((self.dir / f"rank{r}.alive").read_text())
            except (OSError, ValueError):
                alive = None
            since = alive["time"] if alive else self.started
            if now - since > bound:
                who = f"rank {r} (pid {alive['pid']}, {_state(alive['pid'])})" if alive else f"rank {r}"
                silent.append(f"{who} silent for {now - since:.0f} s" if alive else
                              f"{who} gave no sign of life {now - since:.0f} s after the launch")
        if not silent:
            return None
        return (f"training stalled in start-up, before the first step: {'; '.join(silent)} "
                f"(train.launch.stall_s={self.stall_s:g})")

    def stepping(self) -> bool:
        """Every rank has made a step in this launch (a beat with its step time; the beat after start-up has none)."""
        beats = self.read()
        return len(beats) == self.ranks and all(b.get("step_time") is not None for b in beats.values())

    def stall_bound(self) -> float:
        """max(stall_s, 10 x the median step time seen so far)."""
        median = statistics.median(self.step_times.values()) if self.step_times else 0.0
        return max(self.stall_s, 10 * median)

    def check(self, now: float | None = None) -> str | None:
        now = now or time.time()
        beats = self.read()
        if len(beats) < self.ranks:  # still starting: imports, the op build, restore, the first step
            missing = [r for r in range(self.ranks) if r not in beats]
            if now - self.started > self.startup_s:
                return (f"rank(s) {', '.join(map(str, missing))} sent no heartbeat {now - self.started:.0f} s after "
                        f"the launch (train.launch.startup_s={self.startup_s:g})")
            return self._silent_in_start_up(missing, now)
        bound = self.stall_bound()
        if max(now - b["time"] for b in beats.values()) <= bound:
            return None
        # every rank waits in a collective for the one that stopped; name the one whose process is not running
        # (stopped, gone), else the one with the oldest heartbeat
        order = sorted(beats, key=lambda r: (_state(beats[r]["pid"]) == "running", beats[r]["time"]))
        parts = [f"rank {r} (pid {beats[r]['pid']}, {_state(beats[r]['pid'])}) last step {beats[r]['step']} "
                 f"{now - beats[r]['time']:.0f} s ago" for r in order]
        return f"training stalled: no step for more than {bound:.0f} s: " + "; ".join(parts)


# ------------------------------------------------------------------------------------------ the ranks' processes


def local_rank_envs(env: dict, ranks: int, master_port: int, master_addr: str = "127.0.0.1") -> list[dict]:
    """Each local rank's environment, exactly as DeepSpeed's per-node launcher (deepspeed/launcher/launch.py, 0.19)
    sets it for the world `{localhost: [0, ..., ranks - 1]}` at node rank 0: the accelerator's visible devices
    (CUDA_VISIBLE_DEVICES for DeepSpeed's CPU and CUDA accelerators alike), MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
    CROSS_RANK, CROSS_SIZE, LOCAL_SIZE, then RANK and LOCAL_RANK per rank; and, because the launcher's own
    `import deepspeed` put it in the environment it copies, PYTORCH_NVML_BASED_CUDA_CHECK=1 unless set. It sets no
    thread variable unless it binds cores (we do not): OMP_NUM_THREADS comes in `env`.
    tests/train/test_supervise.py compares this with what the launcher gives."""
    node = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", **env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(ranks))),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port), "WORLD_SIZE": str(ranks), "CROSS_RANK": "0", "CROSS_SIZE": "1",
            "LOCAL_SIZE": str(ranks)}
    return [{**node, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(ranks)]


class RankFailed(RuntimeError):
    """A rank (or the launcher) exited with a non-zero code; the others were stopped."""


class Launch:
    """The processes of one launch, all in one process group that this process owns: the local ranks started
    directly (`start_local`), or DeepSpeed's launcher with everything it starts (`start_launcher`, the hostfile
    path). Each dies with the thread that started it (PR_SET_PDEATHSIG) and, from the trainer's first lines, with
    the supervisor (`watch_parent_run` kills the group). Stdin is /dev/null; stdout and stderr go to `log`.

    What DeepSpeed's per-node launcher did for the ranks it started, `poll` and `stop` do now: a rank that exits
    non-zero stops the others (SIGTERM to the group, SIGKILL after `term_timeout`; the launcher gave 30 s) and fails
    the launch naming it; the supervisor's ^C/SIGTERM stops them the same way (run_train calls `stop`)."""

    def __init__(self, procs: list[tuple[str, subprocess.Popen]], log):
        self.procs, self.log, self.pgid = procs, log, procs[0][1].pid
        self.reported: set[str] = set()

    @classmethod
    def start_local(cls, cmd: list[str], envs: list[dict], cwd: Path, log) -> "Launch":
        """One process per rank, `cmd` with `envs[r]`; rank 0 leads a new process group, the others join it (a new
        group, not a session: a group can only be joined inside its session). A terminal's ^C reaches only the
        foreground group, so only the supervisor, which then stops the ranks."""
        from lifecycle.core.procs import die_with_parent

        procs: list[tuple[str, subprocess.Popen]] = []
        try:
            for r, env in enumerate(envs):
                p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, process_group=procs[0][1].pid if procs else 0,
                                     preexec_fn=die_with_parent)
                procs.append((f"rank {r}", p))
        except BaseException:
            if procs:
                cls(procs, log).stop()
            raise
        return cls(procs, log)

    @classmethod
    def start_launcher(cls, cmd: list[str], env: dict, cwd: Path, log) -> "Launch":
        """DeepSpeed's launcher in its own session: its ranks are its children, in its group."""
        from lifecycle.core.procs import die_with_parent

        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, preexec_fn=die_with_parent)
        return cls([("deepspeed", p)], log)

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs}

    def poll(self) -> bool:
        """True once every process has exited 0. A non-zero exit stops the rest and raises RankFailed."""
        codes = {name: p.poll() for name, p in self.procs}
        for name, code in codes.items():
            if code is not None and name not in self.reported:
                self.reported.add(name)
                self._say(f"{name} (pid {self.pids[name]}) exited with code {code}")
        failed = [(name, code) for name, code in codes.items() if code not in (None, 0)]
        if failed:
            name, code = failed[0]
            others = [n for n, c in codes.items() if c is None]
            self.stop()
            raise RankFailed(f"{name} exited with code {code}"
                             + (f"; stopped {', '.join(others)}" if others else ""))
        return all(code == 0 for code in codes.values())

    def stop(self, term_timeout: float = 15, kill_timeout: float = 10) -> None:
        """SIGTERM the group, SIGKILL what is left after `term_timeout`, and collect every exit."""
        from lifecycle.core.procs import stop_group

        stop_group(self.pgid, term_timeout=term_timeout, kill_timeout=kill_timeout)
        for _, p in self.procs:
            try:
                p.wait(timeout=0.1)
            except subprocess.TimeoutExpired:  # left the group (setsid) and survived SIGKILL of it: not ours now
                log.warning("process %d of the launch is still running after stopping group %d", p.pid, self.pgid)

    def _say(self, line: str) -> None:
        self.log.write(f"[supervisor] {line}\n".encode())
        self.log.flush()


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
