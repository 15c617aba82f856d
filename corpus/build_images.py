"""Build the bundled image-text corpus `corpus/images/` from Debian's `fonts-noto-color-emoji` (and one photograph
that ships inside matplotlib), for the image path (`deploy/configs/clip-demo.yaml`).

    python corpus/build_images.py                      # writes corpus/images/*.tar, *.parquet
    python corpus/build_images.py --check              # rebuild in memory, compare with the files

Real images with real captions: every 4th emoji of the font with a single code point (U+1F300 to U+1FAFF, STRIDE) is drawn with
Pillow at the font's bitmap size (109 px, 136x128 RGBA) and captioned with its Unicode name (`unicodedata.name`,
lower-cased: "an emoji of a grinning face"); key.json keeps the code point and name. Written as WebDataset shards
(key.png + key.txt + key.json, as img2dataset writes them), the last slice as Parquet (image bytes + caption).

Planted, each named in key.json (`variant_of`, `kind`) so bench/image_dedup.py can score dedup on them:
- variants of the first VARIANTS emoji: `reencode` (PNG at another compression level with a text chunk: same
  pixels, other bytes), `jpeg` (flattened on white, quality 85), `resize` (to 75 %), `crop` (5 % off each side),
  `watermark` (a semi-transparent text band);
- damaged files: truncated PNG, corrupt bytes, a decompression bomb (a 1-bit 20000x20000 PNG of a few kB),
  an oversized 9000x16 strip, a tiny 12x12 image and a 400x40 banner (filter), a record without caption;
- a photograph (Grace Hopper, public domain, from matplotlib's sample data) with EXIF GPS tags planted and an
  e-mail address in its caption, for image_scrub's metadata stripping, face blurring and caption PII.
Reproducible: same font and Pillow give byte-identical files (sorted code points, fixed tar mtimes).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont

FONT = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
OUT = Path(__file__).parent / "images"
PER_SHARD = 100
PARQUET_ROWS = 60
VARIANTS = 30
STRIDE = 4  # every 4th emoji: about 300 pictures, 3 MB, enough for the demo's few minutes


def emoji_points(font_path: str) -> list[int]:
    from fontTools.ttLib import TTFont

    cmap = TTFont(font_path).getBestCmap()
    return sorted(cp for cp in cmap if 0x1F300 <= cp <= 0x1FAFF and unicodedata.name(chr(cp), ""))[::STRIDE]


def render(cp: int, font) -> Image.Image:
    im = Image.new("RGBA", (136, 128), (0, 0, 0, 0))
    ImageDraw.Draw(im).text((0, 0), chr(cp), font=font, embedded_color=True)
    return im


def png(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG", **kw)
    return buf.getvalue()


def caption_of(cp: int) -> str:
    name = unicodedata.name(chr(cp)).lower()
    return f"an emoji of {'an' if name[0] in 'aeiou' else 'a'} {name}"


def on_white(im: Image.Image) -> Image.Image:
    return Image.alpha_composite(Image.new("RGBA", im.size, "white"), im).convert("RGB")


def variants(im: Image.Image) -> dict[str, tuple[str, bytes]]:
    """kind -> (suffix, bytes) of the planted near and exact copies of one emoji."""
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "re-encoded copy")
    jpg = io.BytesIO()
    on_white(im).save(jpg, "JPEG", quality=85)
    w, h = im.size
    marked = im.copy()
    band = Image.new("RGBA", im.size, (0, 0, 0, 0))
    ImageDraw.Draw(band).text((4, h - 18), "(c) example.com", fill=(255, 255, 255, 150))
    marked = Image.alpha_composite(marked, band)
    return {"reencode": ("png", png(im, compress_level=1, pnginfo=info)), "jpeg": ("jpg", jpg.getvalue()),
            "resize": ("png", png(im.resize((w * 3 // 4, h * 3 // 4), Image.Resampling.LANCZOS))),
            "crop": ("png", png(im.crop((w // 20, h // 20, w - w // 20, h - h // 20)))),
            "watermark": ("png", png(marked))}


def damaged(good: bytes) -> list[tuple[str, str, bytes | None, str | None]]:
    """(key, suffix, bytes, caption) of the records collect or filter must refuse."""
    bomb = png(Image.new("1", (20000, 20000)), optimize=True)
    return [("damaged-truncated", "png", good[: len(good) // 2], "a truncated picture"),
            ("damaged-corrupt", "png", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, "a corrupt picture"),
            ("damaged-bomb", "png", bomb, "a decompression bomb"),
            ("damaged-oversized", "png", png(Image.new("RGB", (9000, 16), "gray")), "an oversized strip"),
            ("filter-tiny", "png", png(Image.new("RGB", (12, 12), "red")), "a tiny red square"),
            ("filter-banner", "png", png(Image.new("RGB", (400, 40), "blue")), "a long blue banner"),
            ("damaged-nocaption", "png", good, None)]


def photo() -> tuple[bytes, str]:
    """Grace Hopper's portrait with EXIF GPS planted, and a caption holding an e-mail address."""
    import matplotlib.cbook

    im = Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg")).convert("RGB")
    exif = Image.Exif()
    exif[0x010F] = "Example Camera Co"  # Make
    gps = exif.get_ifd(0x8825)
    gps.update({1: "N", 2: (38.0, 53.0, 23.0), 3: "W", 4: (77.0, 2.0, 11.0)})
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90, exif=exif)
    return buf.getvalue(), "Rear Admiral Grace Hopper in uniform; prints from grace.hopper@navy.example.org"


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def write_tar(records: list[tuple[str, str, bytes, str | None, dict]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, suffix, data, caption, meta in records:
            add(tar, f"{key}.{suffix}", data)
            if caption is not None:
                add(tar, f"{key}.txt", caption.encode())
            add(tar, f"{key}.json", json.dumps(meta, sort_keys=True).encode())
    return buf.getvalue()


def build() -> dict[str, bytes]:
    font = ImageFont.truetype(FONT, 109)
    points = emoji_points(FONT)
    base = [(f"{cp:05x}", "png", png(render(cp, font)), caption_of(cp),
             {"codepoint": f"U+{cp:04X}", "name": unicodedata.name(chr(cp)), "source": "fonts-noto-color-emoji"})
            for cp in points]
    files: dict[str, bytes] = {}
    tar_part, parquet_part = base[:-PARQUET_ROWS], base[-PARQUET_ROWS:]
    for i in range(0, len(tar_part), PER_SHARD):
        files[f"emoji-{i // PER_SHARD:05d}.tar"] = write_tar(tar_part[i:i + PER_SHARD])
    table = pa.table({"image": [r[2] for r in parquet_part], "caption": [r[3] for r in parquet_part],
                      "codepoint": [r[4]["codepoint"] for r in parquet_part]})
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf, compression="none")
    files["emoji-pairs.parquet"] = buf.getvalue().to_pybytes()
    planted = []
    for key, _, data, caption, meta in base[:VARIANTS]:
        for kind, (suffix, blob) in variants(Image.open(io.BytesIO(data))).items():
            planted.append((f"{key}-{kind}", suffix, blob, caption, {**meta, "variant_of": key, "kind": kind}))
    files["planted-variants.tar"] = write_tar(planted)
    photo_bytes, photo_caption = photo()
    odd = [(k, s, b, c, {"planted": k}) for k, s, b, c in damaged(base[0][2])]
    odd.append(("photo-hopper", "jpg", photo_bytes, photo_caption, {"planted": "photo", "faces": 1}))
    files["planted-damaged.tar"] = write_tar(odd)
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="rebuild in memory and compare with corpus/images/")
    args = p.parse_args(argv)
    files = build()
    if args.check:
        bad = [n for n, b in files.items() if not (OUT / n).is_file() or (OUT / n).read_bytes() != b]
        print("corpus/images: " + (f"differs: {bad}" if bad else f"{len(files)} files identical"))
        return 1 if bad else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (OUT / name).write_bytes(data)
    print(f"wrote {len(files)} files, {sum(map(len, files.values())) / 1e6:.1f} MB to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
