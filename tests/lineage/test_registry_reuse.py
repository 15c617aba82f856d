"""A package rebuilt from a repaired checkpoint with bitwise identical weights reuses its registered version
(issue 44, 6: 8c6205f registered versions 2 and 3 for the same weights, because the commit marker differed)."""

import json

from lifecycle.core.dataset import materialize
from lifecycle.lineage.registry import WEIGHTS_TAG, Registry
from tests.lineage.test_tracking import Cfg, tracker


def _package(wd, weights: bytes, marker: str):
    def build(writer):
        for name, data in (("model.safetensors", weights), ("model_config.json", b'{"n_layer": 2}'),
                           ("tokenizer.json", b'{"model": {}}'), ("commit.json", marker.encode())):
            writer.path(name).write_bytes(data)
            writer.add_file(name)
        writer.path("lineage.json").write_text(json.dumps({"checkpoint_dir": f"/ckpt/{marker}", "checkpoint_step": 8,
                                                           "checkpoint_marker_sha256": marker, "datasets": []}))
        writer.add_file("lineage.json")
        return {"num_rows": 0}

    return materialize(wd, "checkpoint", {"marker": marker}, "code-1", build)


def test_identical_weights_reuse_their_version(tmp_path):
    registry = Registry(tracker(tmp_path, Cfg(workdir=str(tmp_path))))
    first = _package(tmp_path, b"weights", "marker-a")
    repaired = _package(tmp_path, b"weights", "marker-b")  # same weights, another commit marker: another package
    other = _package(tmp_path, b"other weights", "marker-c")
    assert first.sha256 != repaired.sha256
    name, v1 = registry.register_or_reuse(first, {"val_bpb": 2.0}, "e" * 64)
    assert registry.register_or_reuse(repaired, {"val_bpb": 2.0}, "e" * 64) == (name, v1)
    assert registry.register_or_reuse(first, {"val_bpb": 2.0}, "e" * 64) == (name, v1)
    _, v2 = registry.register_or_reuse(other, {"val_bpb": 1.5}, "e" * 64)
    assert (v1, v2) == ("1", "2")
    tags = registry.client.get_model_version(name, v1).tags
    assert tags[WEIGHTS_TAG] != registry.client.get_model_version(name, v2).tags[WEIGHTS_TAG]
