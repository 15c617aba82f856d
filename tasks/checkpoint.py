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
5. (rank 0) fsync everything again, hash every file, and write `COMMITTED.json` (path, sha256, bytes of
   every file, step, time) to a temporary name, fsync, rename, fsync the directory; barrier.

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

import json
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any

from lifecycle.dataset import atomic_write_bytes, atomic_write_json, fsync_dir, fsync_file, sha256_file

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


def commit(tag_dir: str | Path, step: int, extra: dict[str, Any] | None = None) -> dict:
    """Hash every file of a fully written tag directory and write its marker last (atomic)."""
    tag_dir = Path(tag_dir)
    files = []
    for p in _files(tag_dir):
        fsync_file(p)
        files.append({"path": p.relative_to(tag_dir).as_posix(), "sha256": sha256_file(p), "bytes": p.stat().st_size})
    for d in {p.parent for p in _files(tag_dir)} | {tag_dir}:
        fsync_dir(d)
    marker = {"step": step, "tag": tag_dir.name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "files": files, **(extra or {})}
    atomic_write_json(tag_dir / MARKER, marker)
    fsync_dir(tag_dir.parent)
    return marker


def read_marker(tag_dir: str | Path) -> dict:
    return json.loads((Path(tag_dir) / MARKER).read_text())


def verify(tag_dir: str | Path) -> str | None:
    """None when the tag directory is committed and every listed file matches; else the reason."""
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
        if sha256_file(p) != f["sha256"]:
            return f"{f['path']}: sha256 mismatch"
    return None


def list_committed(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """(step, tag_dir) of every directory with a commit marker, oldest first. Hashes are not checked."""
    return [(s, p) for s, p in _tag_dirs(Path(ckpt_root)) if (p / MARKER).is_file()]


def latest_valid(ckpt_root: str | Path, max_step: int | None = None) -> Path | None:
    """Newest committed checkpoint (at most `max_step`) whose files all match their marker hashes."""
    for step, path in reversed(list_committed(ckpt_root)):
        if max_step is not None and step > max_step:
            continue
        reason = verify(path)
        if reason is None:
            return path
        log.warning("checkpoint %s is committed but damaged (%s); falling back to the previous one", path, reason)
    return None


def remove(tag_dir: str | Path) -> None:
    """Un-commit (marker first, made durable) and then delete a tag directory."""
    tag_dir = Path(tag_dir)
    marker = tag_dir / MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(tag_dir)
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


def write_model(tag_dir: str | Path, state: dict, model_config: Any) -> None:
    """Consolidated fp32 weights as safetensors plus the architecture as JSON (both atomic)."""
    from safetensors.torch import save

    tag_dir = Path(tag_dir)
    # One metadata key only: safetensors writes a multi-key metadata map in random (Rust HashMap) order,
    # which would make identical weights hash differently. The step is in the commit marker.
    atomic_write_bytes(tag_dir / WEIGHTS, save(state, metadata={"format": "pt"}))
    atomic_write_json(tag_dir / MODEL_CONFIG, model_config.model_dump(mode="json"))


def load_model(tag_dir: str | Path, check: bool = True):
    """`tasks.model.GPT` in eval mode from a committed checkpoint's safetensors (no pickle involved)."""
    from safetensors.torch import load_file

    from tasks.model import GPT, ModelConfig

    tag_dir = Path(tag_dir)
    if check and (reason := verify(tag_dir)) is not None:
        raise ValueError(f"checkpoint {tag_dir} is not usable: {reason}")
    cfg = ModelConfig.model_validate_json((tag_dir / MODEL_CONFIG).read_text())
    model = GPT(cfg)
    model.load_export(load_file(str(tag_dir / WEIGHTS)))
    return model.eval()


# --------------------------------------------------------------------------------------------------
# the collective save (every rank calls it)


def save(engine, ckpt_root: str | Path, step: int, client_state: dict, model_config: Any,
         marker_extra: dict | None = None) -> Path:
    """Save and commit checkpoint `step` from a DeepSpeed engine; returns the committed tag directory."""
    import torch.distributed as dist
    import deepspeed

    root, rank = Path(ckpt_root), dist.get_rank()
    tag_dir = root / tag_name(step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tag_dir.exists():  # stale: a crash before its marker, or a damaged commit we fell back from
            remove(tag_dir)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tag_dir.name, client_state=client_state, save_latest=False)
    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):  # no-op below ZeRO-3
        state = module.export_state() if rank == 0 else None
    if rank == 0:
        write_model(tag_dir, state, model_config)
    for p in _files(tag_dir):
        fsync_file(p)
    dist.barrier()
    if rank == 0:
        commit(tag_dir, step, marker_extra)
    dist.barrier()
    return tag_dir
