"""Processes: a free local port, and stopping a process group (a server and its workers, a launcher and its ranks)."""

from __future__ import annotations

import os
import signal
import socket
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it; a race with another process is possible)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _reap(pid: int) -> None:
    """Collect the exit status of `pid` if it is our child (no zombie keeps the group 'alive')."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_group(pgid: int, term_timeout: float = 15, kill_timeout: float = 10) -> None:
    """SIGTERM the process group `pgid` (its leader and everything it forked), wait up to `term_timeout`,
    then SIGKILL what is left and wait up to `kill_timeout` for it to go."""
    for sig, timeout in ((signal.SIGTERM, term_timeout), (signal.SIGKILL, kill_timeout)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + timeout
        while group_alive(pgid) and time.time() < deadline:
            _reap(pgid)
            time.sleep(0.1)
        _reap(pgid)
        if not group_alive(pgid):
            return
