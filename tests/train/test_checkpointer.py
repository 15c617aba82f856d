"""The sync and async checkpointers are interchangeable: on one tiny DeepSpeed engine (a single CPU rank in this
process) they write the same files (the consolidated weights byte for byte, DeepSpeed's state files with the same
contents) and the same commit markers, prune alike, and each restores the other's checkpoints."""

import os
import pickle
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from lifecycle.core.dataset import sha256_file
from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train import memtier
from lifecycle.tasks.train.checkpointer import AsyncCheckpointer, SyncCheckpointer, make_checkpointer
from lifecycle.tasks.train.config import CheckpointConfig, ModelConfig, TrainConfig
from lifecycle.tasks.train.model import GPT

TINY = ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=32, seq_len=16)
CFG = TrainConfig(model=TINY, batch={"micro_batch_size": 2, "num_ranks": 1}, engine={"zero_stage": 2})


@pytest.fixture(scope="module")
def engine():
    """A ZeRO-2 engine over one gloo rank, trained a few steps so that its optimizer state is not empty."""
    import deepspeed
    import torch.distributed as dist

    from lifecycle.tasks.train.engine import ds_config, stub_muon

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    stub_muon()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=ds_config(CFG))
    for _ in range(2):
        step(engine)
    yield engine
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def step(engine) -> None:
    x = torch.randint(0, 64, (2, 16))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()


def save_three(checkpointer, root: Path) -> dict[int, dict]:
    """Commits at steps 1, 2, 3 (keep_last=2), the same state each time; returns the markers left."""
    for s in (1, 2, 3):
        checkpointer.save(s, {"step": s, "sampler": {"next_step": s}, "rng": np.random.get_state()}, TINY,
                          {"loss": 0.5, "fingerprint": "f"},
                          wait=s == 3)
        checkpointer.poll()
    checkpointer.close()
    return {s: ckpt.read_marker(p) for s, p in ckpt.list_committed(root)}


def files(tag_dir: Path) -> dict[str, str]:
    return {p.relative_to(tag_dir).as_posix(): sha256_file(p) for p in sorted(tag_dir.rglob("*")) if p.is_file()}


def assert_same_state(x, y, path: str = "") -> None:
    """Equal values, tensor by tensor (dtype, shape, elements); objects without an __eq__ by their attributes."""
    assert type(x) is type(y), path
    if isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), path
    elif isinstance(x, np.ndarray):
        assert x.dtype == y.dtype and np.array_equal(x, y), path
    elif isinstance(x, dict):
        assert list(x) == list(y), path
        for k in x:
            assert_same_state(x[k], y[k], f"{path}/{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), path
        for i, (u, v) in enumerate(zip(x, y)):
            assert_same_state(u, v, f"{path}[{i}]")
    elif type(x).__eq__ is object.__eq__ and hasattr(x, "__dict__"):
        assert_same_state(vars(x), vars(y), path)
    else:
        assert x == y, path


def weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def test_sync_and_async_write_the_same_checkpoints_and_restore_each_other(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.time, "strftime", lambda *a: "2026-01-01T00:00:00Z")  # the marker's only clock field
    sync_root, async_root = tmp_path / "sync", tmp_path / "async"
    sync = make_checkpointer(CheckpointConfig(async_save=False, keep_last=2), engine, sync_root, log=lambda m: None)
    assert type(sync) is SyncCheckpointer
    sync_markers = save_three(sync, sync_root)  # first: the async one swaps the engine's checkpoint engine
    base_engine = engine.checkpoint_engine
    asyn = make_checkpointer(CheckpointConfig(async_save=True, keep_last=2), engine, async_root, log=lambda m: None)
    assert type(asyn) is AsyncCheckpointer and engine.checkpoint_engine is not base_engine
    async_markers = save_three(asyn, async_root)
    assert engine.checkpoint_engine is base_engine  # close() gives the engine its own checkpoint engine back

    assert sorted(sync_markers) == sorted(async_markers) == [2, 3]  # both pruned step 1
    for s in (2, 3):
        a, b = sync_root / ckpt.tag_name(s), async_root / ckpt.tag_name(s)
        assert ckpt.verify(a) is None and ckpt.verify(b) is None
        fa, fb = files(a), files(b)
        assert sorted(fa) == sorted(fb)  # the same files
        for name in (ckpt.WEIGHTS, ckpt.MODEL_CONFIG):  # what evaluate and export read: byte for byte
            assert fa[name] == fb[name]
        # DeepSpeed's pickles: torch.save through the persist process's writer names the zip archive `archive/`
        # and gives each tensor its own storage, so their bytes differ; what they load as does not
        for name in fa:
            if name.endswith(".pt"):
                assert_same_state(torch.load(a / name, weights_only=False), torch.load(b / name, weights_only=False))
        ma, mb = (sync_markers[s], async_markers[s])
        assert [f["path"] for f in ma["files"]] == [f["path"] for f in mb["files"]]
        assert {k: v for k, v in ma.items() if k != "files"} == {k: v for k, v in mb.items() if k != "files"}
        same = {f["path"] for f in ma["files"]} - {n for n in fa if n.endswith(".pt")}
        assert [f for f in ma["files"] if f["path"] in same] == [f for f in mb["files"] if f["path"] in same]
    names = {f["path"] for f in sync_markers[3]["files"]}
    assert {"model.safetensors", "model_config.json", "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= names
    assert sync_markers[3]["loss"] == 0.5 and sync_markers[3]["fingerprint"] == "f"

    # each restores what the other wrote: the weights saved at step 3, and the client_state
    saved = weights(engine)
    for root, kind in ((async_root, SyncCheckpointer), (sync_root, AsyncCheckpointer)):
        step(engine)  # move away from the saved weights
        assert any(not torch.equal(saved[k], v) for k, v in weights(engine).items())
        reader = kind(engine, root, keep_last=2, log=lambda m: None)
        try:
            tag_dir, state = reader.restore(max_step=10)
            assert tag_dir == root / ckpt.tag_name(3) and state["step"] == 3 and state["sampler"] == {"next_step": 3}
            assert state["rng"][0] == "MT19937" and isinstance(state["rng"][1], np.ndarray)
            assert all(torch.equal(saved[k], v) for k, v in weights(engine).items())
            assert reader.restore(max_step=2)[1]["step"] == 2  # max_step: the newest commit at or below it
        finally:
            reader.close()
    empty = SyncCheckpointer(engine, tmp_path / "none", keep_last=2)
    assert empty.restore() is None


def test_memory_tier_restores_the_newest_commit_from_memory_and_falls_back_to_disk(engine, tmp_path):
    """The async saver's staging arenas are the memory tier: a new checkpointer (a relaunched rank) restores the
    newest commit from them, state for state what the disk copy loads as; a tier older than the newest
    commit, or with one flipped byte, is skipped for the disk, saying why."""
    root, tier = tmp_path / "ckpt", tmp_path / "tier"
    writer = make_checkpointer(CheckpointConfig(keep_last=2), engine, root, log=lambda m: None, tier=tier)
    save_three(writer, root)
    assert memtier.committed_step(tier) == 3
    arenas = sorted(p.name for p in (tier / "rank0").glob("arena-*"))
    assert 1 <= len(arenas) <= 2  # two slots at most: the committed checkpoint and the one being saved
    saved = weights(engine)
    disk_state = torch.load(root / ckpt.tag_name(3) / "mp_rank_00_model_states.pt", weights_only=False)

    def restore(max_step=10):
        step(engine)  # move away from the saved weights
        reader = AsyncCheckpointer(engine, root, keep_last=2, log=lambda m: None, tier=tier)
        try:
            got = reader.restore(max_step=max_step)
            return got, reader.last_restore
        finally:
            reader.close()

    (tag_dir, state), info = restore()
    assert info["tier"] == "memory" and info["reason"] is None and tag_dir == root / ckpt.tag_name(3)
    assert state["step"] == 3 and all(torch.equal(saved[k], v) for k, v in weights(engine).items())
    assert_same_state({k: v for k, v in state.items()}, {k: v for k, v in disk_state.items() if k in state})

    (_, state), info = restore(max_step=2)  # the tier holds step 3, the newest commit at or below 2 is step 2
    assert info["tier"] == "disk" and "memory holds step 3" in info["reason"] and state["step"] == 2

    index = memtier.read_index(tier, 0, 3)
    older = memtier.index_path(tier, 0, 3)
    good = older.read_bytes()
    older.write_bytes(pickle.dumps({k: v for k, v in index.items() if k != "checksum"}))  # a sha256-era index
    (tag_dir, _), info = restore()
    assert info["tier"] == "disk" and "has sha256 checksums, this version checks crc32-tensor" in info["reason"], info
    older.write_bytes(good)

    arena = max((tier / "rank0").glob("arena-*"), key=lambda p: p.stat().st_mtime)
    name, start, end, _ = index["ranges"][0]
    with open(tier / "rank0" / name, "r+b") as f:  # flip one staged byte of step 3
        f.seek((start + end) // 2)
        b = f.read(1)
        f.seek((start + end) // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    flipped = next(rel for rel, (arena_name, _) in index["files"].items() if arena_name == name)
    (tag_dir, state), info = restore()  # that file is read from its disk copy, the others from memory
    assert info["tier"] in ("memory+disk", "disk") and f"{flipped}: a tensor in the memory tier does not match its " \
        "checksum" in info["reason"], info
    assert tag_dir == root / ckpt.tag_name(3) and all(torch.equal(saved[k], v) for k, v in weights(engine).items())
    assert_same_state({k: v for k, v in state.items()}, {k: v for k, v in disk_state.items() if k in state})
    assert arena.exists()
    assert memtier.committed_step(tier) is None  # the damaged tier is not offered again
    (_, _), info = restore()
    assert info["tier"] == "disk" and "no committed snapshot" in info["reason"]


def test_dead_runs_tiers_are_released_live_and_kept_ones_stay(tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    tiers = {name: memtier.path_for(tmp_path / name, root=tmp_path) for name in "abcd"}
    memtier.claim(tiers["a"], dead.pid)  # its supervisor is gone
    memtier.claim(tiers["b"], os.getpid())  # alive
    memtier.claim(tiers["c"], dead.pid)  # dead, but the tier of the run being launched
    tiers["d"].mkdir()  # no supervisor file, young: being created
    assert memtier.release_dead(keep=tiers["c"], root=tmp_path) == [tiers["a"]]
    assert not tiers["a"].exists() and tiers["b"].is_dir() and tiers["c"].is_dir() and tiers["d"].is_dir()
    os.utime(tiers["d"], (0, 0))
    assert memtier.release_dead(keep=tiers["c"], root=tmp_path) == [tiers["d"]]
    assert memtier.release_dead(root=tmp_path, only={tiers["b"]}) == []  # `only`: just these (b is alive)
    assert memtier.release_dead(root=tmp_path, only={tiers["b"], tiers["c"]}) == [tiers["c"]]
    tiers["b"].chmod(0o777)
    with pytest.raises(PermissionError, match="not private"):
        memtier.claim(tiers["b"], os.getpid())


def test_a_standby_makes_its_arena_early_only_when_the_host_has_room(engine, tmp_path, monkeypatch):
    """`prewarm(memory_share=...)`: a standby world (train.launch.spares) makes the first save's arena before its
    promotion only if it takes at most that share of MemAvailable; otherwise nothing is allocated, the line says
    so, and a later plain `prewarm` makes it."""
    from lifecycle.tasks.train import async_saver

    base = engine.checkpoint_engine
    checkpointer = AsyncCheckpointer(engine, tmp_path / "checkpoints", keep_last=2)
    try:
        monkeypatch.setattr(async_saver, "mem_available", lambda: 1000)  # a host with 1 kB to spare
        line = checkpointer.prewarm(tmp_path / "sizing-spare1", memory_share=0.25)
        assert not checkpointer.prewarmed and "not made before training" in line and "25%" in line
        assert checkpointer.saver.writer.arena is None and not (tmp_path / "sizing-spare1").exists()
        monkeypatch.setattr(async_saver, "mem_available", lambda: 1 << 40)
        line = checkpointer.prewarm(tmp_path / "sizing-spare1", memory_share=0.25)
        assert checkpointer.prewarmed and "made and faulted in" in line and checkpointer.saver.writer.arena is not None
    finally:
        checkpointer.close()
        engine.checkpoint_engine = base
