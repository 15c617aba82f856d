"""A tiny image_preprocess dataset made here (blocky pictures of a colour and a shape with their captions), and one
real run of the clip demo for the tests that need its outputs (export, lineage, forgetting)."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image, ImageDraw

from lifecycle.core.dataset import materialize
from lifecycle.tasks.data.images.preprocess.stage import ImagePreprocessConfig, run_image_preprocess
from tests.conftest import ROOT, last_json, lifecycle

CLIP_DEMO = ROOT / "deploy/configs/clip-demo.yaml"
DEMO_STEPS = ["clip_train.steps=10", "clip_train.save_every=10", "clip_train.workers=0"]  # the demo, shorter

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle", "bar")


def drawing(colour: str, shape: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    im = Image.new("RGB", (40, 40), (255, 255, 255))
    d = ImageDraw.Draw(im)
    x, y = (int(v) for v in rng.integers(2, 10, 2))
    box = {"square": (x, y, x + 26, y + 26), "circle": (x, y, x + 28, y + 28), "bar": (x, y + 10, x + 28, y + 18)}
    (d.ellipse if shape == "circle" else d.rectangle)(box[shape], fill=COLOURS[colour])
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    wd = tmp_path_factory.mktemp("clip")
    rows = [{"image_id": f"{c}-{s}-{k}", "source_id": "test", "caption": f"a {c} {s}", "image": drawing(c, s, k)}
            for c in COLOURS for s in SHAPES for k in range(4)]

    def build(w):
        w.write_table(pa.Table.from_pylist(rows))
        return {}

    parent = materialize(wd, "image_scrub", {"test": 1}, "test", build)
    return run_image_preprocess(parent, ImagePreprocessConfig(resolution=16, vocab_size=300, images_per_shard=20),
                                str(wd))


def demo_sets(wd) -> list[str]:
    return [a for s in [f"workdir={wd}", *DEMO_STEPS] for a in ("--set", s)]


@pytest.fixture(scope="session")
def clip_demo(tmp_path_factory):
    """`lifecycle run deploy/configs/clip-demo.yaml` (10 training steps) in a work dir of its own, once per session:
    (work dir, the run's JSON summary). Tests that change the work dir (forgetting) copy it first."""
    wd = tmp_path_factory.mktemp("clip-demo")
    summary = last_json(lifecycle("run", CLIP_DEMO, "--json", *demo_sets(wd)).stdout)
    assert summary["model"]["version"], json.dumps(summary)[:2000]
    return wd, summary
