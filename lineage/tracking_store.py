"""The MLflow store itself, before and after a run: its health check (`check_store`), its backups
(`backup_store`), a new SQLite store seeded from a cached empty one, and the imports a run preloads.
lineage/tracking.py (which re-exports these names) logs the runs into it.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import urllib.error
import urllib.request
from pathlib import Path

from lifecycle.core.errors import UsageError
from lifecycle.core.fs import cache_dir, copy_sqlite, fsync_path

BACKUPS = "backups"  # <workdir>/backups/mlflow-<time>.db
KEEP_BACKUPS = 3
HEALTH_TIMEOUT_S = 5.0


class TrackingStoreError(UsageError, RuntimeError):
    """The MLflow store is damaged, or the tracking server does not answer (before the run: nothing is run)."""


def sqlite_path(uri: str) -> Path | None:
    """The file of a `sqlite:///<path>` tracking URI (SQLAlchemy form: `sqlite:////abs/path.db`, or
    `sqlite:///rel/path.db` relative to the current directory), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def backups(workdir: str | Path) -> list[Path]:
    """The SQLite store's backups in a work dir, oldest first."""
    return sorted((Path(workdir) / BACKUPS).glob("mlflow-*.db"))


def check_store(uri: str, workdir: str | Path, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Refuse a tracking store that would lose or corrupt what the run logs, before the run does any work.

    SQLite: `PRAGMA quick_check` must say ok (a store that does not exist yet is fine: MLflow creates it).
    http(s): `GET <uri>/health` must answer 200 within `timeout_s` (MLflow's own client retries a dead server
    for minutes)."""
    db = sqlite_path(uri)
    if db is not None:
        if not db.exists() or db.stat().st_size == 0:
            return
        try:
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as con:
                rows = [r[0] for r in con.execute("PRAGMA quick_check")]
        except sqlite3.DatabaseError as e:
            rows = [f"{type(e).__name__}: {e}"]
        if rows != ["ok"]:
            rows = [" ".join(str(r).split()) for r in rows]  # one line
            found = backups(workdir)
            fix = (f"restore the newest backup: cp {found[-1]} {db}" if found else
                   f"no backup in {Path(workdir) / BACKUPS}: move {db} aside to start a new store")
            raise TrackingStoreError(f"MLflow store {db} is damaged (PRAGMA quick_check: {'; '.join(rows[:3])}); "
                                     f"nothing was run; {fix}")
    elif uri.startswith(("http://", "https://")):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                if r.status != 200:
                    raise TrackingStoreError(f"MLflow tracking server {uri} answered GET /health with {r.status}")
        except (urllib.error.URLError, OSError) as e:  # refused, unresolvable, timed out, HTTP error
            raise TrackingStoreError(f"MLflow tracking server {uri} does not answer (GET {url}, {timeout_s:g} s: "
                                     f"{getattr(e, 'reason', e)}); start it (`lifecycle up`) or fix "
                                     "tracking.tracking_uri / MLFLOW_TRACKING_URI; nothing was run") from None


def backup_store(uri: str, workdir: str | Path, keep: int = KEEP_BACKUPS) -> Path | None:
    """An online copy of a SQLite store (SQLite's backup API: consistent while MLflow holds it open) in
    `<workdir>/backups/mlflow-<UTC time>.db`; the newest `keep` backups are kept. None for other stores."""
    db = sqlite_path(uri)
    if db is None or not db.exists():
        return None
    out_dir = Path(workdir) / BACKUPS
    out_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()  # one reading: two (gmtime, then time) can straddle a second and sort out of order
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"  # never rounds up
    dest = out_dir / f"mlflow-{stamp}.db"
    tmp = dest.with_name(dest.name + ".tmp")
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as src, contextlib.closing(sqlite3.connect(tmp)) as dst:
        src.backup(dst)
    fsync_path(tmp)
    os.replace(tmp, dest)
    fsync_path(out_dir)
    for old in backups(workdir)[:-keep]:
        old.unlink()
    return dest


def preload_sqlite_store() -> None:
    """Import what opening a SQLite store costs before its file is opened (MLflow's SQLAlchemy stores and their
    mappers; the cost: docs/benchmarks.md, "Issue 25: fixed overhead"). `lifecycle run` calls it while Prefect's embedded server starts, so the flow's Tracker then
    only opens the file."""
    import mlflow.store.db.utils  # noqa: F401
    from mlflow.store.model_registry import sqlalchemy_store as _registry  # noqa: F401
    from mlflow.store.tracking import sqlalchemy_store as _tracking  # noqa: F401
    from sqlalchemy.orm import configure_mappers

    configure_mappers()


def preload_client() -> None:
    """Import what a run's Tracker imports against a tracking server: the client, its REST store and the
    `mlflow-artifacts` repository (the warm runner, lifecycle/launch.py, does it once for every run it forks)."""
    from mlflow import MlflowClient  # noqa: F401
    from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository  # noqa: F401
    from mlflow.store.tracking.rest_store import RestStore  # noqa: F401


def seed_sqlite_store(db: Path) -> None:
    """Create a new SQLite store as a copy of an empty one that MLflow's migrations (some 80 alembic scripts:
    seconds, on every new work dir) built once per MLflow version, in `$XDG_CACHE_HOME/lifecycle/` (default
    ~/.cache/lifecycle/). Tables and schema version only: MLflow adds its default experiment (whose artifact
    location depends on the store) when it opens the copy, as it does for a store it migrated itself, and checks
    the schema version as always."""
    import mlflow
    from mlflow.store.db.utils import _initialize_tables, create_sqlalchemy_engine

    template = cache_dir() / f"mlflow-empty-{mlflow.__version__}.db"
    if not template.exists():
        template.parent.mkdir(parents=True, exist_ok=True)
        tmp = template.with_name(f".{template.name}.{os.getpid()}.tmp")
        engine = create_sqlalchemy_engine(f"sqlite:///{tmp}")
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(tmp, template)  # two processes building it at once: either complete copy wins
    copy_sqlite(template, db)
