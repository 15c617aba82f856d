"""The image path's stages on tiny literal images made here with Pillow (no stubs): collect's quarantine reasons,
filter's rules, dedup's exact and near copies, scrub's metadata and caption PII, preprocess's shards and index."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from lifecycle.tasks.data.images.collect.stage import ImageCollectConfig, run_image_collect
from lifecycle.tasks.data.images.dedup.stage import ImageDedupConfig, decide, near_pairs, run_image_dedup
from lifecycle.tasks.data.images.filter import stage as image_filter
from lifecycle.tasks.data.images.pixels import Limits, Refused, decode, phash, pixel_sha256
from lifecycle.tasks.data.images.preprocess.stage import ImagePreprocessConfig, run_image_preprocess
from lifecycle.tasks.data.images.scrub.stage import ImageScrubConfig, metadata_kinds, scrub_image

LIMITS = Limits(max_bytes=1 << 20, max_pixels=1_000_000, max_side=2000)


def picture(seed: int, size=(64, 48)) -> Image.Image:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)  # blocky: survives resizes and JPEG
    return Image.fromarray(small).resize(size, Image.Resampling.NEAREST)


def encoded(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def write_tar(path, records) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in records:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_decode_refuses_each_kind_with_its_reason():
    good = encoded(picture(0))
    assert decode(good, LIMITS).size == (64, 48)
    cases = {"truncated": good[: len(good) // 2], "corrupt": b"\x89PNG\r\n\x1a\n" + b"\x00" * 64,
             "decompression_bomb": encoded(Image.new("1", (2000, 1000))),
             "oversized": encoded(Image.new("RGB", (2500, 4))),
             "oversized_bytes": b"x" * (2 << 20)}
    for reason, data in cases.items():
        with pytest.raises(Refused) as e:
            decode(data, LIMITS)
        assert e.value.reason == reason, (reason, str(e.value))


def test_pixel_hash_matches_lossless_reencodes_only():
    im = picture(1)
    a, b = encoded(im, compress_level=1), encoded(im.convert("RGBA"), compress_level=9)
    assert a != b and pixel_sha256(decode(a, LIMITS)) == pixel_sha256(decode(b, LIMITS))
    jpeg = decode(encoded(im, "JPEG", quality=85), LIMITS)
    assert pixel_sha256(jpeg) != pixel_sha256(im)
    assert bin(phash(jpeg) ^ phash(im)).count("1") <= 4


def test_collect_quarantines_without_stopping_the_shard(tmp_path):
    good = encoded(picture(2))
    write_tar(tmp_path / "a.tar", [("k1.png", good), ("k1.txt", b"a red square"), ("k1.json", b'{"w": 1}'),
                                   ("k2.png", good[: len(good) // 2]), ("k2.txt", b"broken"),
                                   ("k3.png", good),  # no caption
                                   ("k4.png", encoded(picture(3))), ("k4.txt", b"a blue square")])
    pq.write_table(pa.table({"image": [encoded(picture(4), "JPEG")], "caption": ["a photo"], "url": ["u"]}),
                   tmp_path / "b.parquet")
    ref = run_image_collect(ImageCollectConfig(enabled=True, inputs=[str(tmp_path / "*")]), tmp_path / "w")
    kept = ref.read().to_pylist()
    assert [r["caption"] for r in kept] == ["a red square", "a blue square", "a photo"]
    assert kept[0]["meta"] == '{"w": 1}' and kept[2]["format"] == "JPEG" and kept[2]["meta"] == '{"url": "u"}'
    rejected = {r["source_id"].rsplit(":", 1)[1]: r["reason"] for r in ref.read_rejected().to_pylist()}
    assert rejected == {"k2": "truncated", "k3": "no_caption"}
    stats = ref.manifest()["stats"]
    assert stats["rows_in"] == 5 == stats["rows_kept"] + stats["rows_rejected"]
    assert run_image_collect(ImageCollectConfig(enabled=True, inputs=[str(tmp_path / "*")]), tmp_path / "w").reused


def test_filter_reasons():
    cfg = image_filter.ImageFilterConfig(min_side=32, max_aspect=3.0, min_caption_words=2)
    v = image_filter.pair_verdict
    assert v(64, 48, "a red square", cfg) is None
    assert v(20, 64, "a red square", cfg)[0] == "too_small"
    assert v(400, 40, "a red square", cfg)[0] == "aspect_ratio"
    assert v(64, 48, "square", cfg)[0] == "caption_too_short"
    lang = image_filter.ImageFilterConfig(caption_rules={"rules": ["language"]})
    assert v(64, 48, "ein kleines rotes Quadrat auf dem Tisch im Garten", lang)[0] == "caption_lang_not_kept"


def test_dedup_exact_and_near_and_distinct():
    ims = [picture(10), picture(11), picture(10)]
    hashes = np.array([phash(ims[0]), phash(ims[1]), phash(ims[2])], dtype=np.uint64)
    pixel = [pixel_sha256(ims[0]), pixel_sha256(ims[1]), pixel_sha256(ims[2])]
    out = decide(pixel, hashes, ImageDedupConfig(k=4, blocks=6))
    assert out == {2: (0, "exact_duplicate", 0)}
    jpeg = Image.open(io.BytesIO(encoded(ims[0], "JPEG", quality=70)))
    out = decide([pixel[0], pixel[1], pixel_sha256(jpeg)], np.array([hashes[0], hashes[1], phash(jpeg)], np.uint64),
                 ImageDedupConfig(k=4, blocks=6))
    assert list(out) == [2] and out[2][:2] == (0, "near_duplicate")


def test_banded_index_finds_every_pair_within_k():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**63, 50, dtype=np.uint64)
    flips = [np.uint64(sum(1 << int(b) for b in rng.choice(64, 3, replace=False))) for _ in range(50)]
    hashes = np.concatenate([base, base ^ np.array(flips, np.uint64)])
    found = {(i, j) for i, j, _ in near_pairs(hashes, 3, 6)}
    assert {(i, i + 50) for i in range(50)} <= found


def test_scrub_strips_gps_and_blurs_a_face_and_caption_pii(tmp_path):
    exif = Image.Exif()
    exif.get_ifd(0x8825).update({1: "N", 2: (38.0, 53.0, 23.0)})
    data = encoded(picture(5), "JPEG", exif=exif)
    assert metadata_kinds(Image.open(io.BytesIO(data))) == {"exif", "gps"}
    new, counts = scrub_image(data, ImageScrubConfig())
    assert metadata_kinds(Image.open(io.BytesIO(new))) == set() and counts["gps"] == 1 and counts["faces"] == 0
    import matplotlib.cbook  # a real photograph with one face, shipped inside matplotlib

    face = Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg")).convert("RGB")
    blurred, counts = scrub_image(encoded(face, "JPEG"), ImageScrubConfig())
    assert counts["faces"] == 1
    _, again = scrub_image(blurred, ImageScrubConfig())
    assert again["faces"] == 0  # the blurred face is no longer found
    clean, _ = scrub_image(encoded(picture(6)), ImageScrubConfig())
    assert clean == encoded(picture(6))  # nothing to remove: the bytes are kept


def test_pipeline_to_preprocess_shards_and_index(tmp_path):
    records = []
    for i in range(4):
        records += [(f"k{i}.png", encoded(picture(20 + i, (80, 60)))),
                    (f"k{i}.txt", f"a picture number {i} mail me at a{i}@example.org".encode())]
    write_tar(tmp_path / "a.tar", records)
    wd = tmp_path / "w"
    pairs = run_image_collect(ImageCollectConfig(enabled=True, inputs=[str(tmp_path / "a.tar")]), wd)
    kept = image_filter.STAGE.run(pairs, image_filter.ImageFilterConfig(), wd)
    unique = run_image_dedup(kept, ImageDedupConfig(), wd)
    from lifecycle.tasks.data.images.scrub.stage import STAGE as SCRUB

    clean = SCRUB.run(unique, ImageScrubConfig(), wd)
    assert all("<EMAIL>" in c for c in clean.read().column("caption").to_pylist())
    assert clean.manifest()["stats"]["counters"]["caption_pii_email"] == 4
    out = run_image_preprocess(clean, ImagePreprocessConfig(resolution=32, images_per_shard=3, vocab_size=300), wd)
    index = pq.read_table(out.dir / "index.parquet").to_pylist()
    assert [r["shard"] for r in index] == ["images-00000.tar"] * 3 + ["images-00001.tar"]
    for r in index:
        blob = (out.dir / r["shard"]).read_bytes()[r["offset"]: r["offset"] + r["size"]]
        assert Image.open(io.BytesIO(blob)).size == (32, 32) and r["tokens"]
    assert json.loads(out.manifest_path.read_text())["num_rows"] == 4
