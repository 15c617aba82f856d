"""The persisted index of the documents dedup kept (incremental dedup): `<workdir>/dedup-index/<config hash>/`,
part files with `_index.json` written last (`publish`), read back as an `Index` that DuckDB reads, never loaded whole."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq

from lifecycle.tasks.data.dedup.restore import restore_parts
from lifecycle.core.dataset import DatasetRef, sha256_json
from lifecycle.core.fs import atomic_write_bytes, atomic_write_json, sha256_file
from lifecycle.tasks.data.dedup.config import INDEX_FILE, INDEX_MANIFEST, NAME, DedupConfig
from lifecycle.tasks.data.dedup.history import locked as _locked

class Index:
    """The index parts an incremental run deduplicates against (read by DuckDB, never loaded whole).

    `match_own_doc_ids`: whether an index row with the doc_id of one of this run's rows counts as a copy of it.
    A doc_id is the hash of (source_id, text): the same document, not a copy. When collect re-reads every input
    (`collect.incremental: false`) a rerun after any upstream change (a filter threshold, a tombstone, a code
    upgrade) reaches dedup with the documents the last run kept: they are this run's corpus again, not
    duplicates of it, so those index rows are left out. An incremental collect reads only new or changed files,
    and a document it meets again was delivered again: it stays a duplicate of the run that kept it."""

    def __init__(self, directory: Path, parts: list[dict], match_own_doc_ids: bool = True):
        self.dir, self.parts, self.match_own_doc_ids = directory, parts, match_own_doc_ids
        self.state = sha256_json([(p["path"], p["sha256"]) for p in parts])
        restore_parts(directory, parts)  # a damaged or missing part, from the committed dataset's good copy
        for p in parts:  # the state names these bytes: refuse a part that changed or vanished
            if not (directory / p["path"]).exists() or sha256_file(directory / p["path"]) != p["sha256"]:
                raise RuntimeError(f"dedup index {directory / p['path']}: missing or not the sha256 in "
                                   f"{directory / INDEX_MANIFEST}; remove the index or restore the file")
        self.paths = [str(directory / p["path"]) for p in parts]
        self.counts = [pq.ParquetFile(p).metadata.num_rows for p in self.paths]
        self.num_rows = sum(self.counts)

    def __len__(self) -> int:
        return self.num_rows

    def dataset_of(self, part: int) -> str:
        return f"kept by an earlier run: datasets/{NAME}/{self.parts[part]['dataset'][:20]}"


MINHASH_SOURCE = Path(__file__).with_name("minhash.py")  # the signature code (not imported here: numba)
SIMHASH_SOURCE = Path(__file__).with_name("simhash.py")


def index_dir(workdir: str | Path, cfg: DedupConfig) -> Path:
    """One index per signature-compatible configuration (shingles, permutations, banding, signature code; for
    SimHash its settings and code)."""
    if cfg.method == "simhash":
        key = sha256_json({"method": "simhash", **cfg.simhash.model_dump(mode="json"),
                           "code": hashlib.sha256(MINHASH_SOURCE.read_bytes() + SIMHASH_SOURCE.read_bytes()).hexdigest()})
        return Path(workdir) / "dedup-index" / key[:16]
    key = sha256_json({**cfg.minhash.signature_fields(),
                       "minhash": hashlib.sha256(MINHASH_SOURCE.read_bytes()).hexdigest()})
    return Path(workdir) / "dedup-index" / key[:16]


def _read_parts(directory: Path) -> list[dict]:
    m = directory / INDEX_MANIFEST
    if not m.exists():
        return []
    return json.loads(m.read_text())["parts"]


def publish(ref: DatasetRef, parent: DatasetRef, cfg: DedupConfig, workdir: str | Path) -> None:
    """Append a committed dataset's kept documents to the index (once): part file first, `_index.json` last."""
    directory = index_dir(workdir, cfg)
    with _locked(directory):
        parts = _read_parts(directory)
        if any(p["dataset"] == ref.fingerprint for p in parts):
            return
        src = ref.dir / INDEX_FILE
        name = f"part-{len(parts):05d}.parquet"
        atomic_write_bytes(directory / name, src.read_bytes())
        parts.append({"path": name, "sha256": sha256_file(directory / name), "num_rows": ref.num_rows,
                      "dataset": ref.fingerprint, "dataset_path": str(ref.dir), "parent_sha256": parent.sha256,
                      "base_state": ref.manifest()["config"].get("index_state")})
        atomic_write_json(directory / INDEX_MANIFEST, {"config": cfg.model_dump(mode="json"), "parts": parts})
