"""image_preprocess's resize-and-crop against img2dataset's resizer on the same images (issue 48):
`python -m bench.image_resize [--resolution 64,224] [--reps 5]` (img2dataset in its own venv: bench/make_i2dvenv.sh,
path in I2DVENV, default /tmp/i2dvenv).

The images: every image of the bundled corpus's tar shards (corpus/images/*.tar) that Pillow decodes whole (the
planted damaged ones left out). Ours: `tasks.data.images.preprocess.stage.square` (Pillow: decode, white under
transparency, `ImageOps.fit` bicubic to resolution x resolution, JPEG quality 90). Theirs: img2dataset 1.47.0's
`Resizer(resolution, "center_crop", resize_only_if_bigger=False, encode_quality=90)` (OpenCV decode, alpha over
white, albumentations' SmallestMaxSize with area/lanczos interpolation and CenterCrop, cv2 JPEG), loaded from its
file so that the package's downloader imports stay out. Both in one process on one thread (OpenCV's
`setNumThreads(1)` is the resizer's own), `--reps` passes over the images, images/s of the best pass.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pickle
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from lifecycle.tasks.data.images.preprocess.stage import ImagePreprocessConfig, square

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import importlib.util, io, json, pickle, sys, time
spec = importlib.util.spec_from_file_location("resizer", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
images, resolution, reps = pickle.load(open(sys.argv[2], "rb")), int(sys.argv[3]), int(sys.argv[4])
r = m.Resizer(resolution, "center_crop", False, encode_quality=90, encode_format="jpg")
best = float("inf")
for _ in range(reps):
    t = time.perf_counter()
    for data in images:
        out = r(io.BytesIO(data))
        if out[-1] is not None:
            raise SystemExit(f"img2dataset's resizer refused an image: {out[-1]}")
    best = min(best, time.perf_counter() - t)
print(json.dumps({"images_per_s": len(images) / best}))
"""


def corpus_images() -> list[bytes]:
    """The corpus's tar images that Pillow decodes and `square` takes (the planted damaged files left out)."""
    out = []
    for path in sorted(glob.glob(str(ROOT / "corpus" / "images" / "*.tar"))):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.rsplit(".", 1)[-1].lower() in ("jpg", "jpeg", "png", "webp"):
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    try:
                        square(data, ImagePreprocessConfig())
                    except Exception:  # noqa: BLE001  (a damaged file: image_collect quarantines it)
                        continue
                    out.append(data)
    return out


def ours(images: list[bytes], resolution: int, reps: int) -> float:
    cfg, best = ImagePreprocessConfig(resolution=resolution), float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for data in images:
            square(data, cfg)
        best = min(best, time.perf_counter() - t)
    return len(images) / best


def theirs(images: list[bytes], resolution: int, reps: int, venv: str) -> float:
    resizer = glob.glob(f"{venv}/lib/python3*/site-packages/img2dataset/resizer.py")
    if not resizer:
        raise SystemExit(f"no img2dataset in {venv}: run bench/make_i2dvenv.sh {venv}")
    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:
        pickle.dump(images, f)
        f.flush()
        done = subprocess.run([f"{venv}/bin/python", "-c", CHILD, resizer[0], f.name, str(resolution), str(reps)],
                              capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(done.stdout.strip().splitlines()[-1])["images_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--resolution", default="64,224")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    venv = os.environ.get("I2DVENV", "/tmp/i2dvenv")
    images = corpus_images()
    print(f"{len(images)} images of corpus/images/*.tar, one thread, best of {a.reps} passes")
    for resolution in map(int, a.resolution.split(",")):
        mine, other = ours(images, resolution, a.reps), theirs(images, resolution, a.reps, venv)
        print(json.dumps({"resolution": resolution, "ours_images_per_s": round(mine, 1),
                          "img2dataset_images_per_s": round(other, 1), "ratio": round(mine / other, 3)}))


if __name__ == "__main__":
    main()
