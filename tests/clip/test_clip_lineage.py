"""Lineage and forgetting of an image on the clip demo's outputs: `lifecycle lineage doc IMAGE_ID` names the raw
file, each image stage that kept it or the reason it was dropped, the preprocessed shard and the registered dual
encoders that trained on it (or held it out); `lifecycle forget IMAGE_ID` tombstones it (no caption, no pixels in
the ledger), names the versions that hold it, and the next run rejects it and its near copies at image_collect as
`forgotten` and registers a version that never saw it. The forgetting tests run last: they change the work dir."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lifecycle.core.dataset import DatasetRef
from lifecycle.tasks.clip.config import held_out
from tests.clip.conftest import CLIP_DEMO, demo_sets
from tests.conftest import last_json, lifecycle

pytestmark = pytest.mark.e2e
IMAGE_STAGES = ["image_collect", "image_filter", "image_dedup", "image_scrub"]


def doc(wd: Path, ident: str, rc: int = 0) -> dict:
    return last_json(lifecycle("lineage", "doc", ident, "--workdir", wd, "--json", rc=rc).stdout)


def dataset(summary: dict, stage: str) -> DatasetRef:
    return DatasetRef.from_dir(Path(summary["datasets"][stage]).parent)


def first_run(r: dict, summary: dict) -> list[dict]:
    """The events of the demo's own datasets (a later run in the same work dir adds its own)."""
    shas = {dataset(summary, s).sha256 for s in [*IMAGE_STAGES, "image_preprocess"]}
    return [e for e in r["events"] if e["dataset_sha256"] in shas]


def index_rows(summary: dict) -> list[dict]:
    return pq.read_table(dataset(summary, "image_preprocess").dir / "index.parquet",
                         columns=["image_id", "source_id", "shard"]).to_pylist()


def test_a_trained_image_is_followed_from_its_raw_file_to_the_model(clip_demo):
    wd, summary = clip_demo
    version = summary["model"]
    row = next(r for r in index_rows(summary) if not held_out(r["image_id"], 0.1))
    r = doc(wd, row["image_id"])
    assert r["kind"] == "image" and r["image_ids"] == [row["image_id"]]
    (raw,) = r["raw_files"]
    assert row["source_id"].startswith(raw["path"] + ":") and len(raw["sha256"]) == 64
    events = first_run(r, summary)
    assert [(e["stage"], e["outcome"]) for e in events] == [(s, "kept") for s in IMAGE_STAGES] + [
        ("image_preprocess", "preprocessed")]
    assert events[-1]["shard"] == row["shard"] and events[0]["source"] == raw["path"]
    assert {"name": version["name"], "version": int(version["version"])}.items() <= r["trained_by"][0].items()
    assert r["evaluated_by"] == []
    report = last_json(lifecycle("lineage", "forget", row["image_id"], "--workdir", wd, "--json").stdout)
    assert report["not_found"] == [] and report["images"][0]["image_ids"] == [row["image_id"]]
    assert [m["version"] for m in report["model_versions"]] == [int(version["version"])]


def test_a_held_out_image_is_named_as_evaluated_not_trained_on(clip_demo):
    wd, summary = clip_demo
    row = next(r for r in index_rows(summary) if held_out(r["image_id"], 0.1))
    r = doc(wd, row["image_id"])
    assert r["trained_by"] == [] and [m["version"] for m in r["evaluated_by"]] == [int(summary["model"]["version"])]


def test_dropped_images_say_where_and_why_and_fed_no_model(clip_demo):
    wd, summary = clip_demo
    dup = next(r for r in dataset(summary, "image_dedup").read_rejected().to_pylist())
    r = doc(wd, dup["doc_id"])
    last = first_run(r, summary)[-1]
    assert (last["stage"], last["outcome"], last["duplicate_of"]) == ("image_dedup", "rejected", dup["duplicate_of"])
    assert r["trained_by"] == r["evaluated_by"] == []
    quarantined = {q["source_id"]: q for q in dataset(summary, "image_collect").read_rejected().to_pylist()}
    truncated = next(q for q in quarantined.values() if q["reason"] == "truncated")
    (e,) = first_run(doc(wd, truncated["doc_id"]), summary)
    assert (e["stage"], e["outcome"], e["reason"]) == ("image_collect", "rejected", "truncated")
    tiny = doc(wd, "corpus/images/planted-damaged.tar:filter-tiny")  # by source_id
    assert [(e["stage"], e["outcome"], e.get("reason")) for e in first_run(tiny, summary)] == [
        ("image_collect", "kept", None), ("image_filter", "rejected", "too_small")]
    assert doc(wd, "no-such-image", rc=3)["events"] == []


@pytest.fixture(scope="module")
def forgotten(clip_demo):
    """A trained image with near copies in the corpus, forgotten; then the demo run again."""
    wd, summary = clip_demo
    dups = dataset(summary, "image_dedup").read_rejected().to_pylist()
    trained = {r["image_id"] for r in index_rows(summary) if not held_out(r["image_id"], 0.1)}
    target = next(d["duplicate_of"] for d in dups if d["duplicate_of"] in trained)
    refused = lifecycle("forget", target, "--reason", "erasure request 12", "--unlearn", "--workdir", wd, rc=2)
    fg = lifecycle("forget", target, "--reason", "erasure request 12", "--json", "--config", CLIP_DEMO, *demo_sets(wd))
    rerun = last_json(lifecycle("run", CLIP_DEMO, "--json", *demo_sets(wd)).stdout)
    near = [d["doc_id"] for d in dups  # within the radius of the target itself (a cluster also grows through others)
            if d["duplicate_of"] == target and int(d["detail"].rsplit("hamming=", 1)[1]) <= 8]
    return {"wd": wd, "first": summary, "target": target, "copies": near,
            "refused": refused.stderr, "forget": last_json(fg.stdout), "rerun": rerun}


def test_forget_records_hashes_only_and_names_the_models_holding_the_image(forgotten):
    out, first = forgotten["forget"], forgotten["first"]
    assert "--unlearn is for the text path" in forgotten["refused"]
    (t,) = out["tombstones"]
    assert out["status"] == "recorded" and t["doc_id"] == forgotten["target"] and t["reason"] == "erasure request 12"
    assert out["tainted_versions"] == [f"{first['model']['name']}/{first['model']['version']}"]
    caption = next(r["caption"] for r in dataset(first, "image_collect").read(["image_id", "caption"]).to_pylist()
                   if r["image_id"] == forgotten["target"])
    ledger = (forgotten["wd"] / "image_tombstones.parquet").read_bytes()
    assert caption.encode() not in ledger and set(pq.read_schema(forgotten["wd"] / "image_tombstones.parquet").names
                                                  ) >= {"pixel_sha256", "phash", "k"}


def test_the_next_run_drops_the_image_and_its_near_copies_and_trains_without_it(forgotten):
    rerun, first = forgotten["rerun"], forgotten["first"]
    collect = dataset(rerun, "image_collect")
    assert collect.sha256 != dataset(first, "image_collect").sha256  # the ledger is in the fingerprint
    rej = {r["doc_id"]: r for r in collect.read_rejected().to_pylist() if r["reason"] == "forgotten"}
    assert "exact copy" in rej[forgotten["target"]]["detail"]
    assert forgotten["copies"] and set(forgotten["copies"]) <= set(rej)  # the planted variants too
    assert int(rerun["model"]["version"]) == int(first["model"]["version"]) + 1
    r = doc(forgotten["wd"], forgotten["target"])
    now = [e for e in r["events"] if e["dataset_sha256"] == collect.sha256]
    assert [(e["outcome"], e["reason"]) for e in now] == [("rejected", "forgotten")]
    assert [m["version"] for m in r["trained_by"]] == [int(first["model"]["version"])]  # the old version only
