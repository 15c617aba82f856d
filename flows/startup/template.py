"""A migrated, empty Prefect database kept per Prefect version, copied into each new work dir.

A new work dir's embedded server spends most of its start-up creating its database (Prefect's migrations;
docs/benchmarks.md, "Issue 25: every worker used, a cached Prefect database, start-up overlapped"). The first one
on a machine keeps a copy of the database it made, just migrated, before any run (`template_path`), and each later
new work dir starts from that copy; Prefect's start-up then only checks that the schema is current. Off with
LIFECYCLE_PREFECT_TEMPLATE=0, or when the server's database is configured elsewhere
(PREFECT_API_DATABASE_CONNECTION_URL).
"""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path

from lifecycle.core.fs import cache_dir, copy_sqlite

TEMPLATE_ENV = "LIFECYCLE_PREFECT_TEMPLATE"


def embedded_db(workdir: Path) -> Path:
    return workdir / ".prefect" / "prefect.db"


def template_path() -> Path | None:
    """Where the migrated empty database for this Prefect version is kept (None: templates are off)."""
    if os.environ.get(TEMPLATE_ENV, "1") == "0" or os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL"):
        return None
    from importlib.metadata import version

    return cache_dir() / f"prefect-{version('prefect')}-empty.db"


def save_template(db: Path, template: Path) -> bool:
    """Keep the just-migrated database `db` as `template` if the copy holds no flow run, passes
    `PRAGMA integrity_check` and has its schema version. A failure only means that the next new work dir
    migrates again."""
    def empty_and_sound(conn) -> bool:
        return (conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
                and conn.execute("SELECT count(*) FROM alembic_version").fetchone()[0] == 1
                and conn.execute("SELECT count(*) FROM flow_run").fetchone()[0] == 0)

    try:
        return copy_sqlite(db, template, check=empty_and_sound, readonly=True)
    except (OSError, sqlite3.Error) as e:
        print(f"lifecycle: could not keep the Prefect database template {template}: {e}", file=sys.stderr)
        return False


def seed_from_template(template: Path, db: Path) -> None:
    """A new work dir's database, copied from the template (if that fails, the server creates its own)."""
    try:
        copy_sqlite(template, db)
    except (OSError, sqlite3.Error) as e:
        print(f"lifecycle: could not copy the Prefect database template {template}: {e}", file=sys.stderr)
