"""Images/s through image_collect, image_dedup and image_scrub against the same work done with the reference
libraries directly, on the bundled corpus (corpus/images/), one process, one core.

    python -m bench.image_throughput

- collect: the stage (tar/Parquet reading, Pillow verify + full load, sha256, pixel hash, imagehash pHash,
  Parquet parts, manifest) against a loop doing Pillow `verify` + `load` + `imagehash.phash` on the same bytes;
- dedup: the stage (hash columns read back, banded index, connected components, rows copied) against
  imagehash's all-pairs Hamming comparison of the same pHashes (`h1 - h2 <= k`);
- scrub: the stage (metadata check, Haar cascade, caption PII, re-encode where needed) against a loop running
  OpenCV's cascade on each image.
"""

from __future__ import annotations

import io
import json
import tempfile
import time

import imagehash
from PIL import Image

from lifecycle.tasks.data.images.collect.stage import ImageCollectConfig, run_image_collect
from lifecycle.tasks.data.images.dedup.stage import ImageDedupConfig, run_image_dedup
from lifecycle.tasks.data.images.filter import stage as image_filter
from lifecycle.tasks.data.images.pixels import on_white
from lifecycle.tasks.data.images.scrub import stage as image_scrub

INPUTS = ["corpus/images/*.tar", "corpus/images/*.parquet"]


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def direct_collect(images: list[bytes]) -> None:
    for data in images:
        Image.open(io.BytesIO(data)).verify()
        im = Image.open(io.BytesIO(data))
        im.load()
        imagehash.phash(on_white(im))


def direct_dedup(images: list[bytes], k: int) -> int:
    hashes = [imagehash.phash(on_white(Image.open(io.BytesIO(d)))) for d in images]
    t = time.perf_counter()
    pairs = sum(1 for i in range(len(hashes)) for j in range(i + 1, len(hashes)) if hashes[i] - hashes[j] <= k)
    return pairs, time.perf_counter() - t


def direct_scrub(images: list[bytes]) -> None:
    import cv2
    import numpy as np

    cascade = image_scrub.cascade()
    for data in images:
        grey = cv2.equalizeHist(np.asarray(on_white(Image.open(io.BytesIO(data))).convert("L")))
        cascade.detectMultiScale(grey, scaleFactor=1.1, minNeighbors=5, minSize=(24, 24))


def main() -> None:
    imagehash.phash(Image.new("RGB", (8, 8)))  # scipy's DCT imported before either side is timed
    with tempfile.TemporaryDirectory() as wd:
        pairs, t_collect = timed(lambda: run_image_collect(ImageCollectConfig(enabled=True, inputs=INPUTS), wd))
        images = pairs.read(columns=["image"]).column("image").to_pylist()
        _, t_direct = timed(lambda: direct_collect(images))
        kept = image_filter.STAGE.run(pairs, image_filter.ImageFilterConfig(), wd)
        unique, t_dedup = timed(lambda: run_image_dedup(kept, ImageDedupConfig(), wd))
        _, t_pairs = direct_dedup(kept.read(columns=["image"]).column("image").to_pylist(), ImageDedupConfig().k)
        image_scrub.cascade()
        _, t_scrub = timed(lambda: image_scrub.STAGE.run(unique, image_scrub.ImageScrubConfig(), wd))
        _, t_scrub_direct = timed(lambda: direct_scrub(unique.read(columns=["image"]).column("image").to_pylist()))
    n, m, u = pairs.num_rows, kept.num_rows, unique.num_rows
    for name, rows, ours, ref in (("collect", n, t_collect, t_direct), ("dedup", m, t_dedup, t_pairs),
                                  ("scrub", u, t_scrub, t_scrub_direct)):
        print(json.dumps({"stage": name, "images": rows, "stage_images_per_s": round(rows / ours),
                          "reference_images_per_s": round(rows / ref)}))


if __name__ == "__main__":
    main()
