"""Checkpoint commit protocol on top of DeepSpeed's `save_checkpoint`.

DeepSpeed's own `latest` file is not a commit: rank 0 writes it with a plain `open(..., 'w')`, without an
fsync or a barrier after the other ranks' shard writes. So we save with `save_latest=False` and commit
ourselves. One checkpoint is one tag directory `<root>/step_<8 digits>/`:

1. (rank 0) a stale directory of the same tag, left by a crash or a failed verification, is removed,
   marker first; barrier.
2. (all ranks) `engine.save_checkpoint(root, tag, client_state, save_latest=False)`.
3. (all ranks) gather the weights (ZeRO-3 partitions them: `deepspeed.zero.GatheredParameters`); rank 0
   writes a consolidated fp32 `model.safetensors` and `model_config.json` into the tag directory.
4. (all ranks) fsync every file they can see in the tag directory; barrier.
5. (rank 0) write `COMMITTED.json` (path, sha256, bytes of every file in the tag directory, step, time) to
   a temporary name, fsync, rename, fsync the directory; barrier. The sha256 of a file its writer hashed
   while writing it (`write_model`'s two files; every file of the async save, `lifecycle.tasks.train.persist`) is
   taken from that writer, once the size on disk is checked against it; every other file (DeepSpeed's own
   writes) is fsynced again and hashed from disk here.

A tag directory without `COMMITTED.json` does not exist for resume or export. `latest_valid` re-hashes
the files and falls back to the previous committed checkpoint, logging why, when one was damaged after
its commit. Pruning deletes the marker first, so a crash mid-prune never leaves a half-deleted
checkpoint that still looks committed.

Checkpoints are loaded by DeepSpeed with `torch.load(weights_only=False)`: only resume from directories
this code wrote. Consumers outside training (evaluate, export) read `model.safetensors`, never pickle.

torch, safetensors and deepspeed are imported inside the functions that need them: the train task
imports this module to find committed checkpoints without loading torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lifecycle.core.fs import atomic_write_json, fsync_path, sha256_file

log = logging.getLogger(__name__)

MARKER = "COMMITTED.json"
WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"
_TAG = re.compile(r"^step_(\d{8})$")


def tag_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag_dir: str | Path) -> int:
    m = _TAG.match(Path(tag_dir).name)
    if not m:
        raise ValueError(f"{tag_dir} is not a checkpoint tag directory (step_<8 digits>)")
    return int(m.group(1))


def _tag_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _TAG.match(p.name)))


def _files(tag_dir: Path) -> list[Path]:
    return sorted(p for p in tag_dir.rglob("*") if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp"))


# --------------------------------------------------------------------------------------------------
# commit and verify (plain files, no torch)


Digest = tuple[str, int]  # (sha256 hex, bytes) of a file, as its writer hashed it


def commit(tag_dir: str | Path, step: int, extra: dict[str, Any] | None = None,
           known: Mapping[str, Digest] | None = None) -> dict:
    """Write the marker of a fully written tag directory last (atomic), listing every file in it.

    `known` maps paths relative to `tag_dir` to the digest their writer computed while writing them, after it
    had made them durable (file fsynced, renamed into place, directory fsynced: `hashed_atomic_file`). Those
    files are listed with that digest once their size on disk matches it; a known file that is missing or has
    another size raises ValueError and nothing is committed (the directory is not what was written). Every
    other file is fsynced and hashed here."""
    tag_dir = Path(tag_dir)
    known = dict(known or {})
    paths = _files(tag_dir)
    files = []
    for p in paths:
        rel = p.relative_to(tag_dir).as_posix()
        size = p.stat().st_size
        if (digest := known.pop(rel, None)) is not None:
            sha, written = digest
            if size != written:
                raise ValueError(f"{tag_dir}: {rel} has {size} bytes on disk, its writer wrote {written}; not committed")
        else:
            fsync_path(p)
            sha = sha256_file(p)
            size = p.stat().st_size
        files.append({"path": rel, "sha256": sha, "bytes": size})
    if known:
        raise ValueError(f"{tag_dir}: {sorted(known)} written but missing; not committed")
    for d in {p.parent for p in paths} | {tag_dir}:
        fsync_path(d)
    marker = {"step": step, "tag": tag_dir.name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "files": files, **(extra or {})}
    atomic_write_json(tag_dir / MARKER, marker)
    fsync_path(tag_dir.parent)
    return marker


def read_marker(tag_dir: str | Path) -> dict:
    return json.loads((Path(tag_dir) / MARKER).read_text())


def verify(tag_dir: str | Path, hashes: bool = True) -> str | None:
    """None when the tag directory is committed and every listed file matches; else the reason.
    `hashes=False`: sizes only (a reader that hashes what it reads checks the rest)."""
    tag_dir = Path(tag_dir)
    try:
        marker = read_marker(tag_dir)
    except FileNotFoundError:
        return "no commit marker"
    except (OSError, ValueError) as e:
        return f"unreadable marker: {e}"
    if marker.get("step") != step_of(tag_dir):
        return f"marker step {marker.get('step')} != directory step {step_of(tag_dir)}"
    for f in marker.get("files", []):
        p = tag_dir / f["path"]
        if not p.is_file():
            return f"missing file {f['path']}"
        if p.stat().st_size != f["bytes"]:
            return f"{f['path']}: {p.stat().st_size} bytes, marker says {f['bytes']}"
        if hashes and sha256_file(p) != f["sha256"]:
            return f"{f['path']}: sha256 mismatch"
    return None


def list_committed(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """(step, tag_dir) of every directory with a commit marker, oldest first. Hashes are not checked."""
    return [(s, p) for s, p in _tag_dirs(Path(ckpt_root)) if (p / MARKER).is_file()]


def latest_valid(ckpt_root: str | Path, max_step: int | None = None, hashes: bool = True,
                 damaged: list[str] | None = None) -> Path | None:
    """Newest committed checkpoint (at most `max_step`) whose files all match their marker hashes (`hashes=False`:
    their sizes). `damaged`: each newer commit passed over is appended as `<tag dir> (<what is wrong>)`."""
    for step, path in reversed(list_committed(ckpt_root)):
        if max_step is not None and step > max_step:
            continue
        reason = verify(path, hashes=hashes)
        if reason is None:
            return path
        log.warning("checkpoint %s is committed but damaged (%s); falling back to the previous one", path, reason)
        if damaged is not None:
            damaged.append(f"{path} ({reason})")
    return None


def remove(tag_dir: str | Path) -> None:
    """Un-commit (marker first, made durable) and then delete a tag directory."""
    tag_dir = Path(tag_dir)
    marker = tag_dir / MARKER
    if marker.exists():
        marker.unlink()
        fsync_path(tag_dir)
    shutil.rmtree(tag_dir, ignore_errors=True)


def prune(ckpt_root: str | Path, keep_last: int, keep: tuple[str | Path, ...] = ()) -> list[Path]:
    """Keep the `keep_last` newest committed checkpoints (and any in `keep`); delete older committed ones and
    uncommitted leftovers older than the newest committed one. Returns what was deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    committed = list_committed(ckpt_root)
    protect = {Path(p).resolve() for p in keep} | {p.resolve() for _, p in committed[-keep_last:]}
    newest = committed[-1][0] if committed else -1
    doomed = [p for s, p in _tag_dirs(Path(ckpt_root))
              if p.resolve() not in protect and ((p / MARKER).exists() or s < newest)]
    for p in doomed:
        remove(p)
    return doomed


# --------------------------------------------------------------------------------------------------
# weights


class HashingWriter:
    """Write-only file-like object over a binary file that hashes (sha256) and counts what goes through it.

    It has no `fileno`, `seek` or `tell`, so `torch.save` writes through `write()` alone, in file order: its
    zipfile writer emits the archive sequentially (the C++ writer refuses out-of-order offsets), and its
    legacy writer writes storages through `write()` when the file has no fileno. A writer that wanted to
    seek would fail with AttributeError instead of hashing other bytes than the file holds. Each write is
    hashed and written in 1 MiB pieces, so the bytes are read from memory once and are still in the CPU cache
    when they are copied to the page cache."""

    CHUNK = 1 << 20

    def __init__(self, f):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), self.CHUNK):
            piece = view[i : i + self.CHUNK]
            self.sha.update(piece)
            while piece:
                piece = piece[self.f.write(piece) :]
        self.bytes += len(view)
        return len(view)

    def flush(self) -> None:
        self.f.flush()

    def digest(self) -> Digest:
        return self.sha.hexdigest(), self.bytes


@contextmanager
def hashed_atomic_file(path: str | Path) -> Iterator[HashingWriter]:
    """A `HashingWriter` over `<path>.tmp`; on leaving the block the file is fsynced, renamed into place and its
    directory fsynced (on an error it is removed): `path` is either absent, as before, or complete and durable."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield HashingWriter(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_bytes_hashed(path: str | Path, data: bytes) -> Digest:
    """`data` to `path` atomically and durably (`hashed_atomic_file`); returns its digest."""
    with hashed_atomic_file(path) as w:
        w.write(data)
    return w.digest()


_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(w: HashingWriter, state: Mapping[str, Any], metadata: dict[str, str]) -> None:
    """`state` (name -> CPU tensor) in the safetensors format, written through `w` straight from the tensors'
    memory. `safetensors.torch.save` would first build the whole file in a Rust buffer and copy that into a
    Python bytes object (two copies of the weights, in freshly faulted memory); here each tensor's bytes go
    from where they are (the persist process's shared-memory arena) to the writer. The layout is
    safetensors' (compact JSON header, `__metadata__` first, padded with spaces to 8 bytes, then the data in
    header order, tensors sorted by name within a dtype); dtypes go by descending element size (safetensors
    orders them by its own dtype enum, so a mixed-dtype file differs in layout, not in what it loads as). For
    the all-fp32 weights of `write_model` the bytes equal `safetensors.torch.save`'s (a test checks it)."""
    import torch

    items = sorted(state.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    views, offset = [], 0
    for name, t in items:
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise ValueError(f"{name}: safetensors needs dense CPU tensors, got {t.device} {t.layout}")
        t = t.contiguous()  # a no-op for the arena's tensors and export_state's copies
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        views.append(t.reshape(-1).view(torch.uint8).numpy() if n else b"")
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    w.write(len(head).to_bytes(8, "little") + head)
    for v in views:
        w.write(v)


def write_model(tag_dir: str | Path, state: dict, model_config: Any) -> dict[str, Digest]:
    """Consolidated fp32 weights as safetensors plus the architecture as JSON (both atomic and durable);
    returns {file name: (sha256, bytes)} for `commit`."""
    tag_dir = Path(tag_dir)
    # One metadata key only (safetensors' own writer puts a multi-key metadata map in random Rust HashMap
    # order; one key keeps the bytes deterministic whoever writes them). The step is in the commit marker.
    config = json.dumps(model_config.model_dump(mode="json"), indent=2, sort_keys=True, default=str) + "\n"
    with hashed_atomic_file(tag_dir / WEIGHTS) as w:
        write_safetensors(w, state, {"format": "pt"})
    return {WEIGHTS: w.digest(), MODEL_CONFIG: write_bytes_hashed(tag_dir / MODEL_CONFIG, config.encode())}


def load_model(tag_dir: str | Path, check: bool = True):
    """`lifecycle.tasks.train.model.GPT` in eval mode from a committed checkpoint's safetensors (no pickle involved)."""
    from safetensors.torch import load_file

    from lifecycle.tasks.train.model import GPT, ModelConfig

    tag_dir = Path(tag_dir)
    if check and (reason := verify(tag_dir)) is not None:
        raise ValueError(f"checkpoint {tag_dir} is not usable: {reason}")
    cfg = ModelConfig.model_validate_json((tag_dir / MODEL_CONFIG).read_text())
    model = GPT(cfg)
    model.load_export(load_file(str(tag_dir / WEIGHTS)))
    return model.eval()


# --------------------------------------------------------------------------------------------------
# the collective save (every rank calls it)


def gathered_export(module, rank: int, copy: bool = True) -> dict | None:
    """The dense model's `export_state` on rank 0 (None on the others); collective. ZeRO-3 partitions are
    gathered (`deepspeed.zero.GatheredParameters`, a no-op below ZeRO-3); a module whose `collective_export` is
    true (a pipeline stage, lifecycle.tasks.train.parallel.pp; a tensor-parallel shard, parallel.tp) gathers the
    other ranks' parts itself, called on every rank; MoE experts are gathered over their expert-parallel group
    (parallel.moe.consolidated_state)."""
    import deepspeed

    from lifecycle.tasks.train.parallel.moe import consolidated_state

    if getattr(module, "collective_export", False):
        state = module.export_state(copy=copy)
        return state if rank == 0 else None
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return consolidated_state(module, copy=copy)  # experts gathered over their expert-parallel group


def save(engine, ckpt_root: str | Path, step: int, client_state: dict, model_config: Any,
         marker_extra: dict | None = None) -> Path:
    """Save and commit checkpoint `step` from a DeepSpeed engine; returns the committed tag directory."""
    import torch.distributed as dist

    root, rank = Path(ckpt_root), dist.get_rank()
    tag_dir = root / tag_name(step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tag_dir.exists():  # stale: a crash before its marker, or a damaged commit we fell back from
            remove(tag_dir)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tag_dir.name, client_state=client_state, save_latest=False)
    state = gathered_export(engine.module, rank)
    if rank == 0:
        written = write_model(tag_dir, state, model_config)
    for p in _files(tag_dir):
        fsync_path(p)
    dist.barrier()
    if rank == 0:
        commit(tag_dir, step, marker_extra, known=written)
    dist.barrier()
    return tag_dir
