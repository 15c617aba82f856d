"""In-memory checkpoint tier: the latest committed checkpoint kept in host memory, outside the ranks, so that a
relaunch after a rank failure restores from memory instead of disk (Gemini, CheckFreq).

The async save already copies every checkpoint into a staging arena in host memory
(`lifecycle.tasks.train.arena`) before its persist process writes the files. With the tier on, those arenas are files on tmpfs,
`/dev/shm/lifecycle-<uid>-<hash of the run directory>/rank<r>/arena-<pid>-<n>`, so the staging buffer IS the tier (no
extra copy) and it outlives the rank. Each rank alternates between two arenas (one holds the last committed
checkpoint while the next is staged into the other), so memory holds at most two checkpoints per host: the
committed one and the one being saved.

Layout of one run's tier (mode 0700, owned by the user):
- `supervisor`: pid of the `run_train` that owns it; `release_dead` removes tiers whose supervisor is gone.
- `rank<r>/step_<8 digits>.idx`: rank r's index of checkpoint `step` (pickle): for every DeepSpeed file it
  saved, the arena and the state's skeleton (tensors as their place in the arena); and every arena range it
  staged, with a CRC-32 of every tensor in it, computed by the persist process after it wrote the files.
- `COMMITTED.json`: {"step", "world_size"}, written by rank 0 after the disk commit of that step, only when
  every rank wrote its index.

A restore uses the tier only when its step is the newest commit on disk, the disk copy's files have the sizes
its marker lists, every rank's index is there and its arenas hold the ranges it lists; else it reads the disk,
and says why. The tier is then a DeepSpeed checkpoint engine (`TierLoader`) whose `load(path)` reads each tensor
out of the arena into memory of its own (`read_checked`: pread in pieces, each piece checksummed while it is
still in the CPU cache, so the bytes are read once), and DeepSpeed's own load logic runs unchanged. A file with a
tensor whose checksum does not match is read from the disk copy instead (its sha256 checked), and the restore
says so.

The checksum is CRC-32 (zlib's: several times faster than sha256, docs/benchmarks.md "Recovery from memory"),
not the sha256 of the disk copy. It guards against accidents (a torn or stale arena, a bug that writes into
one), not against an adversary: the tier is a directory only this user can write (`check_owner`), and a sha256
would cost a restore as much time as copying the state out, on the path meant to be fast. The disk copy keeps
its sha256, which is also the lineage's content address. An index written with another checksum is not used
(the restore reads the disk and says why).

The indexes are pickles: like DeepSpeed's `torch.load(weights_only=False)` of the checkpoint files, they are
only read from a directory this user created with mode 0700. torch is imported in the functions that need it:
the supervisor imports this module to clean tiers up.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import pickle
import shutil
import stat
import time
import zlib
from pathlib import Path
from typing import Any

from lifecycle.core.fs import sha256_file
from lifecycle.tasks.train import commit as ckpt

ROOT = Path("/dev/shm")
MARKER = "COMMITTED.json"
SUPERVISOR = "supervisor"
PIECE = 4 << 20  # bytes per pread in `read_checked`: checksummed while in the CPU cache
CHECKSUM = "crc32-tensor"  # an index's checksums: one CRC-32 per tensor (`write_index` records it, `verify_rank`
# requires it)


def path_for(run_dir: str | Path, root: Path = ROOT) -> Path:
    """The tier directory of the run in `run_dir` (one per user and run directory: the same run fingerprint in
    two work dirs is two runs)."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:20]
    return root / f"lifecycle-{os.getuid()}-{key}"


def claim(tier: Path, pid: int) -> None:
    """Create (or take over) the run's tier for supervisor `pid`."""
    tier.mkdir(mode=0o700, exist_ok=True)
    check_owner(tier)
    tmp = tier / f"{SUPERVISOR}.tmp"
    tmp.write_text(str(pid))
    os.replace(tmp, tier / SUPERVISOR)


def check_owner(tier: Path) -> None:
    """Refuse a tier directory another user owns or can write (its indexes are unpickled)."""
    st = tier.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"memory tier {tier} is not private to uid {os.getuid()} (owner {st.st_uid}, "
                              f"mode {oct(st.st_mode & 0o777)}); remove it")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tiers(root: Path = ROOT) -> set[Path]:
    """This user's tiers under `root`, of every run."""
    return set(root.glob(f"lifecycle-{os.getuid()}-*"))


def release_dead(keep: Path | None = None, root: Path = ROOT, grace_s: float = 60.0,
                 only: set[Path] | None = None) -> list[Path]:
    """Remove this user's tiers whose supervisor is dead (a killed run), except `keep` (the tier a rerun of
    the same run restores from); with `only`, just those of these. A tier without a supervisor file is removed
    once older than `grace_s`."""
    gone = []
    for tier in sorted(tiers(root)):
        if keep is not None and tier == keep or not tier.is_dir() or only is not None and tier not in only:
            continue
        try:
            pid = int((tier / SUPERVISOR).read_text())
            dead = not _alive(pid)
        except (OSError, ValueError):
            try:
                dead = time.time() - tier.stat().st_mtime > grace_s
            except OSError:
                continue
        if dead:
            remove(tier)
            gone.append(tier)
    return gone


def remove(tier: Path) -> None:
    shutil.rmtree(tier, ignore_errors=True)


def committed_step(tier: Path) -> int | None:
    try:
        return int(json.loads((tier / MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def commit(tier: Path, step: int, world_size: int) -> None:
    """Rank 0, after the disk commit of `step` and once every rank indexed it."""
    tmp = tier / f"{MARKER}.tmp"
    tmp.write_text(json.dumps({"step": step, "world_size": world_size}))
    os.replace(tmp, tier / MARKER)


def uncommit(tier: Path) -> None:
    (tier / MARKER).unlink(missing_ok=True)


def rank_dir(tier: Path, rank: int) -> Path:
    return tier / f"rank{rank}"


def index_path(tier: Path, rank: int, step: int) -> Path:
    return rank_dir(tier, rank) / f"step_{step:08d}.idx"


def checksum(buf, start: int, end: int) -> str:
    """CRC-32 of buf[start:end], as 8 hex digits."""
    view = memoryview(buf)
    try:
        return f"{zlib.crc32(view[start:end]):08x}"
    finally:
        view.release()


def read_checked(fd: int, dest, offset: int, want: str) -> bool:
    """Read len(dest) bytes of file `fd` at `offset` into the writable byte buffer `dest`; True when their CRC-32
    is `want`. One pass: each piece is checksummed right after the kernel copied it in. Both calls release the
    GIL, so tensors can be read in parallel threads."""
    view = memoryview(dest).cast("B")
    crc, done, n = 0, 0, len(view)
    try:
        while done < n:
            piece = view[done : min(done + PIECE, n)]
            got = os.preadv(fd, [piece], offset + done)
            if got <= 0:
                return False  # the arena is shorter than its index says
            crc = zlib.crc32(piece[:got], crc)
            done += got
        return f"{crc:08x}" == want
    finally:
        view.release()


def write_index(tier: Path, rank: int, step: int, files: dict[str, tuple[str, Any]],
                ranges: list[tuple[str, int, int, dict[int, str]]]) -> None:
    """files: {path relative to the tag directory: (arena file name, skeleton)}; ranges: (arena file name, start,
    end, {tensor offset: CRC-32}) of every range staged for them."""
    path = index_path(tier, rank, step)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(pickle.dumps({"step": step, "rank": rank, "checksum": CHECKSUM, "files": files, "ranges": ranges},
                                 protocol=pickle.HIGHEST_PROTOCOL))
    os.replace(tmp, path)


def read_index(tier: Path, rank: int, step: int) -> dict:
    return pickle.loads(index_path(tier, rank, step).read_bytes())


def live_arenas(tier: Path, rank: int, own_pid: int) -> set[str]:
    """Names of rank r's arenas made by another live process: a standby world's rank (`train.launch.spares`)
    stages its first checkpoint's arena in the same rank directory while the training world still commits."""
    live = set()
    for p in rank_dir(tier, rank).glob("arena-*-*"):
        try:
            pid = int(p.name.split("-")[1])
        except ValueError:
            continue
        if pid != own_pid and _alive(pid):
            live.add(p.name)
    return live


def prune_rank(tier: Path, rank: int, keep: set[str]) -> None:
    """Delete the files of rank r's directory whose names are not in `keep` (older indexes, arenas of a
    process that died, arenas no index refers to any more)."""
    for p in rank_dir(tier, rank).glob("*"):
        if p.name not in keep:
            p.unlink(missing_ok=True)


def verify_rank(tier: Path, rank: int, step: int, world: int) -> str | None:
    """None when every rank's index of `step` is here and rank r's arenas hold the ranges its index lists; else
    why. The bytes are checked as they are read (`read_checked`)."""
    for r in range(world):
        if not index_path(tier, r, step).is_file():
            return f"no index of rank {r} for step {step} in {tier} on this host"
    try:
        index = read_index(tier, rank, step)
    except Exception as e:  # noqa: BLE001 - a damaged index is a reason to read the disk
        return f"rank {rank}'s index is unreadable ({type(e).__name__}: {e})"
    if index.get("checksum") != CHECKSUM:
        return f"rank {rank}'s index has {index.get('checksum', 'sha256')} checksums, this version checks {CHECKSUM}"
    for name, _start, end, _sums in index["ranges"]:
        try:
            size = (rank_dir(tier, rank) / name).stat().st_size
        except OSError:
            return f"rank {rank}: arena {name} is missing"
        if size < end:
            return f"rank {rank}: arena {name} has {size} bytes, the index needs {end}"
    return None


class TierLoader:
    """A DeepSpeed checkpoint engine for `engine.load_checkpoint` whose `load(path)` returns the state of a file of
    tag directory `tag_dir` from the tier: the skeleton with every tensor read out of the arena into memory of
    its own, its CRC-32 checked on the way (`read_checked`), in up to `threads` threads. A file no
    index lists is read from disk by `base`; so is a file with a tensor whose checksum does not match, after its
    sha256 is checked against the commit marker (`from_disk` says which and why)."""

    def __init__(self, tier: Path, step: int, world: int, tag_dir: Path, base, threads: int = 1):
        self.tier, self.tag_dir, self.base, self.threads = tier, Path(tag_dir), base, max(1, threads)
        self.files: dict[str, tuple[Path, Any]] = {}
        self.sums: dict[tuple[Path, int], str] = {}
        for r in range(world):
            index = read_index(tier, r, step)
            for rel, (name, skeleton) in index["files"].items():
                self.files[rel] = (rank_dir(tier, r) / name, skeleton)
            for name, _start, _end, sums in index["ranges"]:
                self.sums.update({(rank_dir(tier, r) / name, off): crc for off, crc in sums.items()})
        self.fds: dict[Path, int] = {}
        self.from_memory: list[str] = []
        self.from_disk: list[str] = []
        self.last: tuple[str, Any] | None = None

    def _fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def load(self, path, map_location=None):
        import torch

        from lifecycle.tasks.train.arena import map_leaves

        try:
            rel = Path(path).resolve().relative_to(self.tag_dir.resolve()).as_posix()
        except ValueError:
            rel = None
        if rel not in self.files:
            return self.base.load(path, map_location=map_location)
        if self.last is not None and self.last[0] == rel:
            # DeepSpeed loads the model states file twice in a row (SDLoaderFactory's check_ckpt_list reads
            # mp_world_size from a first load, then `load` loads it again): the same tensors, new containers
            return map_leaves(self.last[1], lambda t: t)
        self.last = None  # not held while another file is read (DeepSpeed has copied the module's weights by now)
        state = self._read(*self.files[rel])
        if state is None:
            return self._from_disk(rel, path, map_location)
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        if device is not None and torch.device(device).type != "cpu":
            state = map_leaves(state, lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)
        self.from_memory.append(rel)
        self.last = (rel, state)
        return state

    def _read(self, arena: Path, skeleton: Any) -> Any | None:
        """The state of `skeleton` with every tensor read out of `arena` into memory of its own; None when a
        tensor does not match its checksum."""
        import numpy as np
        import torch

        from lifecycle.tasks.train.arena import Slot, map_leaves

        fd = self._fd(arena)
        jobs: list[tuple[Slot, torch.Tensor]] = []
        def own(s):  # a fresh tensor for a slot (filled below); a copy of anything else the skeleton holds
            if isinstance(s, Slot):
                t = torch.empty(s.numel, dtype=s.dtype)
                jobs.append((s, t))
                return t.view(s.shape)
            return s.copy() if isinstance(s, np.ndarray) else s.clone()
        state = map_leaves(skeleton, own)
        def read(job) -> bool:
            s, t = job
            want = self.sums.get((arena, s.offset))
            return want is not None and read_checked(fd, t.view(torch.uint8).numpy(), s.offset, want)
        if self.threads > 1 and len(jobs) > 1:
            with cf.ThreadPoolExecutor(max_workers=self.threads) as pool:
                ok = all(list(pool.map(read, sorted(jobs, key=lambda j: -j[0].nbytes))))
        else:
            ok = all(read(j) for j in jobs)
        return state if ok else None

    def _from_disk(self, rel: str, path, map_location):
        """The disk copy of `rel`, once its sha256 matches the commit marker."""
        want = {f["path"]: f["sha256"] for f in ckpt.read_marker(self.tag_dir)["files"]}.get(rel)
        if want is None or sha256_file(path) != want:
            raise RuntimeError(f"{rel} of {self.tag_dir}: the memory tier's copy fails its checksum and the disk "
                               f"copy its sha256 (or the marker lists no sha256 for it)")
        self.from_disk.append(f"{rel}: a tensor in the memory tier does not match its checksum")
        return self.base.load(path, map_location=map_location)

    def close(self) -> None:
        # Nothing points into the arenas (every tensor was read into memory of its own): no gc.collect() is
        # needed to free views before an unmap (it walked torch's and DeepSpeed's heap, and took longer than the
        # rest of the restore: docs/benchmarks.md, "Recovery from memory").
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.last = None
