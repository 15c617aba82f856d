"""One lifecycle run per work dir at a time.

Two runs on the same work dir would race on the same fingerprinted datasets, checkpoints and MLflow
parent run. The run holds an exclusive `flock` on `<workdir>/.lifecycle.lock` for its whole duration;
a second run refuses at once with the holder's pid (or, with `wait=True`, waits for it). The kernel
drops the lock when the holder dies, even by SIGKILL, so a crash never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Iterator


class WorkdirBusy(RuntimeError):
    """Another run holds the work dir."""


@contextlib.contextmanager
def workdir_lock(workdir: str | Path, wait: bool = False) -> Iterator[None]:
    path = Path(workdir) / ".lifecycle.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            raise WorkdirBusy(f"work dir {workdir} is in use by another lifecycle run ({holder or 'unknown holder'}); "
                              "wait for it to finish, or use another workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                             time.gmtime())}).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
