import collections

import numpy as np
import pytest
import torch

from tasks.async_ckpt import persist, snapshot


def test_snapshot_shares_no_memory_with_the_live_state():
    live = {"module": collections.OrderedDict(w=torch.ones(3)), "opt": {"state": {0: {"exp_avg": torch.zeros(2)}},
            "groups": [{"lr": 0.1, "params": [0]}]}, "rng": ("MT19937", np.arange(4), 1), "step": 7}
    snap = snapshot(live)
    live["module"]["w"].add_(1)  # training goes on after the snapshot
    live["opt"]["state"][0]["exp_avg"].fill_(5)
    live["rng"][1][:] = 9
    live["opt"]["groups"][0]["lr"] = 0.2
    assert torch.equal(snap["module"]["w"], torch.ones(3)) and isinstance(snap["module"], collections.OrderedDict)
    assert torch.equal(snap["opt"]["state"][0]["exp_avg"], torch.zeros(2))
    assert snap["rng"][1].tolist() == [0, 1, 2, 3] and snap["opt"]["groups"][0]["lr"] == 0.1 and snap["step"] == 7


def test_persist_is_atomic_and_loadable(tmp_path, monkeypatch):
    path = tmp_path / "states.pt"
    persist({"w": torch.arange(5)}, str(path), zipfile=True)
    assert torch.equal(torch.load(path)["w"], torch.arange(5)) and not list(tmp_path.glob("*.tmp"))

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        persist({"w": torch.zeros(5)}, str(path), zipfile=True)
    assert torch.equal(torch.load(path)["w"], torch.arange(5))  # the old file is untouched, never half-written
    assert not list(tmp_path.glob("*.tmp"))
