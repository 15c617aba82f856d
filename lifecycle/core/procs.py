"""Processes: a free local port, and stopping a process group (a server and its workers, a launcher and its ranks)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path


class Terminated(BaseException):
    """SIGTERM (from `timeout`, systemd, Kubernetes) ends a run the way ^C does: the exception unwinds the flow, the
    train supervisor stops the ranks, nothing half-written is committed, and the command exits 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @classmethod
    def raise_for(cls, signum: int, _frame) -> None:
        """A signal handler: `signal.signal(signal.SIGTERM, Terminated.raise_for)`. It also arms `stop_deadline`."""
        stop_deadline(signum)
        raise cls(signum)


STOP_DEADLINE_S = 20.0  # `stop_deadline`'s default; $LIFECYCLE_STOP_DEADLINE_S overrides it
_deadline_armed = False


def stop_deadline(signum: int, after: float | None = None) -> None:
    """Once per process: a daemon thread that ends the process with 128 + `signum` if it is still alive `after`
    seconds (`STOP_DEADLINE_S`) after the signal. An orderly stop is quicker (bench.chaos `flow_sigterm`, in
    docs/benchmarks.md). But an exit handler
    can wait for ever, on a pool worker, or on a write to the stdio of a killed command whose reader is gone, and
    SIGTERM must end a run within 30 s. Nothing is lost by this: every commit is an atomic rename, the ranks die
    with this process (PR_SET_PDEATHSIG), and the shard workers watch it. The one line goes to fd 2 without
    blocking, past Python's stream locks."""
    global _deadline_armed
    if _deadline_armed:
        return
    _deadline_armed = True
    import threading

    after = after if after is not None else float(os.environ.get("LIFECYCLE_STOP_DEADLINE_S", STOP_DEADLINE_S))

    def expire() -> None:
        time.sleep(after)
        line = (f"lifecycle: still stopping {after:g} s after {signal.Signals(signum).name}; ending now (the last "
                "commit stands)\n").encode()
        try:
            fd = os.dup(2)
            os.set_blocking(fd, False)
            os.write(fd, line)
        except OSError:  # a full or closed pipe: exit anyway
            pass
        os._exit(128 + signum)

    threading.Thread(target=expire, name="lifecycle-stop-deadline", daemon=True).start()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it; a race with another process is possible)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def mem_available() -> int | None:
    """This host's MemAvailable in bytes (/proc/meminfo), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Zombies do not count: a rank's persist process, orphaned when
    the rank died, waits for init to reap it, which took over a second in a container here."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return not Path("/proc/self/stat").exists()  # no /proc to tell: alive, as killpg says


def _reap(pgid: int) -> None:
    """Collect the exit status of every child of ours in process group `pgid` that has exited (no zombie keeps the
    group 'alive': the ranks of a launch are all our children, in one group)."""
    try:
        while os.waitpid(-pgid, os.WNOHANG)[0] != 0:
            pass
    except ChildProcessError:
        pass


def stop_group(pgid: int, term_timeout: float = 15, kill_timeout: float = 10) -> None:
    """SIGTERM the process group `pgid` (its leader and everything it forked), wait up to `term_timeout`,
    then SIGKILL what is left and wait up to `kill_timeout` for it to go. Stopped members are resumed."""
    for sig, timeout in ((signal.SIGTERM, term_timeout), (signal.SIGKILL, kill_timeout)):
        try:
            os.killpg(pgid, sig)
            os.killpg(pgid, signal.SIGCONT)  # a stopped process (SIGSTOP, a debugger) acts on SIGTERM only once resumed
        except ProcessLookupError:
            return
        deadline = time.time() + timeout
        while group_alive(pgid) and time.time() < deadline:
            _reap(pgid)
            time.sleep(0.1)
        _reap(pgid)
        if not group_alive(pgid):
            return


# ---------------------------------------------------------------------------------------------- dying together

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl():
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # libc's, already loaded: nothing to look up after a fork
    except (OSError, AttributeError):
        return None  # not Linux


_PRCTL = _prctl()


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when the thread that started it exits (PR_SET_PDEATHSIG; a no-op
    off Linux). Survives exec, not fork: each generation must ask for itself. Safe as a `preexec_fn`."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def own_session_dying_with_parent() -> None:
    """`preexec_fn` for a helper process: its own session (a terminal's ^C or a SIGTERM to our process group does
    not reach it, so it outlives our clean-up), but SIGTERM when we die, however we die."""
    os.setsid()
    die_with_parent(signal.SIGTERM)


def start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22), or None if it is gone: with the
    pid it names one process, never a later one that reuses the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def same_process(pid: int, started: int | None) -> bool:
    """Whether the process `pid` that started at `started` (a `start_time`) still runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and (started is None or int(fields[19]) == started)


SUPERVISOR_SILENCE_ENV = "LIFECYCLE_SUPERVISOR_SILENCE_S"  # how long the supervisor's beat may stay unchanged
SUPERVISOR_SILENCE_S = 30.0


def watch_parent_run(interval: float = 1.0, beat: Path | None = None) -> None:
    """In a training rank: a daemon thread that kills this rank's whole process group (all local ranks, or the
    deepspeed launcher and its ranks) once the supervising run is gone, e.g. SIGKILLed. Their own group kept the
    ranks out of reach of signals to the supervisor's group; this keeps them from going on alone. A rank on the
    supervisor's machine watches its pid (LIFECYCLE_SUPERVISOR_PID, started at LIFECYCLE_SUPERVISOR_START, in the
    environment it inherited). A rank that DeepSpeed started over ssh, maybe on another machine, inherited no such
    pid: it watches `beat`, the file the supervisor rewrites every second on the shared run dir from before the
    launch (`tasks/train/heartbeats.py` `SupervisorBeat`; a rank started by hand finds none and watches nothing),
    and stops once that has not changed for
    LIFECYCLE_SUPERVISOR_SILENCE_S seconds, judged on this machine's clock. Stdlib only, so a rank starts it before
    its slow imports."""
    import threading

    pid = int(os.environ.get("LIFECYCLE_SUPERVISOR_PID", "0"))
    started = int(os.environ["LIFECYCLE_SUPERVISOR_START"]) if os.environ.get("LIFECYCLE_SUPERVISOR_START") else None
    silence = float(os.environ.get(SUPERVISOR_SILENCE_ENV) or SUPERVISOR_SILENCE_S)

    def watch_pid() -> None:
        while same_process(pid, started):
            time.sleep(interval)
        kill_own_group(f"supervisor {pid} is gone")

    def watch_beat() -> None:
        kill_own_group(f"the supervisor's beat {beat} {wait_for_beat_end(beat, silence, interval)}")

    if pid or (beat is not None and beat.exists()):
        threading.Thread(target=watch_pid if pid else watch_beat, name="lifecycle-supervisor-watch",
                         daemon=True).start()


def wait_for_beat_end(path: Path, silence_s: float, interval: float = 1.0) -> str:
    """Return, saying why, once the beat file `path` has stayed the same (or absent) for `silence_s` seconds of this
    host's monotonic clock (the writer's clock, on another machine, is never compared with ours), or once it names
    another launch than the one it named first (a JSON object's `launch`): a rank of an earlier attempt, cut off
    from its supervisor, does not live on on the beat of the next attempt's."""
    def read() -> bytes | None:
        try:
            return path.read_bytes()
        except OSError:
            return None

    def launch(content: bytes | None):
        try:
            return json.loads(content).get("launch") if content else None
        except (ValueError, AttributeError):
            return None

    last = read()
    ours, since = launch(last), time.monotonic()
    while time.monotonic() - since <= silence_s:
        time.sleep(interval)
        if (now := read()) != last:
            if ours is not None and launch(now) not in (None, ours):
                return f"names another launch ({launch(now)}, not {ours})"
            last, since, ours = now, time.monotonic(), ours or launch(now)
    return f"has not changed for {silence_s:g} s"


def kill_own_group(why: str) -> None:
    print(f"{why}; stopping the ranks (the last commit stands)", flush=True)
    os.killpg(os.getpgrp(), signal.SIGKILL)
