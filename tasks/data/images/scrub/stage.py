"""Image privacy scrub: strip EXIF, XMP and GPS from the kept bytes (checked by reading the result back), blur
faces found by OpenCV's Haar cascade (the `haarcascade_frontalface_default.xml` that ships inside
opencv-python-headless, `cv2.data.haarcascades`), and replace PII in captions with the text path's detectors
(tasks/data/scrub/stage.py `scrub_text`, `caption:` is a full `scrub:` section).

An image is re-encoded only when it carries metadata or a face (same format; JPEG with Pillow's
`quality="keep"`, its own quantisation tables); others keep their bytes. `sha256` stays the collected bytes' hash
(the key back to the raw image); `scrubbed_sha256` is the hash of the bytes now kept. Counts per kind go into the
stats: exif, gps, xmp (images that carried it), faces (found and blurred), images_with_faces, caption_pii_<type>.
Kept rows gain int32 `faces` and `caption_pii`. Nothing is rejected.
"""

from __future__ import annotations

import hashlib
import io
from collections import Counter
from functools import lru_cache

import numpy as np
import pyarrow as pa
from PIL import Image, ImageFilter
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core.dataset import StageStats, rejected_table
from lifecycle.core.shards import PerFileStage, map_tables
from lifecycle.tasks.data.images.pixels import on_white
from lifecycle.tasks.data.scrub.stage import ScrubConfig, scrub_text

NAME = "image_scrub"
GPS_IFD = 0x8825


class ImageScrubConfig(BaseModel):
    """What image_scrub removes."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    strip_metadata: bool = True
    """Remove EXIF (GPS included) and XMP from every kept image; the result is read back to check."""
    blur_faces: bool = True
    """Blur every face the Haar cascade finds (Gaussian blur over the face box)."""
    min_face: int = Field(24, ge=8)
    """Smallest face side in pixels the cascade looks for."""
    min_neighbors: int = Field(5, ge=1)
    """Haar cascade `minNeighbors`: higher finds fewer faces and fewer false ones (OpenCV's samples use 5)."""
    blur_radius: float = Field(0.2, gt=0)
    """Gaussian blur radius over a face box, as a share of the box's side (0.2: the cascade no longer finds the
    blurred face; tests/data/images/test_image_stages.py checks it on a real photograph)."""
    caption: ScrubConfig = ScrubConfig()
    """The text path's scrub applied to captions (every field as in `scrub:`)."""


@lru_cache(maxsize=1)
def cascade():
    import cv2

    path = cv2.data.haarcascades + "haarcascade_frontalface_default.xml"
    found = cv2.CascadeClassifier(path)
    if found.empty():
        raise RuntimeError(f"{NAME}: OpenCV could not load its face cascade {path}")
    return found


def find_faces(im: Image.Image, cfg: ImageScrubConfig) -> list[tuple[int, int, int, int]]:
    """(x, y, w, h) of every frontal face the cascade finds."""
    import cv2

    grey = cv2.equalizeHist(np.asarray(on_white(im).convert("L")))
    boxes = cascade().detectMultiScale(grey, scaleFactor=1.1, minNeighbors=cfg.min_neighbors,
                                       minSize=(cfg.min_face, cfg.min_face))
    return [tuple(int(v) for v in b) for b in boxes]


def metadata_kinds(im: Image.Image) -> set[str]:
    """Which private metadata the image carries: exif, gps, xmp."""
    kinds = set()
    exif = im.getexif()
    if len(exif):
        kinds.add("exif")
        if exif.get_ifd(GPS_IFD):
            kinds.add("gps")
    if "xmp" in im.info or "XML:com.adobe.xmp" in im.info:
        kinds.add("xmp")
    return kinds


def _encode(im: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    if fmt == "JPEG":
        im.save(buf, "JPEG", quality="keep" if getattr(im, "quantization", None) else 90)
    else:
        im.save(buf, fmt)  # Pillow writes no EXIF/XMP unless asked
    return buf.getvalue()


def scrub_image(data: bytes, cfg: ImageScrubConfig) -> tuple[bytes, Counter]:
    """(bytes to keep, counts: exif/gps/xmp/faces) of one encoded image."""
    im = Image.open(io.BytesIO(data))
    fmt = im.format
    counts: Counter = Counter(metadata_kinds(im) if cfg.strip_metadata else ())
    faces = find_faces(im, cfg) if cfg.blur_faces else []
    counts["faces"] = len(faces)
    if not counts["faces"] and not (counts.keys() & {"exif", "gps", "xmp"}):
        return data, counts
    im.load()
    out = im
    if faces:
        out = im.convert("RGBA" if im.mode in ("RGBA", "LA", "P") else "RGB")
        for x, y, w, h in faces:
            box = (x, y, x + w, y + h)
            out.paste(out.crop(box).filter(ImageFilter.GaussianBlur(cfg.blur_radius * max(w, h))), box)
        if fmt == "JPEG":
            out = out.convert("RGB")
        out.info = {}
    else:
        out.info = {k: v for k, v in im.info.items() if k not in ("exif", "xmp", "XML:com.adobe.xmp")}
    new = _encode(out, fmt)
    left = metadata_kinds(Image.open(io.BytesIO(new))) if cfg.strip_metadata else set()
    if left:
        raise RuntimeError(f"{NAME}: {sorted(left)} still present after re-encoding a {fmt} image")
    return new, counts


def scrub_pairs(table: pa.Table, cfg: ImageScrubConfig) -> tuple[pa.Table, pa.Table, StageStats]:
    stats = StageStats(rows_in=table.num_rows, rows_kept=table.num_rows)
    images, digests, faces, captions, pii = [], [], [], [], []
    for data, caption in zip(table.column("image").to_pylist(), table.column("caption").to_pylist()):
        new, counts = scrub_image(data, cfg)
        stats.bytes_in += len(data)
        stats.bytes_out += len(new)
        stats.counters.update({k: v for k, v in counts.items() if v})
        stats.counters["images_with_faces"] += counts["faces"] > 0
        clean, found = scrub_text(caption, cfg.caption)
        stats.counters.update({f"caption_pii_{k}": n for k, n in found.items() if n})
        images.append(new)
        digests.append(hashlib.sha256(new).hexdigest())
        faces.append(counts["faces"])
        captions.append(clean)
        pii.append(sum(found.values()))
    out = table.set_column(table.schema.get_field_index("image"), "image", pa.array(images, pa.binary()))
    out = out.set_column(out.schema.get_field_index("caption"), "caption", pa.array(captions, pa.string()))
    out = out.append_column("scrubbed_sha256", pa.array(digests, pa.string()))
    out = out.append_column("faces", pa.array(faces, pa.int32()))
    out = out.append_column("caption_pii", pa.array(pii, pa.int32()))
    return out, rejected_table([], NAME), stats


def scrub_shard(cfg: ImageScrubConfig, files: list[str], writer) -> StageStats:
    return map_tables(files, writer, lambda table: scrub_pairs(table, cfg))


def warm(cfg: ImageScrubConfig) -> None:
    """Load the face cascade once per shard worker."""
    if cfg.blur_faces:
        cascade()


STAGE = PerFileStage(NAME, __package__, scrub_shard, warm=warm)
