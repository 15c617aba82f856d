"""A bound on the embedded servers left up across work dirs. Each work dir's first `lifecycle run` leaves its
embedded Prefect server and a warm runner up for the next run (flows/startup/environment.py), and they add up
(docs/operations.md, "Without `up`: the embedded server"). A machine keeps at most `$LIFECYCLE_EMBEDDED_MAX`
(default 3) work dirs' servers: starting one more stops those of the work dirs least recently used, unless a run
holds them.

The registry is one empty file per work dir under `<cache>/embedded/` (named by a hash of the work dir, holding
its path), touched at each use; its mtime orders the work dirs. This module starts and stops nothing itself: the
caller passes how to tell a work dir's servers are up and unused, and how to stop them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from lifecycle.core.fs import cache_dir

MAX_ENV = "LIFECYCLE_EMBEDDED_MAX"
MAX_DEFAULT = 3


def registry() -> Path:
    return cache_dir() / "embedded"


def note_use(workdir: Path) -> None:
    """Record that a run uses `workdir`'s embedded server now."""
    reg = registry()
    reg.mkdir(parents=True, exist_ok=True)
    entry = reg / hashlib.sha256(str(workdir).encode()).hexdigest()[:16]
    entry.write_text(str(workdir))
    os.utime(entry)


def limit() -> int:
    value = os.environ.get(MAX_ENV) or str(MAX_DEFAULT)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"${MAX_ENV} must be a whole number >= 1, not {value!r}")
    return int(value)


def stop_least_used(current: Path, idle: Callable[[Path], bool], stop: Callable[[Path], list[str]]) -> list[str]:
    """Before `current` starts a server: stop the servers of the least recently used other work dirs whose
    servers are up and unused (`idle`), so that at most `limit()` stay up with `current`'s. Returns what stopped,
    as 'name (work dir)'."""
    others = []
    for entry in registry().glob("*") if registry().is_dir() else ():
        try:
            wd = Path(entry.read_text())
            used = entry.stat().st_mtime
        except OSError:  # removed by another run meanwhile
            continue
        if wd == current:
            continue
        if not (wd / "datasets").is_dir() and not (wd / ".servers").is_dir():  # the work dir is gone
            entry.unlink(missing_ok=True)
            continue
        if idle(wd):
            others.append((used, wd, entry))
    others.sort(reverse=True)  # most recently used first
    stopped = []
    for _, wd, entry in others[limit() - 1:]:
        stopped += [f"{name} ({wd})" for name in stop(wd)]
        entry.unlink(missing_ok=True)
    return stopped
