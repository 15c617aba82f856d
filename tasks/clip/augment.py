"""Decoding and augmentation of one batch, the part of loading that costs CPU: run in the loader's worker
processes (lifecycle.tasks.clip.loader), so it imports neither torch nor the project's heavier modules.

Each image's crop is drawn from `numpy.random.default_rng([seed, step, rank, j])`, so a batch is a function of
its coordinates only: a resumed run, or any number of workers, decodes the same pixels."""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

# CLIP's normalisation (openai/CLIP clip/clip.py `_transform`)
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def crop_box(w: int, h: int, scale: tuple[float, float], seed: tuple[int, ...] | None) -> tuple[float, ...]:
    """The random resized crop of a w x h image, (x0, y0, x1, y1) in pixels: a square keeping a fraction of the
    area drawn from `scale`, placed uniformly, all from `seed`; the whole image when scale is (1, 1). Both loader
    backends crop here (the DALI one passes the box to `fn.resize` as its region of interest)."""
    if scale[0] >= 1.0:
        return (0.0, 0.0, float(w), float(h))
    rng = np.random.default_rng(seed)
    side = math.sqrt(rng.uniform(*scale)) * min(w, h)
    x0, y0 = rng.uniform(0, w - side), rng.uniform(0, h - side)
    return (x0, y0, x0 + side, y0 + side)


def decode(data: bytes, size: int, scale: tuple[float, float] = (1.0, 1.0),
           seed: tuple[int, ...] | None = None) -> np.ndarray:
    """One JPEG as a normalised float32 (3, size, size) array: a random square crop keeping a fraction of the
    area drawn from `scale` (from `seed`; the whole image when scale is (1, 1)), resized bicubic to `size`."""
    im = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = im.size
    box = crop_box(w, h, scale, seed)
    if box != (0.0, 0.0, float(w), float(h)) or (w, h) != (size, size):
        im = im.resize((size, size), Image.Resampling.BICUBIC, box=box)
    a = (np.asarray(im, dtype=np.float32) / 255.0 - MEAN) / STD
    return np.ascontiguousarray(a.transpose(2, 0, 1))


def decode_batch(job: tuple[list[bytes], int, tuple[float, float], tuple[int, int, int]]) -> np.ndarray:
    """(encoded images, size, crop scale, (seed, step, rank)) -> (n, 3, size, size) float32."""
    blobs, size, scale, (seed, step, rank) = job
    return np.stack([decode(b, size, scale, (seed, step, rank, j)) for j, b in enumerate(blobs)])
