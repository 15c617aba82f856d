"""The image path's model package as a registered MLflow model version (a real SQLite store): tagged with its
digests, the datasets it came from and its retrieval metrics, and found again by a rerun instead of registered
twice."""

from __future__ import annotations

from pydantic import BaseModel

from lifecycle.core.dataset import materialize
from lifecycle.lineage.registry import WEIGHTS_TAG, Registry
from lifecycle.lineage.tracking import Tracker, TrackingConfig


class Cfg(BaseModel):
    workdir: str


def package(wd, weights: bytes):
    def shards(w):
        w.path("index.parquet").write_bytes(b"index")
        w.add_file("index.parquet")
        return {}

    def model(w):
        for name, data in (("model.safetensors", weights), ("model_config.json", b"{}"), ("tokenizer.json", b"{}")):
            w.path(name).write_bytes(data)
            w.add_file(name)
        return {"num_rows": 0}

    parent = materialize(wd, "image_preprocess", {"t": 1}, "test", shards)
    return parent, materialize(wd, "clip_train", {"w": weights.hex()}, "test", model, parents=[parent])


def test_a_clip_package_is_registered_once_with_its_lineage(tmp_path):
    shards, model = package(tmp_path, b"weights-1")
    tracker = Tracker(TrackingConfig(model_name="clip"), str(tmp_path), "exp")
    tracker.start("run", Cfg(workdir=str(tmp_path)), {"prefect.flow_run_id": "fr-1"})
    registry = Registry(tracker)
    name, version = registry.register_package(model, {"heldout_i2t_recall_at_1": 0.25, "note": "x"}, "clip")
    mv = registry.client.get_model_version(name, version)
    assert mv.tags["lifecycle.model_kind"] == "clip" and mv.tags["lifecycle.model_package_sha256"] == model.sha256
    assert mv.tags["lifecycle.dataset.image_preprocess.sha256"] == shards.sha256 and WEIGHTS_TAG in mv.tags
    assert mv.tags["metric.heldout_i2t_recall_at_1"] == "0.25" and "metric.note" not in mv.tags
    assert registry.register_package(model, {}, "clip") == (name, version)
    _, other = package(tmp_path / "b", b"weights-2")
    assert registry.register_package(other, {}, "clip") == (name, str(int(version) + 1))
    tracker.end("FINISHED")
