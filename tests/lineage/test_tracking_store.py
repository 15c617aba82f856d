"""The MLflow store is checked before a run does any work: a damaged SQLite store is refused naming the file and
the backup to restore, a dead tracking server fails within seconds naming its URI, and each completed run keeps
an online backup of the SQLite store (the newest 3)."""

from __future__ import annotations

import shutil
import socket
import sqlite3
import time

import pytest
from pydantic import BaseModel

from lifecycle.lineage.tracking import (KEEP_BACKUPS, Tracker, TrackingConfig, TrackingStoreError, backup_store,
                                        backups, sqlite_path)


class Cfg(BaseModel):
    workdir: str


def finished_run(wd) -> Tracker:
    t = Tracker(TrackingConfig(model_name="m"), str(wd), "exp")
    t.start("run", Cfg(workdir=str(wd)), {"prefect.flow_run_id": "fr"})
    t.log_metrics("collect", {"rows_in": 10})
    t.end("FINISHED")
    return t


def flip_middle(path, n: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


def test_sqlite_path_forms():
    assert str(sqlite_path("sqlite:////abs/dir/mlflow.db")) == "/abs/dir/mlflow.db"
    assert str(sqlite_path("sqlite:///runs/demo/mlflow.db")) == "runs/demo/mlflow.db"
    assert sqlite_path("http://127.0.0.1:5000") is None and sqlite_path("sqlite://") is None


def test_completed_run_is_backed_up_and_a_damaged_store_refused_naming_the_backup(tmp_path):
    t = finished_run(tmp_path)
    db = tmp_path / "mlflow.db"
    [b] = backups(tmp_path)
    with sqlite3.connect(b) as con:  # a real, consistent copy
        assert con.execute("PRAGMA quick_check").fetchone() == ("ok",)
        assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 2  # parent + collect
    t.end("FAILED")  # a failed run keeps no backup
    assert backups(tmp_path) == [b]

    flip_middle(db)
    with pytest.raises(TrackingStoreError) as e:
        Tracker(TrackingConfig(model_name="m"), str(tmp_path), "exp")
    msg = str(e.value)
    assert f"MLflow store {db} is damaged" in msg and f"cp {b} {db}" in msg
    shutil.copyfile(b, db)  # the advice works
    t2 = Tracker(TrackingConfig(model_name="m"), str(tmp_path), "exp")
    t2.start("run", Cfg(workdir=str(tmp_path)), {"prefect.flow_run_id": "fr2"})
    assert t2.resumed


def test_damaged_store_without_backup_says_so(tmp_path):
    finished_run(tmp_path)
    shutil.rmtree(tmp_path / "backups")
    flip_middle(tmp_path / "mlflow.db")
    with pytest.raises(TrackingStoreError, match=f"{tmp_path / 'mlflow.db'} is damaged.*no backup in"):
        Tracker(TrackingConfig(model_name="m"), str(tmp_path), "exp")


def test_backup_rotation_keeps_the_newest_three(tmp_path):
    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE t (i INTEGER)")
    made = []
    for i in range(5):
        with sqlite3.connect(db) as con:
            con.execute("INSERT INTO t VALUES (?)", (i,))
        made.append(backup_store(f"sqlite:///{db}", tmp_path))
    kept = backups(tmp_path)
    assert len(kept) == KEEP_BACKUPS == 3 and kept == made[-3:]
    assert [sqlite3.connect(p).execute("SELECT count(*) FROM t").fetchone()[0] for p in kept] == [3, 4, 5]
    assert not list((tmp_path / "backups").glob("*.tmp"))
    assert backup_store("http://127.0.0.1:1", tmp_path) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_tracking_server_fails_fast_naming_the_uri(tmp_path):
    uri = f"http://127.0.0.1:{_free_port()}"  # nothing listens
    t0 = time.monotonic()
    with pytest.raises(TrackingStoreError, match=f"MLflow tracking server {uri} does not answer"):
        Tracker(TrackingConfig(tracking_uri=uri), str(tmp_path), "exp")
    assert time.monotonic() - t0 < 10


def test_silent_tracking_server_fails_within_seconds(tmp_path):
    """A server that accepts the connection and never answers (hung, or a firewall that swallows packets)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(TrackingStoreError, match=f"{uri} does not answer.*timed out"):
            Tracker(TrackingConfig(tracking_uri=uri), str(tmp_path), "exp")
        assert time.monotonic() - t0 < 10
