"""The ranks' heartbeats and the supervisor's judgement of them, so that no wait of a launch is unbounded.

Each rank writes `<run_dir>/heartbeat/rank<N>` after every step; `Heartbeats.check` fails the launch when a rank
makes no step for `stall_bound` (see `LaunchConfig.stall_s`, `startup_s`). Before its first step (imports, engine
set-up, a JIT build, a restore: up to `startup_s`), a rank shows it is alive instead: a thread started on its
first lines rewrites `heartbeat/rank<N>.alive` every `ALIVE_EVERY_S`, so a rank that is stopped, dead or stuck
holding the GIL in start-up is named after `stall_s`, not after `startup_s`. A standby world's ranks
(`train.launch.spares`) beat in `heartbeat-<world>/` and write `rank<N>.ready` once they wait for their go file.

Standard library only: a rank imports this on its first lines, before the slow imports.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path

HOST = socket.gethostname()  # a beat names its node: the supervisor may run on another one
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
                {"step": step, "time": time.time(), "pid": pid or os.getpid(), "step_time": step_time,
                 "host": HOST})


def _write_beat(path: Path, beat: dict) -> None:
    """`beat` as `path`'s whole content, never half of it (written beside it, then renamed over it)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(beat))
    os.replace(tmp, path)


SUPERVISOR_BEAT = "supervisor.beat"


class SupervisorBeat:
    """The supervisor's own beat, for the ranks DeepSpeed starts over ssh on other machines, which cannot watch its
    pid: while the launch runs, a daemon thread rewrites `<run_dir>/supervisor.beat` (`SUPERVISOR_BEAT`) every
    `every` seconds; a killed supervisor's beat stops, and those ranks stop themselves
    (`lifecycle.core.procs.watch_parent_run`, given the path by the trainer's first lines)."""

    def __init__(self, run_dir: Path, every: float = 1.0):
        import threading

        self.path, self.every, self.stopped = Path(run_dir) / SUPERVISOR_BEAT, every, threading.Event()
        self.launch = f"{HOST}:{os.getpid()}:{time.time_ns()}"  # this launch's: a rank of an earlier one stops
        self.thread = threading.Thread(target=self._beat, name="lifecycle-supervisor-beat", daemon=True)

    def _beat(self) -> None:
        n = 0
        while True:
            try:
                _write_beat(self.path, {"launch": self.launch, "n": n, "time": time.time()})
            except OSError:  # a full or vanished run dir: the ranks judge the silence
                pass
            n += 1
            if self.stopped.wait(self.every):
                return

    def __enter__(self) -> "SupervisorBeat":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()
        self.path.unlink(missing_ok=True)


ALIVE_EVERY_S = 2.0  # a rank's start-up liveness beat (`start_alive_beat`); silence is judged after 3 of them at least


def alive_path(run_dir: Path, rank: int, world: str = "") -> Path:
    return heartbeat_dir(run_dir, world) / f"rank{rank}.alive"


def ready_path(run_dir: Path, rank: int, world: str) -> Path:
    """Written by a standby world's rank once it is built and waits for its go file (`Trainer.wait_for_promotion`)."""
    return heartbeat_dir(run_dir, world) / f"rank{rank}.ready"


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


def run_dir_of(argv: list[str]) -> Path | None:
    """The run dir of the rank that `argv` (`... --config <run_dir>/config.json`) describes."""
    config = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if config is None and "--config" in argv[:-1]:
        config = argv[argv.index("--config") + 1]
    return None if config is None else Path(config).parent


def rank_alive_beat(argv: list[str]) -> None:
    """`start_alive_beat` for the rank that `argv` and $RANK describe."""
    if (run_dir := run_dir_of(argv)) is not None:
        start_alive_beat(run_dir, int(os.environ.get("RANK", "0")), world=os.environ.get(WORLD_ENV, ""))


def _state(pid: int, host: str | None = None) -> str:
    """`stopped`, `gone`, ... of a local pid, from /proc; `on <host>` for a rank of another node."""
    if host and host != HOST:
        return f"on {host}"
    try:
        code = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "D": "in uninterruptible I/O"}.get(code, "running")


class Heartbeats:
    """The supervisor's view of the ranks' heartbeats. A rank that made no step for `stall_bound()` seconds (or that
    sent none `startup_s` after the launch) stalls the launch; `check()` then returns a message naming it."""

    def __init__(self, run_dir: Path, ranks: int, stall_s: float, startup_s: float, world: str = "",
                 last_step: int | None = None):
        self.dir, self.ranks, self.stall_s, self.startup_s = heartbeat_dir(run_dir, world), ranks, stall_s, startup_s
        self.last_step = last_step
        """The run's last step (max_steps): once every rank has made it the ranks commit and tear down, which
        under load can outlast a short stall bound (a false stall after step 20 at stall_s=10): start-up's bound."""
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
        if self.last_step is not None and all(b["step"] >= self.last_step for b in beats.values()):
            bound = max(bound, self.startup_s)  # the final commit and the teardown, not a step
        if max(now - b["time"] for b in beats.values()) <= bound:
            return None
        # every rank waits in a collective for the one that stopped; name the one whose process is not running
        # (stopped, gone), else the one with the oldest heartbeat
        states = {r: _state(b["pid"], b.get("host")) for r, b in beats.items()}
        order = sorted(beats, key=lambda r: (states[r] == "running" or states[r].startswith("on "), beats[r]["time"]))
        parts = [f"rank {r} (pid {beats[r]['pid']}, {states[r]}) last step {beats[r]['step']} "
                 f"{now - beats[r]['time']:.0f} s ago" for r in order]
        cut = self.unreachable_nodes(beats)
        return (f"training stalled: no step for more than {bound:.0f} s: " + (f"{cut}; " if cut else "")
                + "; ".join(parts))

    def unreachable_nodes(self, beats: dict[int, dict], port: int = 22, timeout: float = 3.0) -> str | None:
        """With a hostfile (`train.launch.hostfile` in the run's config.json): the nodes that do not answer on
        their ssh port, named with their ranks' last step, since every rank of the others then waits on them in a
        collective. None when all answer (or there is no hostfile)."""
        try:
            launch = json.loads((self.dir.parent / "config.json").read_text())["train"]["launch"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not launch.get("hostfile"):
            return None
        from types import SimpleNamespace

        from lifecycle.tasks.train.launcher import read_hostfile, select_hosts

        try:
            hosts = select_hosts(read_hostfile(launch["hostfile"]), SimpleNamespace(**launch))
        except (ValueError, TypeError):
            return None
        cut, first = [], 0
        for host, slots in hosts.items():  # the launcher numbers ranks node by node, in hostfile order
            ranks = [r for r in range(first, first + slots) if r in beats]
            first += slots
            try:
                socket.create_connection((host, port), timeout=timeout).close()
            except OSError as e:
                last = max((beats[r]["step"] for r in ranks), default=None)
                cut.append(f"node {host} (ranks {first - slots}-{first - 1}, last step {last}) does not answer "
                           f"on port {port}: {e.strerror or type(e).__name__}")
        return "; ".join(cut) or None
