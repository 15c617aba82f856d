"""The warm runner a cold `lifecycle run` leaves beside the work dir's embedded Prefect server.

`lifecycle up` starts a warm runner beside its servers. With the embedded default, a cold run that used the
embedded server starts one as it exits (`start_embedded_runner`, with the command's own environment and working
directory), so that the next run in the work dir skips the imports. It lives as long as the embedded server: it
exits when that server is gone (idle timeout, `lifecycle down`, replaced) and `lifecycle down` stops it too. Its
state is `<workdir>/.servers/embedded-runner.json`; a lock (`embedded-runner.lock`, held for its life) keeps it to
one per work dir. Off with LIFECYCLE_EMBEDDED_RUNNER=0 or LIFECYCLE_WARM=0 (the tests' default is off:
tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lifecycle.core.procs import stop_group
from lifecycle.flows.startup.messages import ping_runner
from lifecycle.flows.startup.state import EMBEDDED_RUNNER, alive, read_json, runner_socket, state_dir

EMBEDDED_RUNNER_ENV = "LIFECYCLE_EMBEDDED_RUNNER"


def embedded_runner_entry(workdir: str | Path) -> dict | None:
    return read_json(state_dir(Path(workdir).resolve()) / f"{EMBEDDED_RUNNER}.json")


def start_embedded_runner(workdir: str | Path, env: dict[str, str], cwd: str) -> int | None:
    """Start the work dir's embedded runner (detached) unless it is off or one is running: its pid, else None.
    `env` and `cwd` are the command's as it started (before `prepare_environment`): a later run is taken warm only
    if its own match them (flows/startup/warm_runner.py `decline_reason`)."""
    if env.get(EMBEDDED_RUNNER_ENV, "1") == "0" or env.get("LIFECYCLE_WARM", "1") == "0":
        return None
    workdir = Path(workdir).resolve()
    entry = embedded_runner_entry(workdir)
    if entry and alive(entry):
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
    running = bool(entry) and alive(entry)
    if running:
        stop_group(entry["pid"], term_timeout=timeout)
    (state_dir(workdir) / f"{EMBEDDED_RUNNER}.json").unlink(missing_ok=True)
    runner_socket(workdir, EMBEDDED_RUNNER).unlink(missing_ok=True)
    return running
