"""Image preprocess, the image path's counterpart of tokenize: every kept image resized (shorter side to
`resolution`, bicubic) and center-cropped to `resolution` x `resolution` (Pillow `ImageOps.fit`), flattened onto
white and re-encoded as JPEG into WebDataset tar shards (`images-NNNNN.tar`: <image_id>.jpg + .txt), and every
caption tokenized with the run's tokenizer (`tokenizer_file`, or a byte-level BPE trained on the captions with the
text path's trainer, `tokenize.stage.new_bpe`, saved as tokenizer.json in the dataset).

`index.parquet` is the image -> shard side table (the text path's doc_id -> token range): image_id, source_id,
shard, member, offset and size of the JPEG inside the tar (a reader can seek straight to it), caption, caption
token ids. Nothing is rejected.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pyarrow as pa
from PIL import Image, ImageOps
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core import fs
from lifecycle.core.code import code_version
from lifecycle.core.dataset import DatasetRef, DatasetWriter, RawFile, StageStats, materialize, read_parquet
from lifecycle.core.shards import StageCode, heartbeat
from lifecycle.tasks.data.images.pixels import on_white
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, new_bpe

NAME = "image_preprocess"
INDEX = "index.parquet"
INDEX_SCHEMA = pa.schema([("image_id", pa.string()), ("source_id", pa.string()), ("shard", pa.string()),
                          ("member", pa.string()), ("offset", pa.int64()), ("size", pa.int64()),
                          ("caption", pa.string()), ("tokens", pa.list_(pa.int32()))])


class ImagePreprocessConfig(BaseModel):
    """Training resolution, shards and the caption tokenizer."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    resolution: int = Field(64, ge=8)
    """Side of the square training image (CLIP: 224; the CPU demo: 64)."""
    jpeg_quality: int = Field(90, ge=1, le=100)
    """Quality of the re-encoded JPEGs."""
    images_per_shard: int = Field(1000, ge=1)
    """Images per tar shard."""
    tokenizer_file: str | None = None
    """A Hugging Face tokenizer.json to tokenize captions with (its sha256 is in the fingerprint); None trains a
    byte-level BPE of `vocab_size` on the captions."""
    vocab_size: int = Field(1024, ge=300)
    """Vocabulary of the BPE trained on the captions when no tokenizer_file is given."""


def square(data: bytes, cfg: ImagePreprocessConfig) -> bytes:
    """The image resized and center-cropped to resolution x resolution, as JPEG."""
    im = ImageOps.fit(on_white(Image.open(io.BytesIO(data))), (cfg.resolution, cfg.resolution),
                      Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=cfg.jpeg_quality)
    return buf.getvalue()


def _tokenizer(captions: list[str], cfg: ImagePreprocessConfig, writer: DatasetWriter):
    from tokenizers import Tokenizer

    if cfg.tokenizer_file is not None:
        tok = Tokenizer.from_file(cfg.tokenizer_file)
    else:
        tok, trainer = new_bpe(TokenizeConfig(vocab_size=cfg.vocab_size, min_frequency=1))
        tok.train_from_iterator([captions], trainer=trainer)
    tok.save(str(writer.path("tokenizer.json")))
    writer.add_file("tokenizer.json")
    return tok


class _Shards:
    """Tar shards of `images_per_shard` JPEG + caption members, each registered in the dataset when closed."""

    def __init__(self, writer: DatasetWriter, per_shard: int):
        self.writer, self.per_shard = writer, per_shard
        self.tar: tarfile.TarFile | None = None
        self.name, self.count, self.n = "", 0, 0

    def add(self, iid: str, jpg: bytes, caption: str) -> tuple[str, int]:
        """Write one pair; (shard name, offset of the JPEG's bytes in it)."""
        if self.count == self.per_shard or self.tar is None:
            self.close()
            self.name = f"images-{self.n // self.per_shard:05d}.tar"
            self.tar = tarfile.open(self.writer.path(self.name), "w", format=tarfile.USTAR_FORMAT)
        offset = 0
        for suffix, blob in (("jpg", jpg), ("txt", caption.encode())):
            info = tarfile.TarInfo(f"{iid}.{suffix}")
            info.size, info.mtime, info.mode = len(blob), 0, 0o644
            if suffix == "jpg":
                offset = self.tar.offset + tarfile.BLOCKSIZE  # after the member's 512-byte ustar header
            self.tar.addfile(info, io.BytesIO(blob))
        self.count += 1
        self.n += 1
        return self.name, offset

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
            self.writer.add_file(self.name, num_rows=self.count)
        self.tar, self.count = None, 0


def _build(parent: DatasetRef, cfg: ImagePreprocessConfig, writer: DatasetWriter) -> dict:
    files = parent.files()
    captions = [c for p in files for c in read_parquet(p, columns=["caption"]).column("caption").to_pylist()]
    tok = _tokenizer(captions, cfg, writer)
    index: dict[str, list] = {n: [] for n in INDEX_SCHEMA.names}
    stats, shards = StageStats(), _Shards(writer, cfg.images_per_shard)
    for path in files:
        table = read_parquet(path, columns=["image_id", "source_id", "caption", "image"]).to_pydict()
        for iid, sid, caption, data in zip(*table.values()):
            heartbeat()
            jpg = square(data, cfg)
            shard, offset = shards.add(iid, jpg, caption)
            for k, v in zip(INDEX_SCHEMA.names, (iid, sid, shard, f"{iid}.jpg", offset, len(jpg), caption,
                                                 tok.encode(caption).ids)):
                index[k].append(v)
            stats.bytes_in += len(data)
            stats.bytes_out += len(jpg)
    shards.close()
    writer.write_table(pa.table(index, schema=INDEX_SCHEMA), name=INDEX)
    stats.rows_in = stats.rows_kept = shards.n
    stats.counters["caption_tokens"] = sum(len(t) for t in index["tokens"])
    return {"stats": stats, "extra": {"resolution": cfg.resolution, "vocab_size": tok.get_vocab_size()}}


def run_image_preprocess(parent: DatasetRef, cfg: ImagePreprocessConfig, workdir: str) -> DatasetRef:
    given = [] if cfg.tokenizer_file is None else [RawFile(path=str(Path(cfg.tokenizer_file).resolve()),
                                                          sha256=fs.sha256_file(cfg.tokenizer_file),
                                                          bytes=fs.size(cfg.tokenizer_file))]
    return materialize(workdir, NAME, cfg, code_version(__package__), lambda w: _build(parent, cfg, w),
                       parents=[parent], inputs=given)


STAGE = StageCode(run=run_image_preprocess)
