"""A tiny image_preprocess dataset made here: blocky pictures of a colour and a shape with their captions."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image, ImageDraw

from lifecycle.core.dataset import materialize
from lifecycle.tasks.data.images.preprocess.stage import ImagePreprocessConfig, run_image_preprocess

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
