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

import functools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from lifecycle.core.errors import UsageError
from lifecycle.core.procs import own_session_dying_with_parent, stop_group

HOST = "127.0.0.1"
SERVERS = ("prefect", "mlflow")


def state_dir(workdir: str | Path) -> Path:
    return Path(workdir) / ".servers"


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


def commands(workdir: Path, prefect_port: int, mlflow_port: int) -> dict[str, tuple[list[str], dict, str]]:
    """name -> (argv, extra env, health URL)."""
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
            {},
            f"http://{HOST}:{mlflow_port}/health",
        ),
    }


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


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def up(workdir: str | Path, prefect_port: int = 4200, mlflow_port: int = 5000, timeout: float = 180) -> dict:
    workdir = Path(workdir).resolve()
    sdir = state_dir(workdir)
    sdir.mkdir(parents=True, exist_ok=True)
    state = _read(workdir)
    cmds = commands(workdir, prefect_port, mlflow_port)
    for name, (argv, env, health) in cmds.items():
        if name in state and _alive(state[name]):
            continue  # already running for this work dir
        port = int(argv[argv.index("--port") + 1])
        if _port_in_use(port):
            raise UsageError(f"{name}: port {port} on {HOST} is already in use; choose another with --{name}-port")
        log = open(sdir / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=workdir)
        state[name] = {"pid": proc.pid, "argv": argv, "url": health.rsplit("/", 2 if name == "prefect" else 1)[0],
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
    return stopped


def status(workdir: str | Path) -> dict:
    state = _read(Path(workdir).resolve())
    return {name: {"running": _alive(e), "healthy": _alive(e) and _healthy(e["health"]), "pid": e["pid"],
                   "url": e["url"], "log": e["log"]} for name, e in state.items()}


def active(workdir: str | Path) -> dict[str, str] | None:
    """URLs of this work dir's servers when both are up and healthy, else None (use the embedded defaults)."""
    st = status(workdir)
    if all(st.get(n, {}).get("healthy") for n in SERVERS):
        return {"prefect_api": st["prefect"]["url"] + "/api", "mlflow": st["mlflow"]["url"]}
    return None


# ------------------------------------------------------------------------------------------ CLI


def prepare_environment(workdir: str | Path) -> str:
    """Use the work dir's servers when `lifecycle up` started them. Otherwise the embedded defaults: without
    a configured Prefect API, keep Prefect's home (its SQLite database and the ephemeral server it starts)
    inside the work dir, give the ephemeral server time to start on 2 cores, and let MLflow write SQLite."""
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
        _share_ephemeral_server()
    return mode


def _share_ephemeral_server() -> None:
    """Start Prefect's temporary server now and export its URL, so that Dask worker processes (which
    inherit the environment) report their task runs to it instead of each starting a server of its own.
    It is the same singleton Prefect's client would start, and Prefect stops it when this process exits."""
    from prefect.server.api.server import SubprocessASGIServer

    class OwnSessionServer(SubprocessASGIServer):
        """Its own session: a ^C or a group SIGTERM (`timeout`) reaches only this process, which then still has a
        server to report the interrupted run to instead of retrying a dead one for minutes. It is sent SIGTERM
        when this process dies, however it dies."""

        def _run_uvicorn_command(self):
            popen = subprocess.Popen  # Prefect's method calls subprocess.Popen; nothing else starts one meanwhile
            subprocess.Popen = functools.partial(popen, preexec_fn=own_session_dying_with_parent)
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen

    server = OwnSessionServer()
    server.start()
    os.environ["PREFECT_API_URL"] = server.api_url


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
        p.set_defaults(func=fn, names_run=True)  # the work dir: `lifecycle` resolves it (args.workdir)


def _workdir(args) -> Path:
    return Path(args.workdir).resolve()


def _print(args, obj, text: str) -> None:
    print(json.dumps(obj) if args.json else text)


def cmd_up(args) -> int:
    st = up(_workdir(args), args.prefect_port, args.mlflow_port)
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
