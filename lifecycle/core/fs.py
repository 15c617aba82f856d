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
import os
from pathlib import Path
from typing import BinaryIO


def is_url(path: str) -> bool:
    return "://" in str(path)


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
    fs, path = _fs(pattern)
    found = fs.glob(path) if _glob.has_magic(path) else ([path] if fs.exists(path) else [])
    return sorted(fs.unstrip_protocol(p) for p in found if fs.isfile(p))


def open_bytes(path: str) -> BinaryIO:
    if not is_url(path):
        return open(path, "rb")
    fs, p = _fs(path)
    return fs.open(p, "rb")


def size(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    fs, p = _fs(path)
    return fs.size(p)


def read_bytes(path: str) -> bytes:
    with open_bytes(path) as f:
        return f.read()


def sha256(path: str, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open_bytes(path) as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()
