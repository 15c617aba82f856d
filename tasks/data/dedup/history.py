"""What dedup persists across runs in the work dir (the MinHash/SimHash index, the paragraph Bloom filter): the
lock that serialises publishing, and which published parts a run over a given parent dedups against."""

from __future__ import annotations

import fcntl
import json
from contextlib import contextmanager
from pathlib import Path

from lifecycle.core.dataset import DatasetRef


@contextmanager
def locked(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def base_parts(parts: list[dict], parent: DatasetRef) -> list[dict]:
    """The parts a run over `parent` deduplicates against: those published before the first part of the same
    parent (so a rerun reproduces its dataset and never dedups against itself), else all of them."""
    for k, p in enumerate(parts):
        if p["parent_sha256"] == parent.sha256:
            return parts[:k]
    return parts


def collected_incrementally(parent: DatasetRef) -> bool:
    """Whether the collect dataset upstream of `parent` was collected incrementally (`collect.incremental`):
    found by walking the parents' manifests. False when there is no collect upstream (a dataset made by hand)."""
    manifest, seen = parent.manifest(), 0
    while manifest.get("stage") != "collect" and manifest.get("parents") and seen < 64:
        try:
            manifest = json.loads(Path(manifest["parents"][0]["manifest"]).read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return False
        seen += 1
    return manifest.get("stage") == "collect" and bool((manifest.get("config") or {}).get("incremental"))
