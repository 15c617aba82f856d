"""A published dedup-index part that is missing or damaged, restored from the committed dedup dataset it was copied
from (`<dataset>/dedup-index.parquet`, byte for byte the part when it was published): the damaged file is moved to
`<workdir>/damaged/dedup-index/` (nothing deleted), with a warning naming both. A part whose dataset copy is gone
or damaged too is left for `Index` to refuse. `Index` calls `restore_parts` before it checks the parts."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from lifecycle.core.fs import atomic_write_bytes, sha256_file
from lifecycle.core.integrity import DAMAGED_DIR

log = logging.getLogger(__name__)
INDEX_FILE = "dedup-index.parquet"  # the dedup config's INDEX_FILE (not imported: this file stands alone)


def restore_parts(directory: Path, parts: list[dict]) -> list[Path]:
    """Restore each part of `directory` (its `_index.json` entries) whose file is missing or not its sha256, from
    its dataset's copy when that one still is; returns the parts restored."""
    restored = []
    for p in parts:
        part = directory / p["path"]
        if part.is_file() and sha256_file(part) == p["sha256"]:
            continue
        source = Path(p.get("dataset_path", "")) / INDEX_FILE
        if not source.is_file() or sha256_file(source) != p["sha256"]:
            continue
        was = "missing"
        if part.exists():
            was = "damaged (moved to damaged/dedup-index/)"
            aside = directory.parents[1] / DAMAGED_DIR / "dedup-index" / directory.name
            aside.mkdir(parents=True, exist_ok=True)
            os.replace(part, aside / f"{part.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        atomic_write_bytes(part, source.read_bytes())
        log.warning("dedup index part %s was %s; restored from the committed dataset's copy %s", part, was, source)
        restored.append(part)
    return restored
