"""A dataset's manifest and the integrity checks on it: nothing on disk is trusted because it exists.

lifecycle/core/dataset.py (which re-exports these names) writes datasets and says when one is reused;
this module holds what checks them: `load_manifest`, `verify_dataset` (reuse and `lifecycle verify`),
`read_parquet` (a whole-file read hashed against the manifest), `open_parquet` (page CRCs on a streamed read),
`quarantine` (moving a damaged dataset aside) and `committed_datasets`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lifecycle.core.fs import atomic_write_json, fsync_path, sha256_file

MANIFEST = "_manifest.json"
SCHEMA_VERSION = 1
DAMAGED_DIR = "damaged"  # <workdir>/damaged/<stage>/<name>-<time>/: datasets moved aside, never deleted
ENTRY_KINDS = ("files", "rejected", "extra")
_MANIFEST_KEYS = {"stage": str, "fingerprint": str, "sha256": str, "num_rows": int,
                  **{k: list for k in ENTRY_KINDS}}

log = logging.getLogger("lifecycle.core.dataset")  # the name its warnings have always carried


class DatasetDamaged(RuntimeError):
    """A committed dataset whose files do not match its manifest, or whose manifest cannot be read."""

    def __init__(self, path: str | Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path}: {problem}")

    def __reduce__(self):  # crosses process boundaries (a shard's watched process) as itself, notes included
        return type(self), (self.path, self.problem), self.__dict__


# --------------------------------------------------------------------------------------------------
# hashing


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


# --------------------------------------------------------------------------------------------------
# integrity: manifests, reuse checks, verified reads, quarantine


def load_manifest(dataset: str | Path) -> dict:
    """The parsed `_manifest.json` of a dataset directory; DatasetDamaged naming the file when it is missing,
    truncated, not JSON, or lacks a field every manifest has."""
    path = Path(dataset) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DatasetDamaged(path, f"unreadable manifest ({type(e).__name__}: {e})") from None
    if not isinstance(m, dict):
        raise DatasetDamaged(path, f"invalid manifest: a JSON {type(m).__name__}, not an object")
    for key, kind in _MANIFEST_KEYS.items():
        if not isinstance(m.get(key), kind):
            raise DatasetDamaged(path, f"invalid manifest: field {key!r} is missing or not a {kind.__name__}")
    return m


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _verified_path(dataset: Path) -> Path:
    return dataset.with_name(f".verified-{dataset.name}.json")


def verify_dataset(dataset: str | Path, fingerprint: str | None = None, full: bool = True) -> list[str]:
    """Problems of a committed dataset directory, each naming its file; [] when it is sound.

    Checks that the manifest parses, names this directory's fingerprint (and `fingerprint`, when given) and
    that its content sha256 is that of its file list; that every listed file exists with its size and sha256.
    `full=False` (reuse) skips hashing a file whose stat signature is the one recorded when its sha256 last
    matched, and records the signature of every file it hashed."""
    d = Path(dataset)
    try:
        m = load_manifest(d)
    except DatasetDamaged as e:
        return [str(e)]
    mpath = d / MANIFEST
    if m["fingerprint"][:20] != d.name or (fingerprint is not None and m["fingerprint"] != fingerprint):
        return [f"{mpath}: manifest fingerprint {m['fingerprint'][:20]} does not name this dataset"]
    entries = {k: m[k] for k in ENTRY_KINDS}
    try:
        content = sha256_json({k: [(e["path"], e["sha256"]) for e in v] for k, v in entries.items()})
    except (KeyError, TypeError) as e:
        return [f"{mpath}: invalid manifest: a file entry lacks {e}"]
    if content != m["sha256"]:
        return [f"{mpath}: the file list's sha256 is {content[:16]}..., the manifest says {m['sha256'][:16]}..."]
    cache_path = _verified_path(d)
    cache: dict = {}
    if not full:
        try:
            cache = json.loads(cache_path.read_text())
        except (OSError, ValueError):
            cache = {}
    problems, verified = [], {}
    for e in (e for v in entries.values() for e in v):
        p = d / e["path"]
        try:
            st = p.stat()
        except OSError as err:
            problems.append(f"{p}: missing ({type(err).__name__})")
            continue
        if st.st_size != e["bytes"]:
            problems.append(f"{p}: {st.st_size} bytes, the manifest says {e['bytes']}")
            continue
        key = _stat_key(st)
        if not full and cache.get(e["path"]) == key:
            verified[e["path"]] = key
            continue
        sha = sha256_file(p)
        if sha != e["sha256"]:
            problems.append(f"{p}: sha256 {sha[:16]}..., the manifest says {e['sha256'][:16]}...")
        elif _stat_key(p.stat()) == key:  # unchanged while it was hashed
            verified[e["path"]] = key
    if problems:
        cache_path.unlink(missing_ok=True)
    elif verified != cache:
        try:
            atomic_write_json(cache_path, verified)
        except OSError:  # a read-only store: verify again next time
            pass
    return problems


def quarantine(dataset: str | Path, problems: list[str]) -> Path:
    """Move a damaged dataset directory to `<workdir>/damaged/<stage>/<name>-<UTC time>/` (nothing is deleted)
    and warn, naming what failed; the fingerprint's path is free again, so the caller rebuilds it."""
    d = Path(dataset)
    dest = d.parents[2] / DAMAGED_DIR / d.parent.name / f"{d.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    while dest.exists():
        dest = dest.with_name(dest.name + "-1")
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(d, dest)
    fsync_path(d.parent)
    fsync_path(dest.parent)
    _verified_path(d).unlink(missing_ok=True)
    log.warning("dataset %s is damaged: %s; moved it aside to %s and rebuilding it", d, "; ".join(problems), dest)
    return dest


def committed_datasets(workdir: str | Path) -> list[Path]:
    """Every committed dataset directory of a work dir: `datasets/<stage>/<name>/` with a manifest file (even an
    unreadable one), or a name of 20 hex digits (only a commit renames a directory to that), oldest stage first."""
    root = Path(workdir) / "datasets"
    out = []
    for d in sorted(root.glob("*/*")):
        if d.is_dir() and not d.name.startswith(".") and \
                ((d / MANIFEST).exists() or (len(d.name) == 20 and all(c in "0123456789abcdef" for c in d.name))):
            out.append(d)
    return out


def _manifest_entry(path: Path) -> tuple[Path, dict] | None:
    """(dataset directory, manifest entry) of a file inside a committed dataset, else None."""
    for d in path.parents:
        if (d / MANIFEST).exists():
            rel = path.relative_to(d).as_posix()
            m = load_manifest(d)
            for e in (e for k in ENTRY_KINDS for e in m[k]):
                if e.get("path") == rel:
                    return d, e
            return None
        if d.name == "datasets":
            return None
    return None


def read_parquet(path: str | Path, columns: list[str] | None = None) -> pa.Table:
    """Read a whole Parquet file once: its bytes are checked against the size and sha256 its dataset's manifest
    lists (when it lies in a committed dataset), and its pages against their CRCs. DatasetDamaged names the
    file and what failed; the dataset's verified record is dropped, so the next reuse re-hashes it, moves it
    aside and rebuilds it."""
    path = Path(path)
    found = _manifest_entry(path.resolve())
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if found is None:
            raise
        _damaged_on_read(found[0], path, "missing")
    if found is not None:
        d, e = found
        if len(data) != e["bytes"]:
            _damaged_on_read(d, path, f"{len(data)} bytes read, the manifest says {e['bytes']}")
        sha = hashlib.sha256(data).hexdigest()
        if sha != e["sha256"]:
            _damaged_on_read(d, path, f"sha256 {sha[:16]}... read, the manifest says {e['sha256'][:16]}...")
    try:
        return pq.read_table(pa.BufferReader(data), columns=columns, page_checksum_verification=True)
    except (OSError, pa.ArrowInvalid) as err:
        if found is not None:
            _damaged_on_read(found[0], path, f"unreadable Parquet ({err})")
        raise DatasetDamaged(path, f"unreadable Parquet ({err})") from None


def _damaged_on_read(dataset: Path, path: Path, problem: str):
    _verified_path(dataset).unlink(missing_ok=True)
    raise DatasetDamaged(path, f"{problem}; dataset {dataset} is damaged: rerun to move it aside and rebuild it")


def open_parquet(path: str | Path) -> pq.ParquetFile:
    """A Parquet file to stream by row group, each page verified against its CRC as it is read (streaming
    readers do not hash the whole file: that would read it twice)."""
    return pq.ParquetFile(path, page_checksum_verification=True)
