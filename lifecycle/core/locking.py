"""One lifecycle run per work dir at a time.

Two runs on the same work dir would race on the same fingerprinted datasets, checkpoints and MLflow
parent run. The run holds an exclusive `flock` on `<workdir>/.lifecycle.lock` for its whole duration;
a second run refuses at once naming the work dir and the holder (pid, what it is, since when), or, with
`wait=True`, waits for it. The kernel drops the lock when the holder dies, even by SIGKILL, so a crash never
leaves a stale lock behind.

Every flow run takes it (`lifecycle_flow`), so a run that `lifecycle serve` starts on its schedule and a
manual `lifecycle run` never overlap. `lifecycle run` takes it first (to refuse before starting Prefect);
the flow takes it re-entrantly, so it goes on under the hold of the `lifecycle run` in its own process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from pathlib import Path
from typing import Iterator

from lifecycle.core.errors import UsageError


class WorkdirBusy(RuntimeError):
    """Another run holds the work dir."""


_held: dict[tuple[int, str], int] = {}  # (pid, lock file) -> depth: the locks this process holds
_guard = threading.Lock()


def check_workdir(workdir: str | Path) -> None:
    """A work dir must be a writable directory; one that does not exist yet is created."""
    wd = Path(workdir)
    if wd.exists() and not wd.is_dir():
        raise UsageError(f"work dir {wd} exists and is not a directory")
    existing = next(p for p in (wd, *wd.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"work dir {wd}: {existing} is not a directory")
    try:
        wd.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"work dir {wd}: cannot create it: {(e.strerror or str(e)).lower()}") from e
    if not os.access(wd, os.W_OK | os.X_OK):
        raise UsageError(f"work dir {wd} is not writable")


@contextlib.contextmanager
def workdir_lock(workdir: str | Path, wait: bool = False, holder: str = "lifecycle run",
                 reentrant: bool = False) -> Iterator[None]:
    """Hold `<workdir>/.lifecycle.lock`; `holder` says what holds it (in the refusal message of a second run).
    `reentrant`: if this process holds it already, go on under that hold (else a second hold is refused)."""
    check_workdir(workdir)
    path = Path(workdir) / ".lifecycle.lock"
    key = (os.getpid(), str(path.resolve()))
    with _guard:
        if reentrant and key in _held:  # this process holds it already (`lifecycle run`, then its flow run)
            _held[key] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _guard:
                _held[key] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise WorkdirBusy(f"work dir {workdir} is in use by another lifecycle run ({describe_holder(fd)}); "
                              "wait for it to finish, or use another workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "holder": holder, "since": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode(), 0)
        with _guard:
            _held[key] = 1
        try:
            yield
        finally:
            with _guard:
                del _held[key]
    finally:
        os.close(fd)  # releases the lock


def describe_holder(fd: int) -> str:
    """'pid 123, lifecycle run, since 2026-...' from the lock file (the holder wrote it after locking)."""
    raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    try:
        h = json.loads(raw)
    except ValueError:
        return raw or "unknown holder"
    return ", ".join(str(x) for x in (f"pid {h.get('pid')}", h.get("holder"), f"since {h.get('since')}")
                     if x and x != "since None")
