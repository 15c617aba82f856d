"""Which Prefect and MLflow servers a run talks to, set in its environment before anything imports Prefect:
`lifecycle up`'s when both answer, else a configured `PREFECT_API_URL`, else the work dir's embedded Prefect server
(flows/startup/embedded.py), found running or started here, and MLflow on the work dir's SQLite file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from lifecycle.core.errors import UsageError
from lifecycle.core.procs import stop_group
from lifecycle.flows.startup import idle
from lifecycle.flows.startup.embedded import launch_embedded, read_embedded, unused_embedded
from lifecycle.flows.startup.servers import active, down
from lifecycle.flows.startup.state import alive, healthy, state_dir
from lifecycle.flows.startup.template import embedded_db, save_template, seed_from_template, template_path

EMBEDDED_START_TIMEOUT_S = 90.0
# This process's shared hold on `embedded.users`, for as long as it lives (the kernel drops it at exit), so the
# embedded server's idle timer never stops it under a run: process-wide by nature, hence a global.
_users_fd: int | None = None


def start_environment(workdir: str | Path, hold: bool = True) -> tuple[str, StartingServer | None]:
    """Use the work dir's servers when `lifecycle up` started them. Otherwise the embedded defaults: without
    a configured Prefect API, keep Prefect's home (its SQLite database and the ephemeral server it starts)
    inside the work dir, give the ephemeral server time to start on 2 cores, and let MLflow write SQLite.
    Returns (mode: servers, prefect-api or embedded; the embedded server found or launched, whose `wait()` the
    caller calls once it has imported Prefect and the flow, else None).
    `hold`: count this process as a user of the embedded server until it exits (a run; the embedded runner,
    which only waits for runs, does not hold it, so the server's idle timer still runs)."""
    live = active(workdir)
    if live:
        os.environ["PREFECT_API_URL"] = live["prefect_api"]
        os.environ["MLFLOW_TRACKING_URI"] = live["mlflow"]
    mode = "servers" if live else ("prefect-api" if os.environ.get("PREFECT_API_URL") else "embedded")
    if not os.environ.get("PREFECT_API_URL"):
        home = Path(os.environ.setdefault("PREFECT_HOME", str(Path(workdir) / ".prefect")))
        home.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    starting = None
    if mode == "embedded":
        starting = start_embedded(workdir, hold=hold)
        os.environ["PREFECT_API_URL"] = starting.url + "/api"
    return mode, starting


def prepare_environment(workdir: str | Path, hold: bool = True) -> str:
    """`start_environment`, waiting for the embedded server (if any) to answer. Returns the mode."""
    mode, starting = start_environment(workdir, hold)
    if starting is not None:
        starting.wait()
    return mode


def embedded_server(workdir: str | Path, timeout: float = EMBEDDED_START_TIMEOUT_S) -> dict:
    """The work dir's embedded Prefect server, started if none is running and healthy: {pid, url, ..., started}."""
    return start_embedded(workdir).wait(timeout)


def _lock(path: Path, mode: int) -> int:
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, mode)
    return fd


class StartingServer:
    """A server found running (`started` False) or just launched: `wait()` returns its entry once it answers.
    Until then this process holds `embedded.lock`, so a second run waits for this server instead of starting one."""

    def __init__(self, workdir: Path, lock_fd: int | None, entry: dict, proc: subprocess.Popen | None,
                 save_template: Path | None = None):
        self.workdir, self.lock_fd, self.entry, self.proc = workdir, lock_fd, entry, proc
        self.save_template = save_template  # a fresh database this server migrates: kept as the template

    @property
    def url(self) -> str:
        return self.entry["url"]

    def wait(self, timeout: float = EMBEDDED_START_TIMEOUT_S) -> dict:
        """Its entry once it answers. Its URL is fixed before it starts (this process exports it before Prefect
        is imported), so a server that could not bind its port is an error, not a retry on another port."""
        try:
            if self.proc is None:
                return {**self.entry, "started": False}
            deadline = time.time() + timeout
            while self.proc.poll() is None and not healthy(self.entry["health"], timeout=1):
                if time.time() > deadline:
                    stop_group(self.proc.pid, term_timeout=5)
                    raise UsageError(f"the embedded Prefect server did not answer within {timeout:.0f} s; see "
                                     f"{self.entry['log']} (or start servers with `lifecycle up`)")
                time.sleep(0.1)
            if self.proc.poll() is not None:
                raise UsageError(f"the embedded Prefect server exited during start-up (exit {self.proc.returncode}); "
                                 f"see {self.entry['log']}")
            if self.save_template is not None:
                save_template(embedded_db(self.workdir), self.save_template)
            return {**self.entry, "started": True}
        finally:
            if self.lock_fd is not None:
                os.close(self.lock_fd)
                self.lock_fd = None


def start_embedded(workdir: str | Path, hold: bool = True) -> StartingServer:
    """Find the work dir's embedded server, or launch one without waiting for it (the caller imports Prefect
    meanwhile, then calls `wait()`).

    Under an exclusive lock on `embedded.lock` (held until `wait()` returns), so two runs that start at once end
    with one server. A server whose process is gone, or that does not answer its health check, is replaced (a
    hung one is stopped first). The caller is counted as a user (`embedded.users`) until it exits, so the idle
    timer never stops the server under a run (`hold`)."""
    import fcntl

    global _users_fd
    workdir = Path(workdir).resolve()
    sdir = state_dir(workdir)
    sdir.mkdir(parents=True, exist_ok=True)
    if _users_fd is None and hold:
        _users_fd = _lock(sdir / "embedded.users", fcntl.LOCK_SH)
    fd = _lock(sdir / "embedded.lock", fcntl.LOCK_EX)
    try:
        idle.note_use(workdir)
        entry = read_embedded(workdir)
        if entry and alive(entry) and healthy(entry["health"], timeout=10):
            os.close(fd)
            return StartingServer(workdir, None, entry, None)
        if entry and alive(entry):  # running but not answering: replace it
            stop_group(entry["pid"], term_timeout=10)
        for what in idle.stop_least_used(workdir, unused_embedded, down):  # at most `idle.limit()` stay up
            print(f"lifecycle: stopped the idle {what}: at most {idle.limit()} work dirs keep their servers up "
                  f"(${idle.MAX_ENV})", file=sys.stderr)
        template = template_path()
        fresh = not embedded_db(workdir).exists()
        if fresh and template is not None and template.exists():
            seed_from_template(template, embedded_db(workdir))
        proc, entry = launch_embedded(workdir)
        save = template if fresh and template is not None and not template.exists() else None
        return StartingServer(workdir, fd, entry, proc, save_template=save)
    except BaseException:
        os.close(fd)
        raise
