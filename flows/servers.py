"""`lifecycle up | down | status`: a Prefect server and an MLflow tracking server for one work dir.

Both are started the way users start them (`prefect server start`, `mlflow server`), as background
processes bound to 127.0.0.1, each with a SQLite store in the work dir: `<workdir>/prefect.db` and
`<workdir>/mlflow.db`. The MLflow server is then the only writer of its file: while it is up,
`lifecycle run` logs through it instead of opening the SQLite file itself, and Prefect runs go to the
real server (which, unlike the ephemeral one, runs the scheduler).

`down` stops exactly the processes `up` started: it reads their pid files and checks, before sending any
signal, that the process with that pid is still the server it started (same command line, same work dir).
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from lifecycle.core.errors import UsageError
from lifecycle.flows import idle
from lifecycle.core.fs import cache_dir, copy_sqlite
from lifecycle.core.procs import free_port, stop_group

HOST = "127.0.0.1"
SERVERS = ("prefect", "mlflow")  # a run uses `up`'s servers when both answer
RUNNER = "runner"  # `up` also starts the warm runner (lifecycle/launch.py) unless --no-runner
EMBEDDED = "embedded-prefect"  # started by `lifecycle run` when `up` started none (`embedded_server`)
EMBEDDED_RUNNER = "embedded-runner"  # the warm runner a cold run leaves beside the embedded server


def state_dir(workdir: str | Path) -> Path:
    return Path(workdir) / ".servers"


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


def commands(workdir: Path, prefect_port: int, mlflow_port: int, runner: bool = True
             ) -> dict[str, tuple[list[str], dict, str]]:
    """name -> (argv, extra env, health URL; `unix:PATH` for the runner's socket)."""
    prefect_env = {
        "PREFECT_HOME": str(workdir / ".prefect-server"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{workdir / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": HOST,
    }
    return {
        "prefect": (
            [_bin("prefect"), "server", "start", "--host", HOST, "--port", str(prefect_port)],
            prefect_env,
            f"http://{HOST}:{prefect_port}/api/health",
        ),
        "mlflow": (
            [_bin("mlflow"), "server", "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
             "--artifacts-destination", str(workdir / "mlartifacts"), "--host", HOST, "--port", str(mlflow_port),
             "--workers", "1"],
            # no GenAI job runner (huey consumers): nothing here submits jobs, and each start of it leaves a
            # directory in /dev/shm behind (mlflow/server/__init__.py: `tempfile.mkdtemp(dir="/dev/shm")`)
            {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            f"http://{HOST}:{mlflow_port}/health",
        ),
    } | ({RUNNER: ([sys.executable, "-m", "lifecycle.launch", "--serve", str(workdir)], {},
                   f"unix:{runner_socket(workdir)}")} if runner else {})


def _read(workdir: Path) -> dict:
    f = state_dir(workdir) / "servers.json"
    try:
        return json.loads(f.read_text()) if f.exists() else {}
    except ValueError as e:  # damaged by hand or a full disk: say which file, and how to start over
        raise UsageError(f"{f} is not valid JSON ({e}); stop the servers it named by hand and remove it") from e


def _alive(entry: dict) -> bool:
    """True when the pid is running and is still the process we started (not a recycled pid)."""
    pid = entry.get("pid")
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, TypeError):
        return False
    argv = [a.decode(errors="replace") for a in cmdline if a]
    return bool(argv) and entry["argv"][1:] == argv[-(len(entry["argv"]) - 1):]


def _healthy(url: str, timeout: float = 2) -> bool:
    if url.startswith("unix:"):
        return ping_runner(Path(url[5:]), timeout)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def up(workdir: str | Path, prefect_port: int = 4200, mlflow_port: int = 5000, timeout: float = 180,
       runner: bool = True) -> dict:
    workdir = Path(workdir).resolve()
    sdir = state_dir(workdir)
    sdir.mkdir(parents=True, exist_ok=True)
    state = _read(workdir)
    cmds = commands(workdir, prefect_port, mlflow_port, runner)
    for name, (argv, env, health) in cmds.items():
        if name in state and _alive(state[name]):
            continue  # already running for this work dir
        port = int(argv[argv.index("--port") + 1]) if "--port" in argv else None
        if port is not None and _port_in_use(port):
            raise UsageError(f"{name}: port {port} on {HOST} is already in use; choose another with --{name}-port")
        log = open(sdir / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=workdir)
        state[name] = {"pid": proc.pid, "argv": argv, "url": health[5:] if name == RUNNER else
                       health.rsplit("/", 2 if name == "prefect" else 1)[0],
                       "health": health, "log": str(sdir / f"{name}.log")}
        (sdir / f"{name}.pid").write_text(f"{proc.pid}\n")
    (sdir / "servers.json").write_text(json.dumps(state, indent=2))
    deadline = time.time() + timeout
    for name, entry in state.items():
        while not _healthy(entry["health"]):
            if not _alive(entry):
                raise UsageError(f"{name} server exited during start-up; see {entry['log']}")
            if time.time() > deadline:
                raise UsageError(f"{name} server not healthy after {timeout:.0f} s; see {entry['log']}")
            time.sleep(0.5)
    return status(workdir)


def down(workdir: str | Path, timeout: float = 30) -> list[str]:
    workdir = Path(workdir).resolve()
    sdir = state_dir(workdir)
    state = _read(workdir)
    stopped = []
    for name, entry in state.items():
        if _alive(entry):
            stop_group(entry["pid"], term_timeout=timeout)
            stopped.append(name)
        (sdir / f"{name}.pid").unlink(missing_ok=True)
    (sdir / "servers.json").unlink(missing_ok=True)
    runner_socket(workdir).unlink(missing_ok=True)
    if stop_embedded_runner(workdir, timeout):
        stopped.append(EMBEDDED_RUNNER)
    if stop_embedded(workdir, timeout):
        stopped.append(EMBEDDED)
    return stopped


def status(workdir: str | Path) -> dict:
    """`up`'s servers, and the embedded Prefect server (`EMBEDDED`) when runs started one."""
    state = _read(Path(workdir).resolve())
    for name, entry in ((EMBEDDED, _read_embedded(Path(workdir).resolve())),
                        (EMBEDDED_RUNNER, embedded_runner_entry(workdir))):
        if entry:
            state[name] = entry
    return {name: {"running": _alive(e), "healthy": _alive(e) and _healthy(e["health"]), "pid": e["pid"],
                   "url": e["url"], "log": e["log"]} for name, e in state.items()}


def active(workdir: str | Path) -> dict[str, str] | None:
    """URLs of this work dir's servers when both are up and healthy, else None (use the embedded defaults)."""
    state = _read(Path(workdir).resolve())  # `up`'s entries only: no health check of the embedded ones
    if all(n in state and _alive(state[n]) and _healthy(state[n]["health"]) for n in SERVERS):
        return {"prefect_api": state["prefect"]["url"] + "/api", "mlflow": state["mlflow"]["url"]}
    return None


# --------------------------------------------------------------- the warm runner's socket (lifecycle/launch.py)


def runner_socket(workdir: str | Path, name: str = RUNNER) -> Path:
    """`<workdir>/.servers/<name>.sock` (`runner`: `up`'s runner; `embedded-runner`: the embedded server's); where
    that path is too long for a Unix socket (107 bytes), a socket named by its hash in a directory only this user
    can enter (`$XDG_RUNTIME_DIR`, else /tmp)."""
    path = state_dir(Path(workdir).resolve()) / f"{name}.sock"
    if len(os.fsencode(path)) <= 100:
        return path
    import hashlib

    base = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"lifecycle-{os.getuid()}"
    return base / f"{name}-{hashlib.sha256(os.fsencode(path)).hexdigest()[:20]}.sock"


def send_msg(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    """One length-prefixed JSON message, with file descriptors (SCM_RIGHTS) when given."""
    import struct

    data = json.dumps(obj).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], list(fds))
    else:
        sock.sendall(frame)


def recv_msg(sock: socket.socket) -> tuple[dict, list[int]]:
    import struct

    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
    for fd in fds:  # SCM_RIGHTS descriptors arrive inheritable: an exec (the runner's restart) must not keep them
        os.set_inheritable(fd, False)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = sock.recv(1 << 16)
        if not more:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("the message ended early")
        data += more
    return json.loads(data[4:4 + struct.unpack("!I", data[:4])[0]]), list(fds)


def ping_runner(path: Path, timeout: float = 2) -> bool:
    """True when a runner answers on `path`."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
            send_msg(s, {"ping": True})
            return "pong" in json.loads(s.makefile("rb").readline() or b"{}")
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------------------ CLI


_starting: _Starting | None = None


def prepare_environment(workdir: str | Path, wait: bool = True, hold: bool = True) -> str:
    """Use the work dir's servers when `lifecycle up` started them. Otherwise the embedded defaults: without
    a configured Prefect API, keep Prefect's home (its SQLite database and the ephemeral server it starts)
    inside the work dir, give the ephemeral server time to start on 2 cores, and let MLflow write SQLite.
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
    if mode == "embedded":
        global _starting
        _starting = start_embedded(workdir, hold=hold)
        os.environ["PREFECT_API_URL"] = _starting.url + "/api"
        if wait:
            wait_ready()
    return mode


def wait_ready() -> None:
    """Wait for the embedded server `prepare_environment(..., wait=False)` found or launched (a no-op otherwise):
    the caller imports Prefect and the flow while it starts."""
    global _starting
    if _starting is not None:
        starting, _starting = _starting, None
        starting.wait()


# ---------------------------------------------------------------------- the embedded server (no `lifecycle up`)
#
# Prefect's own default is a temporary server started by each process and stopped at its exit: 7-13 s of every
# run here. The embedded server is the same ASGI app, run the same way (Prefect's ephemeral mode: no UI, only the
# services an ephemeral server runs), but started on first use, detached, and reused by the later runs in the same
# work dir. State: `<workdir>/.servers/embedded.json`. A run holds a shared lock on `embedded.users` while it runs;
# the server stops itself after EMBEDDED_IDLE_S seconds in which no run held it, and `lifecycle down` stops it.

EMBEDDED_IDLE_ENV = "LIFECYCLE_EMBEDDED_IDLE_S"
EMBEDDED_IDLE_S = 3600.0
EMBEDDED_START_TIMEOUT_S = 90.0
_users_fd: int | None = None  # this process's shared hold on `embedded.users` (dropped by the kernel at exit)


def embedded_env(workdir: Path) -> dict[str, str]:
    """The server's settings: its database in the work dir (`<workdir>/.prefect/prefect.db`, as the temporary
    server's was), Prefect's ephemeral mode (no UI, no scheduler: `lifecycle serve` needs `lifecycle up`)."""
    return {"PREFECT_HOME": str(workdir / ".prefect"), "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def _lock(path: Path, mode: int) -> int:
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, mode)
    return fd


def embedded_server(workdir: str | Path, timeout: float = EMBEDDED_START_TIMEOUT_S) -> dict:
    """The work dir's embedded Prefect server, started if none is running and healthy: {pid, url, ..., started}."""
    return start_embedded(workdir).wait(timeout)


class _Starting:
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
            while self.proc.poll() is None and not _healthy(self.entry["health"], timeout=1):
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


def start_embedded(workdir: str | Path, hold: bool = True) -> _Starting:
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
        entry = _read_embedded(workdir)
        if entry and _alive(entry) and _healthy(entry["health"], timeout=10):
            os.close(fd)
            return _Starting(workdir, None, entry, None)
        if entry and _alive(entry):  # running but not answering: replace it
            stop_group(entry["pid"], term_timeout=10)
        for what in idle.stop_least_used(workdir, _unused_embedded, down):  # at most `idle.limit()` stay up
            print(f"lifecycle: stopped the idle {what}: at most {idle.limit()} work dirs keep their servers up "
                  f"(${idle.MAX_ENV})", file=sys.stderr)
        template = template_path()
        fresh = not embedded_db(workdir).exists()
        if fresh and template is not None and template.exists():
            seed_from_template(template, embedded_db(workdir))
        proc, entry = _launch_embedded(workdir)
        save = template if fresh and template is not None and not template.exists() else None
        return _Starting(workdir, fd, entry, proc, save_template=save)
    except BaseException:
        os.close(fd)
        raise


# A new work dir's server spends ~10 of its ~14 s of start-up creating its database (Prefect's migrations). The
# first one on a machine keeps a copy of the database it made, just migrated, before any run (per Prefect
# version: `template_path`), and each later new work dir starts from that copy; Prefect's start-up then only
# checks that the schema is current. Off with LIFECYCLE_PREFECT_TEMPLATE=0, or when the server's database is
# configured elsewhere (PREFECT_API_DATABASE_CONNECTION_URL).
TEMPLATE_ENV = "LIFECYCLE_PREFECT_TEMPLATE"


def embedded_db(workdir: Path) -> Path:
    return workdir / ".prefect" / "prefect.db"


def template_path() -> Path | None:
    """Where the migrated empty database for this Prefect version is kept (None: templates are off)."""
    if os.environ.get(TEMPLATE_ENV, "1") == "0" or os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL"):
        return None
    from importlib.metadata import version

    return cache_dir() / f"prefect-{version('prefect')}-empty.db"


def save_template(db: Path, template: Path) -> bool:
    """Keep the just-migrated database `db` as `template` if the copy holds no flow run, passes
    `PRAGMA integrity_check` and has its schema version. A failure only means that the next new work dir
    migrates again."""
    def empty_and_sound(conn) -> bool:
        return (conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
                and conn.execute("SELECT count(*) FROM alembic_version").fetchone()[0] == 1
                and conn.execute("SELECT count(*) FROM flow_run").fetchone()[0] == 0)

    try:
        return copy_sqlite(db, template, check=empty_and_sound, readonly=True)
    except (OSError, sqlite3.Error) as e:
        print(f"lifecycle: could not keep the Prefect database template {template}: {e}", file=sys.stderr)
        return False


def seed_from_template(template: Path, db: Path) -> None:
    """A new work dir's database, copied from the template (if that fails, the server creates its own)."""
    try:
        copy_sqlite(template, db)
    except (OSError, sqlite3.Error) as e:
        print(f"lifecycle: could not copy the Prefect database template {template}: {e}", file=sys.stderr)


def _unused_embedded(workdir: Path) -> bool:
    """True when the work dir's embedded server is up and no run holds it (`embedded.users`)."""
    import fcntl

    entry = _read_embedded(workdir)
    if not entry or not _alive(entry):
        return False
    try:
        fd = os.open(state_dir(workdir) / "embedded.users", os.O_RDWR)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _read_embedded(workdir: Path) -> dict | None:
    return _read_json(state_dir(workdir) / "embedded.json")  # None too for a torn write (a full disk): start another


def _launch_embedded(workdir: Path) -> tuple[subprocess.Popen, dict]:
    sdir = state_dir(workdir)
    (workdir / ".prefect").mkdir(parents=True, exist_ok=True)
    idle = os.environ.get(EMBEDDED_IDLE_ENV, str(EMBEDDED_IDLE_S))
    port = free_port(HOST)
    argv = [sys.executable, "-m", "lifecycle.flows.servers", "embedded", str(workdir), str(port), idle]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # it serves the API
    with open(sdir / "embedded.log", "ab") as log:
        proc = subprocess.Popen(argv, env={**env, **embedded_env(workdir)}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=workdir)
    url = f"http://{HOST}:{port}"
    entry = {"pid": proc.pid, "argv": argv, "url": url, "health": f"{url}/api/health", "log": str(sdir / "embedded.log")}
    tmp = sdir / "embedded.json.tmp"
    tmp.write_text(json.dumps(entry, indent=2))
    tmp.replace(sdir / "embedded.json")
    return proc, entry


def _serve_embedded(workdir: str, port: int, idle_s: float) -> None:
    """The embedded server's process: Prefect's API app under uvicorn, as Prefect's temporary server runs it, that
    exits once no run has held `embedded.users` for `idle_s` seconds (or on SIGTERM: `lifecycle down`)."""
    import fcntl
    import threading

    import uvicorn

    users = state_dir(workdir) / "embedded.users"
    server = uvicorn.Server(uvicorn.Config("prefect.server.api.server:create_app", factory=True, host=HOST,
                                           port=port, log_level="error", lifespan="on"))

    def idle_watch() -> None:
        last_used = time.time()
        while not server.should_exit:
            time.sleep(min(15.0, max(idle_s / 4, 0.2)))
            entry = _read_embedded(Path(workdir))
            if entry is not None and entry.get("pid") != os.getpid():  # replaced (the work dir was removed and made
                print(f"embedded Prefect server: {workdir} names another server now; stopping", flush=True)
                server.should_exit = True  # again, say): its runs hold the other one's `embedded.users`
                return
            try:
                fd = os.open(users, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:  # the work dir (or its .servers) was removed: no run can find this server again
                print(f"embedded Prefect server: {users} cannot be opened ({e}); stopping", flush=True)
                server.should_exit = True
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken only when no run holds it
            except BlockingIOError:
                last_used = time.time()
            finally:
                os.close(fd)
            if time.time() - last_used > idle_s:
                print(f"embedded Prefect server: no run for {idle_s:.0f} s; stopping", flush=True)
                server.should_exit = True

    threading.Thread(target=idle_watch, daemon=True).start()
    server.run()


def stop_embedded(workdir: str | Path, timeout: float = 30) -> bool:
    """Stop the work dir's embedded server; True if one was running."""
    workdir = Path(workdir).resolve()
    entry = _read_embedded(workdir)
    running = bool(entry) and _alive(entry)
    stop_embedded_runner(workdir, timeout)
    if running:
        stop_group(entry["pid"], term_timeout=timeout)
    (state_dir(workdir) / "embedded.json").unlink(missing_ok=True)
    return running


# ------------------------------------------------------------- the embedded server's warm runner (lifecycle/launch.py)
#
# `lifecycle up` starts a warm runner beside its servers. With the embedded default, a cold `lifecycle run` that
# used the embedded server starts one as it exits (`start_embedded_runner`, with the command's own environment and
# working directory), so the next run in the work dir skips the ~4 s of imports, as against `up`'s servers. It
# lives as long as the embedded server: it exits when that server is gone (idle timeout, `lifecycle down`, replaced)
# and `lifecycle down` stops it too. Its state is `<workdir>/.servers/embedded-runner.json`; a lock
# (`embedded-runner.lock`, held for its life) keeps it to one per work dir. Off with LIFECYCLE_EMBEDDED_RUNNER=0 or
# LIFECYCLE_WARM=0 (the tests' default is off: tests/conftest.py).
EMBEDDED_RUNNER_ENV = "LIFECYCLE_EMBEDDED_RUNNER"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def embedded_runner_entry(workdir: str | Path) -> dict | None:
    return _read_json(state_dir(Path(workdir).resolve()) / f"{EMBEDDED_RUNNER}.json")


def start_embedded_runner(workdir: str | Path, env: dict[str, str], cwd: str) -> int | None:
    """Start the work dir's embedded runner (detached) unless it is off or one is running: its pid, else None.
    `env` and `cwd` are the command's as it started (before `prepare_environment`): a later run is taken warm only
    if its own match them (lifecycle/launch.py `decline_reason`)."""
    if env.get(EMBEDDED_RUNNER_ENV, "1") == "0" or env.get("LIFECYCLE_WARM", "1") == "0":
        return None
    workdir = Path(workdir).resolve()
    entry = embedded_runner_entry(workdir)
    if entry and _alive(entry):
        return None
    argv = [sys.executable, "-m", "lifecycle.launch", "--serve-embedded", str(workdir)]
    with open(state_dir(workdir) / f"{EMBEDDED_RUNNER}.log", "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=cwd)
    write_embedded_runner_entry(workdir, proc.pid, argv)  # now, so that `down` stops it while it imports
    return proc.pid


def write_embedded_runner_entry(workdir: Path, pid: int, argv: list[str]) -> None:
    """Its state file. The runner that holds the lock writes it again (two cold runs ending at once each start
    one, the second exits at once, and its starter's entry may be the last written)."""
    sdir, sock = state_dir(workdir), runner_socket(workdir, EMBEDDED_RUNNER)
    entry = {"pid": pid, "argv": argv, "url": str(sock), "health": f"unix:{sock}",
             "log": str(sdir / f"{EMBEDDED_RUNNER}.log")}
    tmp = sdir / f"{EMBEDDED_RUNNER}.json.tmp.{os.getpid()}"
    tmp.write_text(json.dumps(entry, indent=2))
    tmp.replace(sdir / f"{EMBEDDED_RUNNER}.json")


def wait_embedded_runner(workdir: str | Path, timeout: float = 120) -> dict | None:
    """The work dir's embedded runner entry once it answers on its socket (it imports for a few seconds after the
    cold run that started it exits), or None after `timeout` (none was started, or it exited)."""
    sock, deadline = runner_socket(workdir, EMBEDDED_RUNNER), time.time() + timeout
    while not ping_runner(sock):
        if time.time() > deadline:
            return None
        time.sleep(0.3)
    return embedded_runner_entry(workdir)


def stop_embedded_runner(workdir: str | Path, timeout: float = 30) -> bool:
    workdir = Path(workdir).resolve()
    entry = embedded_runner_entry(workdir)
    running = bool(entry) and _alive(entry)
    if running:
        stop_group(entry["pid"], term_timeout=timeout)
    (state_dir(workdir) / f"{EMBEDDED_RUNNER}.json").unlink(missing_ok=True)
    runner_socket(workdir, EMBEDDED_RUNNER).unlink(missing_ok=True)
    return running


def register(sub) -> None:
    from lifecycle.config import DEFAULT_CONFIG

    for name, fn, help_ in (("up", cmd_up, "Start a Prefect and an MLflow server for the work dir."),
                            ("down", cmd_down, "Stop the servers `up` started for the work dir."),
                            ("status", cmd_status, "Show the work dir's servers.")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config", nargs="?", help=f"config whose work dir to use (default {DEFAULT_CONFIG})")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override (e.g. workdir=...)")
        p.add_argument("--json", action="store_true", help="Print one JSON object.")
        if name == "up":
            p.add_argument("--prefect-port", type=int, default=4200, help="the Prefect server's port (default 4200)")
            p.add_argument("--mlflow-port", type=int, default=5000, help="the MLflow server's port (default 5000)")
            p.add_argument("--no-runner", action="store_true", help="start no warm runner (lifecycle/launch.py): "
                           "every `lifecycle run` then imports Prefect and MLflow itself (~4 s more each)")
        p.set_defaults(func=fn, names_run=True)  # the work dir: `lifecycle` resolves it (args.workdir)


def _workdir(args) -> Path:
    return Path(args.workdir).resolve()


def _print(args, obj, text: str) -> None:
    print(json.dumps(obj) if args.json else text)


def cmd_up(args) -> int:
    st = up(_workdir(args), args.prefect_port, args.mlflow_port, runner=not args.no_runner)
    _print(args, st, "\n".join(f"{n}: {e['url']} (pid {e['pid']}, log {e['log']})" for n, e in st.items())
           + f"\nlifecycle run now uses these servers. Prefect UI: {st['prefect']['url']}  MLflow UI: {st['mlflow']['url']}")
    return 0


def cmd_down(args) -> int:
    stopped = down(_workdir(args))
    _print(args, {"stopped": stopped}, f"stopped: {', '.join(stopped) or 'nothing was running'}")
    return 0


def cmd_status(args) -> int:
    st = status(_workdir(args))
    _print(args, st, "\n".join(f"{n}: {'up' if e['healthy'] else 'running' if e['running'] else 'down'} {e['url']}"
                               for n, e in st.items()) or "no servers started for this work dir")
    return 0


if __name__ == "__main__":  # the embedded server's process (`_launch_embedded`)
    if len(sys.argv) == 5 and sys.argv[1] == "embedded":
        _serve_embedded(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        sys.exit("usage: python -m lifecycle.flows.servers embedded WORKDIR PORT IDLE_S")
