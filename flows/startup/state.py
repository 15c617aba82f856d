"""A work dir's start-up state in `<workdir>/.servers/`: the names of its processes, their state files and sockets,
and whether a process named there is still the one started and answers."""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
from pathlib import Path

from lifecycle.flows.startup.messages import ping_runner

HOST = "127.0.0.1"
RUNNER = "runner"  # `up` also starts the warm runner (flows/startup/warm_runner.py) unless --no-runner
EMBEDDED = "embedded-prefect"  # started by `lifecycle run` when `up` started none (flows/startup/environment.py)
EMBEDDED_RUNNER = "embedded-runner"  # the warm runner a cold run leaves beside the embedded server


def state_dir(workdir: str | Path) -> Path:
    return Path(workdir) / ".servers"


def runner_socket(workdir: str | Path, name: str = RUNNER) -> Path:
    """`<workdir>/.servers/<name>.sock` (`runner`: `up`'s runner; `embedded-runner`: the embedded server's); where
    that path is too long for a Unix socket (107 bytes), a socket named by its hash in a directory only this user
    can enter (`$XDG_RUNTIME_DIR`, else /tmp)."""
    path = state_dir(Path(workdir).resolve()) / f"{name}.sock"
    if len(os.fsencode(path)) <= 100:
        return path
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"lifecycle-{os.getuid()}"
    return base / f"{name}-{hashlib.sha256(os.fsencode(path)).hexdigest()[:20]}.sock"


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def alive(entry: dict) -> bool:
    """True when the pid is running and is still the process we started (not a recycled pid)."""
    pid = entry.get("pid")
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, TypeError):
        return False
    argv = [a.decode(errors="replace") for a in cmdline if a]
    return bool(argv) and entry["argv"][1:] == argv[-(len(entry["argv"]) - 1):]


def healthy(url: str, timeout: float = 2) -> bool:
    if url.startswith("unix:"):
        return ping_runner(Path(url[5:]), timeout)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False
