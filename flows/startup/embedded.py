"""The embedded Prefect server's process: how it is launched, how it stops itself when idle, how it is stopped.

Prefect's own default is a temporary server started by each process and stopped at its exit, a cost paid by
every run (docs/benchmarks.md, "Issue 25: fixed overhead"). The embedded server is the same ASGI app, run the same
way (Prefect's ephemeral mode: no UI, only the services an ephemeral server runs), but started on first use,
detached, and reused by the later runs in the same work dir (flows/startup/environment.py finds or starts it).
State: `<workdir>/.servers/embedded.json`. A run holds a shared lock on `embedded.users` while it runs; the server
stops itself after EMBEDDED_IDLE_S seconds in which no run held it, and `lifecycle down` stops it.

    python -m lifecycle.flows.startup.embedded embedded WORKDIR PORT IDLE_S   (what `launch_embedded` starts)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lifecycle.core.procs import free_port, stop_group
from lifecycle.flows.startup.embedded_runner import stop_embedded_runner
from lifecycle.flows.startup.state import HOST, alive, read_json, state_dir

EMBEDDED_IDLE_ENV = "LIFECYCLE_EMBEDDED_IDLE_S"
EMBEDDED_IDLE_S = 3600.0


def embedded_env(workdir: Path) -> dict[str, str]:
    """The server's settings: its database in the work dir (`<workdir>/.prefect/prefect.db`, as the temporary
    server's was), Prefect's ephemeral mode (no UI, no scheduler: `lifecycle serve` needs `lifecycle up`)."""
    return {"PREFECT_HOME": str(workdir / ".prefect"), "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def read_embedded(workdir: Path) -> dict | None:
    return read_json(state_dir(workdir) / "embedded.json")  # None too for a torn write (a full disk): start another


def unused_embedded(workdir: Path) -> bool:
    """True when the work dir's embedded server is up and no run holds it (`embedded.users`)."""
    import fcntl

    entry = read_embedded(workdir)
    if not entry or not alive(entry):
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


def launch_embedded(workdir: Path) -> tuple[subprocess.Popen, dict]:
    sdir = state_dir(workdir)
    (workdir / ".prefect").mkdir(parents=True, exist_ok=True)
    idle = os.environ.get(EMBEDDED_IDLE_ENV, str(EMBEDDED_IDLE_S))
    port = free_port(HOST)
    argv = [sys.executable, "-m", "lifecycle.flows.startup.embedded", "embedded", str(workdir), str(port), idle]
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


def serve_embedded(workdir: str, port: int, idle_s: float) -> None:
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
            entry = read_embedded(Path(workdir))
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
    entry = read_embedded(workdir)
    running = bool(entry) and alive(entry)
    stop_embedded_runner(workdir, timeout)
    if running:
        stop_group(entry["pid"], term_timeout=timeout)
    (state_dir(workdir) / "embedded.json").unlink(missing_ok=True)
    return running


if __name__ == "__main__":  # the embedded server's process (`launch_embedded`)
    if len(sys.argv) == 5 and sys.argv[1] == "embedded":
        serve_embedded(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        sys.exit("usage: python -m lifecycle.flows.startup.embedded embedded WORKDIR PORT IDLE_S")
