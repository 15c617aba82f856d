"""The warm runner: a process that has imported what a run imports, and forks one child per `lifecycle run`.

`lifecycle up` starts one (`python -m lifecycle.launch --serve WORKDIR`); a cold run that used the embedded Prefect
server leaves one beside it (flows/startup/embedded_runner.py). It imports everything once, with the environment a
run has (`prepare_environment`), then waits on `runner_socket` (mode 0600, same user only: SO_PEERCRED). Each run
is a forked child that takes the command's stdio, cwd, environment and arguments and runs `lifecycle.cli.main`
(lifecycle/launch.py `child`): the code path of a cold run, minus the imports. What that saves: docs/benchmarks.md,
"Issue 25: a warm runner for `lifecycle up`". It declines a run (which then runs cold) for another work dir, an
environment or Prefect settings files that would import differently, changed project code (it then re-execs
itself), or a second thread (`decline_reason`).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Callable

from lifecycle.flows.startup.client import WARM_ENV
from lifecycle.flows.startup.embedded import read_embedded
from lifecycle.flows.startup.embedded_runner import embedded_runner_entry, write_embedded_runner_entry
from lifecycle.flows.startup.environment import prepare_environment
from lifecycle.flows.startup.messages import ACCEPT_TIMEOUT_S, recv_msg
from lifecycle.flows.startup.servers import active
from lifecycle.flows.startup.state import EMBEDDED_RUNNER, RUNNER, alive, runner_socket, state_dir

# environment variables read at import time by what the runner imports (Prefect's settings, MLflow, numba, torch,
# DeepSpeed, the interpreter) or by the project: a difference sends the run cold
SHAPING_PREFIXES = ("PREFECT_", "MLFLOW_", "LIFECYCLE_", "DS_", "OMP_", "MKL_", "CUDA_", "NCCL_", "TORCH", "NUMBA_",
                    "PYTHON", "XDG_", "HF_", "TOKENIZERS_")
SHAPING_KEYS = ("PATH", "HOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "DO_NOT_TRACK", "TZ")
PREFECT_FILES = ("prefect.toml", ".env")  # Prefect 3 reads its settings from these in the working directory


def shaping_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if (k.startswith(SHAPING_PREFIXES) or k in SHAPING_KEYS) and k != WARM_ENV}


def prefect_files(cwd: str | Path) -> dict[str, str | None]:
    out = {}
    for name in PREFECT_FILES:
        try:
            out[name] = (Path(cwd) / name).read_text(errors="replace")
        except OSError:
            out[name] = None
    return out


def code_stamp() -> tuple:
    """(path, mtime, size) of every module of the project's four folders: a change means the runner is stale."""
    import lifecycle
    import lifecycle.flows
    import lifecycle.lineage
    import lifecycle.tasks

    out = []
    for pkg in (lifecycle, lifecycle.flows, lifecycle.lineage, lifecycle.tasks):
        for root in pkg.__path__:
            for d, dirs, files in os.walk(root):
                dirs[:] = [x for x in dirs if x != "__pycache__"]
                for f in files:
                    if f.endswith(".py"):
                        st = os.stat(os.path.join(d, f))
                        out.append((os.path.join(d, f), st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


class Runner:
    """`up`'s runner, or (`embedded`) the one a cold run starts beside the work dir's embedded Prefect server
    (flows/startup/embedded_runner.py), which lives as long as that server. `preload()` imports what a run imports;
    `run_child(workdir, conn, msg, fds)` is the forked run (lifecycle/launch.py `child`), returning its exit code."""

    def __init__(self, workdir: Path, embedded: bool, preload: Callable[[], None],
                 run_child: Callable[[Path, socket.socket, dict, list[int]], int]):
        self.workdir, self.embedded, self.run_child = workdir, embedded, run_child
        self.argv = [sys.executable, "-m", "lifecycle.launch", "--serve-embedded" if embedded else "--serve",
                     str(workdir)]
        self.started_env = dict(os.environ)  # as `up` (or the cold run) started it: before prepare_environment
        self.env = shaping_env(self.started_env)
        self.files = prefect_files(os.getcwd())
        self.server: dict | None = None  # embedded: the server this runner's imports were set up for
        if embedded:
            self.server = self.embedded_setup()
        else:
            deadline = time.time() + 180
            while active(workdir) is None:  # `up` starts its servers and this runner at once
                if time.time() > deadline:
                    sys.exit(f"runner: the work dir's servers did not come up within 180 s ({workdir})")
                time.sleep(0.3)
            prepare_environment(workdir)  # what `lifecycle run` sets before it imports Prefect
        preload()
        if embedded and not os.environ.get("MLFLOW_TRACKING_URI"):
            from lifecycle.lineage.tracking import preload_sqlite_store

            preload_sqlite_store()  # the work dir's SQLite store, as a cold embedded run preloads it
        self.stamp = code_stamp()
        self.stale = False
        self.path = runner_socket(workdir, EMBEDDED_RUNNER if embedded else RUNNER)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old)
        self.sock.listen(16)
        print(f"runner {os.getpid()}: ready on {self.path} ({len(sys.modules)} modules imported)", flush=True)

    def embedded_setup(self) -> dict:
        """One embedded runner per work dir (its lock, held for life), then the server's environment, set as a
        run sets it but without counting as a user of the server (whose idle timer must still run)."""
        import fcntl

        self.lock_fd = os.open(state_dir(self.workdir) / f"{EMBEDDED_RUNNER}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.exit(f"runner: another embedded runner serves {self.workdir}")
        self.claim_entry()
        entry = read_embedded(self.workdir)
        if not entry or not alive(entry):
            sys.exit(f"runner: no embedded Prefect server is running for {self.workdir}")
        if prepare_environment(self.workdir, hold=False) != "embedded":
            sys.exit(f"runner: `lifecycle up`'s servers run for {self.workdir}; they have their own runner")
        return read_embedded(self.workdir) or entry

    def claim_entry(self) -> None:
        """Embedded: `embedded-runner.json` names this process (the lock holder), whoever wrote it last."""
        entry = embedded_runner_entry(self.workdir)
        if not entry or entry.get("pid") != os.getpid():
            write_embedded_runner_entry(self.workdir, os.getpid(), self.argv)

    def server_changed(self) -> str | None:
        """Embedded: why the server this runner was set up for is no longer the work dir's (None: it still is)."""
        if not self.embedded:
            return None
        now = read_embedded(self.workdir)
        if not now or not alive(now) or (now["pid"], now["url"]) != (self.server["pid"], self.server["url"]):
            return "the work dir's embedded Prefect server stopped or was replaced"
        if active(self.workdir) is not None:
            return "`lifecycle up`'s servers now run for the work dir"
        return None

    def decline_reason(self, msg: dict) -> str | None:
        import threading

        if threading.active_count() != 1:
            return f"the runner has {threading.active_count()} threads; a fork is safe only with one"
        env = shaping_env(msg["env"])
        if env != self.env:
            diff = sorted(k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k))
            return f"the environment differs from the runner's in {', '.join(diff[:5])}"
        if prefect_files(msg["cwd"]) != self.files:
            return f"{msg['cwd']} holds Prefect settings files ({', '.join(PREFECT_FILES)}) the runner's did not"
        if code_stamp() != self.stamp:
            return "the project's code changed since the runner started (it restarts now)"
        if (changed := self.server_changed()) is not None:
            return f"{changed} (the runner exits now)"
        return None

    def serve_forever(self) -> None:
        import select

        while True:
            self.reap()
            if not select.select([self.sock], [], [], 1.0)[0]:
                if self.embedded:
                    if (changed := self.server_changed()) is not None:
                        self.exit(changed)
                    self.claim_entry()
                continue
            conn, _ = self.sock.accept()
            try:
                self.handle(conn)
            except Exception as e:  # one bad client never stops the runner
                print(f"runner: a connection failed: {type(e).__name__}: {e}", flush=True)
            finally:
                conn.close()
            if self.stale:
                self.restart()

    @staticmethod
    def reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def handle(self, conn: socket.socket) -> None:
        conn.settimeout(ACCEPT_TIMEOUT_S)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        if uid != os.getuid():
            return
        msg, fds = recv_msg(conn)
        try:
            if msg.get("ping"):
                conn.sendall(json.dumps({"pong": os.getpid()}).encode() + b"\n")
                return
            reason = self.decline_reason(msg)
            if reason:
                conn.sendall(json.dumps({"declined": reason}).encode() + b"\n")
                print(f"runner: declined a run: {reason}", flush=True)
                self.stale = reason.startswith("the project's code changed")
                if reason.endswith("(the runner exits now)"):
                    self.exit(reason)
                return
            pid = os.fork()
            if pid == 0:
                try:
                    self.sock.close()
                    if self.embedded:
                        os.close(self.lock_fd)  # a run outliving this runner must not keep the next one out
                    os._exit(self.run_child(self.workdir, conn, msg, fds))
                finally:
                    os._exit(70)
            print(f"runner: run {' '.join(msg['argv'][1:])!r} in pid {pid}", flush=True)
        finally:
            for fd in fds:
                os.close(fd)

    def restart(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)
        sys.stdout.flush()
        os.execve(sys.executable, self.argv, self.started_env)

    def exit(self, why: str) -> None:
        """The embedded runner's end: its server is gone. Runs it forked go on (they hold their own files)."""
        print(f"runner: {why}; exiting", flush=True)
        self.sock.close()
        self.path.unlink(missing_ok=True)
        entry = embedded_runner_entry(self.workdir)
        if entry and entry.get("pid") == os.getpid():
            (state_dir(self.workdir) / f"{EMBEDDED_RUNNER}.json").unlink(missing_ok=True)
        sys.exit(0)
