"""What every image stage shares: the image-text row schema, decode-verify, and the hashes dedup compares.

A row of an image dataset is one image-text pair (IMAGE_SCHEMA). `image_id` plays the part `doc_id` plays for
text: stable (sha256 of the source id and the image bytes), and the key of rejected rows (their `doc_id` column
holds it, so the rejected files have the text path's schema) and of lineage.

Decode-verify (`decode`) is Pillow's two passes: `Image.verify()` (structure and checksums without decoding), then a
fresh open and a full `load()` (which is where a truncated file fails). Before either, the header's size is checked
against `max_pixels`, so a decompression bomb (a few kB that claim a gigapixel) is refused without allocating it;
Pillow's own guard (`Image.MAX_IMAGE_PIXELS`, a process-wide setting) is not relied on.

Hashes: `pixel_sha256` is over the decoded RGBA pixels and the size, so a lossless re-encode (another PNG
compression, metadata added, a WebP lossless copy) has the same hash while its bytes differ; `phash` is imagehash's
64-bit perceptual hash (DCT of the 32x32 grey image, bits above the median of the 8x8 low frequencies) of the image
flattened onto white, so a transparent PNG and its JPEG copy hash alike.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from dataclasses import dataclass

import imagehash
import pyarrow as pa
from PIL import Image, ImageFile, UnidentifiedImageError

IMAGE_SCHEMA = pa.schema([
    ("image_id", pa.string()),      # sha256(source_id, image sha256)[:16]
    ("source_id", pa.string()),     # `<file>:<key>` (WebDataset tar) or `<file>:<row>` (Parquet)
    ("caption", pa.string()),
    ("image", pa.binary()),         # the encoded bytes (scrub: with metadata stripped and faces blurred)
    ("format", pa.string()),        # Pillow's format name: PNG, JPEG, WEBP, GIF, ...
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("sha256", pa.string()),        # of the collected bytes (scrub keeps it: the key back to the raw image)
    ("pixel_sha256", pa.string()),  # of the decoded RGBA pixels and the size
    ("phash", pa.uint64()),         # 64-bit perceptual hash
    ("source", pa.string()),        # the input file
    ("meta", pa.string()),          # the WebDataset record's key.json (or the Parquet row's other columns), JSON
])


def image_id(source_id: str, sha256: str) -> str:
    return hashlib.sha256(f"{source_id}\x00{sha256}".encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclass(frozen=True)
class Limits:
    """What decode refuses before decoding (sizes from the header)."""

    max_bytes: int
    max_pixels: int
    max_side: int


class Refused(Exception):
    """An image decode refused: `reason` is the rejected row's reason code, the message its detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def decode(data: bytes, limits: Limits) -> Image.Image:
    """The fully loaded image, or Refused(reason) with reason oversized_bytes, corrupt, decompression_bomb,
    oversized or truncated. Never loads more than `limits.max_pixels` pixels."""
    if len(data) > limits.max_bytes:
        raise Refused("oversized_bytes", f"{len(data)} bytes > max_bytes {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            w, h = im.size
            if w * h > limits.max_pixels:
                raise Refused("decompression_bomb", f"header says {w}x{h} = {w * h} pixels > max_pixels "
                                                    f"{limits.max_pixels} ({len(data)} bytes)")
            if max(w, h) > limits.max_side:
                raise Refused("oversized", f"{w}x{h}: a side > max_side {limits.max_side}")
            im.verify()
            im = Image.open(io.BytesIO(data))
            fmt = im.format
            ImageFile.LOAD_TRUNCATED_IMAGES = False  # the default; a truncated file must fail, not decode grey
            im.load()
    except Refused:
        raise
    except UnidentifiedImageError as e:
        raise Refused("corrupt", f"not an image Pillow can identify ({len(data)} bytes)") from e
    except Image.DecompressionBombError as e:
        raise Refused("decompression_bomb", str(e)) from e
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombWarning) as e:
        reason = "truncated" if "truncated" in str(e).lower() or isinstance(e, EOFError) else "corrupt"
        raise Refused(reason, f"{type(e).__name__}: {e}"[:300]) from e
    im.format = fmt
    return im


def pixel_sha256(im: Image.Image) -> str:
    """sha256 of the size and the RGBA pixels: equal for lossless re-encodes of the same picture."""
    rgba = im.convert("RGBA")
    h = hashlib.sha256(f"{rgba.width}x{rgba.height}\x00".encode())
    h.update(rgba.tobytes())
    return h.hexdigest()


def on_white(im: Image.Image) -> Image.Image:
    """RGB, transparent pixels composited onto white (how a JPEG copy of a transparent PNG looks)."""
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


def phash(im: Image.Image) -> int:
    """imagehash's 64-bit pHash of the image on white, as an unsigned int."""
    return int(str(imagehash.phash(on_white(im))), 16)


def meta_json(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True)
