"""`lifecycle up | down | status`: a Prefect server and an MLflow tracking server for one work dir.

Both are started the way users start them (`prefect server start`, `mlflow server`), as background
processes bound to 127.0.0.1, each with a SQLite store in the work dir: `<workdir>/prefect.db` and
`<workdir>/mlflow.db`. The MLflow server is then the only writer of its file: while it is up,
`lifecycle run` logs through it instead of opening the SQLite file itself, and Prefect runs go to the
real server (which, unlike the ephemeral one, runs the scheduler).

`up` records each server in `servers.json` as it starts it, and when a later one fails (a port in use, an exit
or no health in start-up) stops the ones it started and removes them again. A second `up` asking for other ports
than those its servers run on refuses and says so.

`down` stops exactly the processes `up` started: it reads their pid files and checks, before sending any
signal, that the process with that pid is still the server it started (same command line, same work dir). When
that process is gone but others of its process group still run in the work dir (MLflow's worker outlives its
killed main process and goes on serving and writing `mlflow.db`), it stops those. It also stops the embedded
server and its runner, which `status` lists too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from lifecycle.core.errors import UsageError
from lifecycle.core.procs import stop_group
from lifecycle.flows.startup.embedded import read_embedded, stop_embedded
from lifecycle.flows.startup.embedded_runner import embedded_runner_entry, stop_embedded_runner
from lifecycle.flows.startup.state import (EMBEDDED, EMBEDDED_RUNNER, HOST, RUNNER, alive, healthy, runner_socket,
                                           state_dir)

SERVERS = ("prefect", "mlflow")  # a run uses `up`'s servers when both answer


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


DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000}


def _port(entry: dict) -> int | None:
    argv = entry["argv"]
    return int(argv[argv.index("--port") + 1]) if "--port" in argv else None


def _write(sdir: Path, state: dict) -> None:
    tmp = sdir / "servers.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(sdir / "servers.json")


def leftovers(entry: dict, workdir: Path) -> list[int]:
    """Live processes of the recorded server's process group (its pid: `up` starts each in its own session) that
    run in the work dir, when the recorded process itself is gone: a worker that outlived its main process."""
    if alive(entry):
        return []
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == entry["pid"] and fields[0] not in ("Z", "X") and \
                    os.readlink(stat.parent / "cwd") == str(workdir):
                pids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def _stop_pids(pids: list[int], timeout: float) -> None:
    """SIGTERM, then after `timeout` SIGKILL, processes that are not our children (a leftover worker)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + timeout
        while (pids := [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]) and time.time() < deadline:
            time.sleep(0.1)
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _check_ports(state: dict, asked: dict[str, int | None]) -> None:
    """Refuse, naming both, when a running server of this work dir is asked to run on another port."""
    moved = [f"{name} runs on port {_port(state[name])}, not {port}" for name, port in asked.items()
             if port is not None and name in state and alive(state[name]) and _port(state[name]) != port]
    if moved:
        raise UsageError(f"this work dir's servers already run: {'; '.join(moved)}. Run `lifecycle down` first to "
                         "move them, or `lifecycle up` without ports to keep them")


def _start(name: str, argv: list[str], env: dict, health: str, workdir: Path, sdir: Path) -> dict:
    port = int(argv[argv.index("--port") + 1]) if "--port" in argv else None
    if port is not None and _port_in_use(port):
        raise UsageError(f"{name}: port {port} on {HOST} is already in use; choose another with --{name}-port")
    log = open(sdir / f"{name}.log", "ab")
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=workdir)
    (sdir / f"{name}.pid").write_text(f"{proc.pid}\n")
    return {"pid": proc.pid, "argv": argv, "url": health[5:] if name == RUNNER else
            health.rsplit("/", 2 if name == "prefect" else 1)[0], "health": health, "log": str(sdir / f"{name}.log")}


def _wait_healthy(state: dict, timeout: float) -> None:
    deadline = time.time() + timeout
    for name, entry in state.items():
        while not healthy(entry["health"]):
            if not alive(entry):
                raise UsageError(f"{name} server exited during start-up; see {entry['log']}")
            if time.time() > deadline:
                raise UsageError(f"{name} server not healthy after {timeout:.0f} s; see {entry['log']}")
            time.sleep(0.5)


def up(workdir: str | Path, prefect_port: int | None = None, mlflow_port: int | None = None, timeout: float = 180,
       runner: bool = True) -> dict:
    """Start what is not running yet (ports: 4200 and 5000 unless given); servers.json names each as it starts,
    and a failure stops the ones this call started."""
    workdir = Path(workdir).resolve()
    sdir = state_dir(workdir)
    sdir.mkdir(parents=True, exist_ok=True)
    state = _read(workdir)
    _check_ports(state, {"prefect": prefect_port, "mlflow": mlflow_port})
    cmds = commands(workdir, prefect_port or DEFAULT_PORTS["prefect"], mlflow_port or DEFAULT_PORTS["mlflow"], runner)
    started: list[str] = []
    try:
        for name, (argv, env, health) in cmds.items():
            if name in state and alive(state[name]):
                continue  # already running for this work dir
            if name in state and (stray := leftovers(state[name], workdir)):
                _stop_pids(stray, 10)  # its main process is gone; its workers would hold the port
            state[name] = _start(name, argv, env, health, workdir, sdir)
            started.append(name)
            _write(sdir, state)  # recorded before the next one starts: `down` finds it whatever happens next
        _wait_healthy(state, timeout)
    except BaseException:
        for name in reversed(started):
            stop_group(state.pop(name)["pid"], term_timeout=10)
            (sdir / f"{name}.pid").unlink(missing_ok=True)
        if state:
            _write(sdir, state)
        else:
            (sdir / "servers.json").unlink(missing_ok=True)
        raise
    return status(workdir)


def down(workdir: str | Path, timeout: float = 30) -> list[str]:
    workdir = Path(workdir).resolve()
    sdir = state_dir(workdir)
    state = _read(workdir)
    stopped = []
    for name, entry in state.items():
        if alive(entry):
            stop_group(entry["pid"], term_timeout=timeout)
            stopped.append(name)
        elif stray := leftovers(entry, workdir):  # the main process was killed (OOM), its worker serves on
            _stop_pids(stray, timeout)
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
    for name, entry in ((EMBEDDED, read_embedded(Path(workdir).resolve())),
                        (EMBEDDED_RUNNER, embedded_runner_entry(workdir))):
        if entry:
            state[name] = entry
    wd = Path(workdir).resolve()
    out = {}
    for name, e in state.items():
        stray = leftovers(e, wd) if name in SERVERS else []  # the main process gone, a worker still serving
        running = alive(e) or bool(stray)
        out[name] = {"running": running, "healthy": running and healthy(e["health"]), "pid": e["pid"],
                     "url": e["url"], "log": e["log"]} | ({"leftover_pids": stray} if stray else {})
    return out


def active(workdir: str | Path) -> dict[str, str] | None:
    """URLs of this work dir's servers when both are up and healthy, else None (use the embedded defaults)."""
    state = _read(Path(workdir).resolve())  # `up`'s entries only: no health check of the embedded ones
    if all(n in state and alive(state[n]) and healthy(state[n]["health"]) for n in SERVERS):
        return {"prefect_api": state["prefect"]["url"] + "/api", "mlflow": state["mlflow"]["url"]}
    return None
