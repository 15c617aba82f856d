"""Input files named by a local path or by an fsspec URL (`file://`, `s3://`, `gs://`, `memory://`...).

Only inputs are read through fsspec. The work dir must be a POSIX file system (local, or shared between
machines such as NFS or Lustre): the commit protocol needs atomic rename, fsync and `flock`, which object
stores do not provide. A `file://` work dir is accepted and used as the local path it names.
Credentials for remote inputs come from the environment, the way fsspec's backends read them (for s3,
`AWS_ACCESS_KEY_ID`...), never from the pipeline config.
"""

from __future__ import annotations

import glob as _glob
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any, BinaryIO


def is_url(path: str) -> bool:
    """Any URL, file:// included (read through fsspec)."""
    return "://" in str(path)


def is_remote(path: str) -> bool:
    """A URL that names no local file (s3://, http://...): local confinement rules do not apply to it."""
    return is_url(path) and not str(path).startswith("file://")


def local_path(path: str) -> str:
    """The local path a `file://` URL (or a plain path) names."""
    return str(path)[len("file://"):] if str(path).startswith("file://") else str(path)


def _fs(url: str):
    from fsspec.core import url_to_fs

    return url_to_fs(url)


def glob_files(pattern: str) -> list[str]:
    """Files (not directories) matching a glob, sorted; URLs come back as URLs of the same protocol."""
    if not is_url(pattern):
        return sorted(p for p in _glob.glob(pattern, recursive=True) if Path(p).is_file())
    from fsspec import get_filesystem_class
    from fsspec.core import split_protocol

    # fsspec caches a file system per protocol and options, with the credentials and endpoint it read from the
    # environment when it was made: a run lists its inputs with what the environment says now (a long-lived
    # `serve` process, a rotated key), and the files it then opens share that fresh instance
    get_filesystem_class(split_protocol(pattern)[0]).clear_instance_cache()
    fs, path = _fs(pattern)
    found = fs.glob(path) if _glob.has_magic(path) else ([path] if fs.exists(path) else [])
    return sorted(fs.unstrip_protocol(p) for p in found if fs.isfile(p))


def open_bytes(path: str | Path) -> BinaryIO:
    if not is_url(str(path)):
        return open(path, "rb")
    fs, p = _fs(path)
    f = fs.open(p, "rb")
    # s3fs/gcsfs files (fsspec's AbstractBufferedFile) have no `readline(size)`, which the line readers need to
    # bound a line; a BufferedReader over them has it (memory:// files are BytesIO and have it already)
    return f if isinstance(f, io.BufferedIOBase) else io.BufferedReader(f, buffer_size=1 << 20)


def size(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    fs, p = _fs(path)
    return fs.size(p)


def read_bytes(path: str) -> bytes:
    with open_bytes(path) as f:
        return f.read()


def sha256_file(path: str | Path, bufsize: int = 1 << 20) -> str:
    """sha256 of a file's bytes (a local path or an fsspec URL)."""
    h = hashlib.sha256()
    with open_bytes(path) as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory's fsync makes a rename or a new entry in it durable)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to `<path>.tmp`, fsync, rename into place, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def cache_dir() -> Path:
    """This user's cache for things built once per library version: `$XDG_CACHE_HOME/lifecycle` (default
    ~/.cache/lifecycle), created on use."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lifecycle"


def copy_sqlite(src: str | Path, dest: str | Path, check=None, readonly: bool = False) -> bool:
    """Copy the SQLite database `src` to `dest` with SQLite's online backup (a consistent copy while another
    process writes it), as one self-contained file renamed into place: never half a database. `check(conn)`,
    if given, sees the copy first; when it returns False nothing is replaced and the result is False.
    `readonly`: open `src` read-only (a database that another process owns)."""
    import contextlib
    import sqlite3

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        source = sqlite3.connect(f"file:{src}?mode=ro" if readonly else src, timeout=30, uri=readonly)
        with contextlib.closing(source) as s, contextlib.closing(sqlite3.connect(tmp)) as d:
            s.backup(d)
            if check is not None and not check(d):
                return False
            d.execute("PRAGMA journal_mode=DELETE")  # no -wal file beside the copy
        os.replace(tmp, dest)
        return True
    finally:
        tmp.unlink(missing_ok=True)
