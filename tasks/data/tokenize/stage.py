"""Tokenize stage: train a byte-level BPE on the clean documents (or load a given `tokenizer.json`), then pack
them into token shards.

Output dataset (one `lifecycle.core.dataset` directory, manifest written last):

- `tokenizer.json`: the HF `tokenizers` file; its sha256 is the tokenizer digest (`tokenizer_sha256`).
  With `tokenizer_file` set it is a byte copy of that file (same digest) and no BPE is trained; with
  `base_model` set, a copy of the base model's, and documents are framed BOS + text + EOS as its config says.
- `tokenizer_config.json`: makes the directory loadable with `transformers`'
  `PreTrainedTokenizerFast.from_pretrained(dir)` (eos/pad tokens set); see `hf_tokenizer`.
- `train-00000.bin`, `val-00000.bin`: flat little-endian token ids (uint16 when the vocabulary fits, else
  uint32); every document is followed by the end-of-text id. Read them with `np.memmap(path, dtype)`.
- kept rows (`part-*.parquet`): one row per packed document, `doc_id, source_id, split, shard,
  token_start, token_end` (half-open, end-of-text excluded), so any training window traces back to the
  documents it was cut from.
- rejected rows: documents that produce no tokens (`empty_after_tokenize`), so rows in = kept + rejected.

The train/val split is by group and deterministic (`split.py`): the documents of one page (`url`; or of one
source file, with `split_by: [url, source]`) form a group, sha256(seed, group key) mapped to [0, 1) is compared
with `val_fraction`, so a group never straddles the split and reruns give the same split. The BPE is trained on
the train split only, so validation text never shapes the vocabulary.

The validation split has a floor (`min_val_docs`, `min_val_tokens`; `split.py`): below it the stage says so and
takes the next groups in hash order until the floor is met (at most `max_val_fraction` of the documents),
then trains the BPE on what is left. The data checks run here, before any training (`checks.py`,
`overlap.py`): the train/val n-gram overlap is in the manifest (`contamination`) and in `overlap-report.json`
(near copies, top val/train pairs, top shared passages), and when more than `max_contamination` of the val
documents are near copies of training text the stage fails with `ContaminationError`, so a bad split costs no
training time. Score columns of the parent (`quality_*`, from the quality step) are carried into the side table.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lifecycle.core import dataset as ds
from lifecycle.core import fs
from lifecycle.core.code import code_version
from lifecycle.core.shards import StageCode
from lifecycle.tasks.data.tokenize import base, checks
from lifecycle.tasks.data.tokenize import split as valsplit
from lifecycle.tasks.data.tokenize.base import base_tokens, tokenizer_rows
# the readers and the split's keys, importable from here as before
from lifecycle.tasks.data.tokenize.shards import (  # noqa: F401
    NAME, TokenShards, hf_tokenizer, load_tokenizer, token_shards,
)
from lifecycle.tasks.data.tokenize.split import split_key, split_of  # noqa: F401

log = logging.getLogger(__name__)

SCORE_PREFIX = "quality_"  # per-document score columns carried into the side table
SPLITS = ("train", "val")
SIDE_ROWS_PER_FILE = 1 << 17  # side-table rows per Parquet file

SIDE_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("source_id", pa.string()),
        ("split", pa.string()),
        ("shard", pa.string()),  # file name of the token shard, relative to the dataset directory
        ("token_start", pa.int64()),  # first token of the document in the shard
        ("token_end", pa.int64()),  # one past its last token; the end-of-text id sits at token_end
    ]
)


class TokenizeConfig(BaseModel):
    """Tokenizer training and packing. Every field is part of the stage fingerprint."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    vocab_size: int = Field(4096, ge=300)
    """Target vocabulary size, special tokens and the 256 byte symbols included (demo: 4096)."""
    min_frequency: int = Field(2, ge=1)
    """A pair must occur at least this often in the training text to be merged."""
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    """Share of split groups (not tokens) routed to the validation shard, by a hash of the group key."""
    split_by: tuple[Literal["url", "source"], ...] = ("url",)
    """What never straddles train and validation: documents with the same value of the first of these columns
    that is set go to the same side; a document with none of them is its own group; `[]`: split by document.
    `url`: the sections of one page. Add `source` when every record's `source` names its file (the sections of
    one file); not by default, because `source` is often a corpus label (the bundled corpus: `python3.11-doc` on
    every record), which would make one group of everything. A JSONL/Parquet/WARC file that collect named as
    the `source` of its records (they had none) is never a group: its records are independent documents."""
    seed: int = 0
    """Salt of the split hash: change it to draw a different validation set."""
    min_val_docs: int = Field(50, ge=0)
    """Floor of the validation split in documents: below it, more documents (next in hash order) are moved there,
    with a message. Not applied when val_fraction is 0 (no validation split asked for)."""
    min_val_tokens: int = Field(10_000, ge=0)
    """Floor of the validation split in tokens (counted with the stage's tokenizer), as `min_val_docs`."""
    max_val_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """The floors never take more than this share of the documents; a corpus too small says so in the manifest.
    0.2: a small corpus (docker's 121 Markdown pages) gave half its documents and more tokens to val than to train
    at 0.5."""
    contamination_ngram: int = Field(13, ge=1)
    """Word n-gram length of the train/val overlap check (13, as in GPT-3 and lm-eval's decontamination)."""
    contamination_boilerplate_docs: int | None = Field(10, ge=1)
    """An n-gram found in more than this many train documents is boilerplate, a standard sentence of the corpus
    ("Only superusers can change this setting."), not a leak: it does not count toward a near copy. 10 is GPT-3's
    rule (appendix C: 13-grams matching more than 10 training documents were ignored, "common cultural phrases,
    legal boilerplate"). None: every n-gram counts."""
    contamination_min_share: float = Field(0.6, gt=0.0, le=1.0)
    """A val document is a near copy of training text when at least this share of its n-grams (boilerplate left
    out of both counts) are found in the train split, in one train document or several. Related pages of a
    reference manual share sentences, a copy shares most of the page (PaLM, section 8, called an example
    contaminated at 70% of its 8-grams in the training data). 0.6 is where clean manuals and copies (verbatim, one
    word in 50 changed, or inside a longer page) separate: `python -m bench.split_overlap`; a copy with one word in
    20 changed keeps about half its 13-grams and is not caught."""
    max_contamination: float = Field(0.05, ge=0.0, le=1.0)
    """Fail here, before training, when more than this share of val documents are near copies of training text
    (`contamination_min_share`); the error names the closest copy and `overlap-report.json`. 0.05 is above the
    share that clean manuals reached on every split measured, and below a leak of a tenth of the val documents
    (`python -m bench.split_overlap`). The GPT-3 share (any n-gram in train) is reported, not gated."""
    special_tokens: tuple[str, ...] = ("<|endoftext|>", "<|pad|>")
    """Special tokens, given the first ids in this order. Must contain `eot_token`."""
    eot_token: str = "<|endoftext|>"
    """Appended after every document in the shards."""
    batch_size: int = Field(1024, ge=1)
    """Documents per `encode_batch` call. `encode_batch` encodes a batch on all cores (the Rust encoder's
    rayon pool; `TOKENIZERS_PARALLELISM=false` turns that off), so larger batches use the cores better."""
    tokenizer_file: str | None = None
    """Path of an existing HF `tokenizer.json` to use instead of training one (vocab_size and min_frequency
    are then unused). It must know `eot_token`. Its sha256, not its path alone, is part of the fingerprint."""

    base_model: str | None = None
    """A Hugging Face checkpoint directory (set from `train.init_from: hf:<dir>`): encode with its own
    `tokenizer.json` and train no BPE; every document gets the model's BOS (when its config has one) and EOS
    (lifecycle.tasks.data.tokenize.base). vocab_size, min_frequency, special_tokens and eot_token are then
    unused. The sha256 of its tokenizer.json, config.json and tokenizer_config.json is in the fingerprint."""

    @model_validator(mode="after")
    def _check(self) -> "TokenizeConfig":
        if self.base_model is not None and self.tokenizer_file is not None:
            raise ValueError("tokenize.tokenizer_file and tokenize.base_model are mutually exclusive: a base model "
                             "brings its own tokenizer")
        if self.eot_token not in self.special_tokens:
            raise ValueError(f"eot_token {self.eot_token!r} must be one of special_tokens {self.special_tokens}")
        if len(set(self.special_tokens)) != len(self.special_tokens):
            raise ValueError(f"special_tokens has duplicates: {self.special_tokens}")
        if self.vocab_size < 256 + len(self.special_tokens):
            raise ValueError(f"vocab_size {self.vocab_size} is below 256 bytes + {len(self.special_tokens)} specials")
        return self


# --------------------------------------------------------------------------------------------------
# pure functions


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (0 .. vocab_size-1) fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def new_bpe(cfg: TokenizeConfig):
    """An untrained byte-level BPE (GPT-2 style: bytes mapped to printable symbols, no UNK ever)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(cfg.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return tok, trainer


def iter_docs(files: list[Path], batch_rows: int, extra: list[str] = ()) -> Iterator[pa.RecordBatch]:
    """Stream (doc_id, source_id, text, *extra) batches over Parquet files, one row group slice at a time."""
    for path in files:
        pf = ds.open_parquet(path)  # pages checked against their CRCs
        yield from pf.iter_batches(batch_size=batch_rows, columns=["doc_id", "source_id", "text", *extra])


def train_texts(files: list[Path], cfg: TokenizeConfig, val: set[str]) -> Iterator[list[str]]:
    for batch in iter_docs(files, cfg.batch_size):
        ids, texts = batch.column("doc_id").to_pylist(), batch.column("text").to_pylist()
        chunk = [t for d, t in zip(ids, texts) if t and d not in val]
        if chunk:
            yield chunk


def shard_name(split: str, index: int = 0) -> str:
    return f"{split}-{index:05d}.bin"


# --------------------------------------------------------------------------------------------------
# the stage


def raw_file(path: Path) -> ds.RawFile:
    return ds.RawFile(path=str(path), sha256=fs.sha256_file(path), bytes=path.stat().st_size)


def given_tokenizer(cfg: TokenizeConfig) -> ds.RawFile | None:
    """The configured `tokenizer_file` (or the base model's tokenizer.json) as a raw input (path + sha256), or
    None when the BPE is trained."""
    if cfg.base_model is not None:
        return raw_file(Path(base_tokens(cfg.base_model).tokenizer))
    if cfg.tokenizer_file is None:
        return None
    path = Path(cfg.tokenizer_file).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"tokenize.tokenizer_file: {path} does not exist")
    return raw_file(path)


def given_inputs(cfg: TokenizeConfig) -> list[ds.RawFile]:
    """Raw inputs of the stage (in its fingerprint): the given tokenizer, and a base model's config files, which
    decide BOS and EOS."""
    given = given_tokenizer(cfg)
    if given is None:
        return []
    if cfg.base_model is None:
        return [given]
    d = Path(given.path).parent
    return [given] + [raw_file(d / n) for n in (base.CONFIG, base.TOKENIZER_CONFIG) if (d / n).is_file()]


def hf_tokenizer_config(cfg: TokenizeConfig, tok=None, framing: base.BaseTokens | None = None) -> dict:
    """tokenizer_config.json for `PreTrainedTokenizerFast.from_pretrained` (no transformers import needed)."""
    if framing is not None:  # a base model's own BOS/EOS
        bos = tok.id_to_token(framing.bos_id) if framing.bos_id is not None else None
        return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.id_to_token(framing.eos_id),
                "bos_token": bos, "pad_token": None, "clean_up_tokenization_spaces": False}
    pad = next((t for t in cfg.special_tokens if "pad" in t), None)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": cfg.eot_token, "bos_token": cfg.eot_token,
            "pad_token": pad, "add_prefix_space": False, "clean_up_tokenization_spaces": False}


def score_columns(parent: ds.DatasetRef) -> list[pa.Field]:
    """The parent's per-document score columns (`quality_*`, written by the quality step), kept in the side table."""
    files = parent.files()
    if not files:
        return []
    schema = ds.open_parquet(files[0]).schema_arrow
    return [f for f in schema if f.name.startswith(SCORE_PREFIX)]


def _train_bpe(files: list[Path], cfg: TokenizeConfig, val: set[str], tok_path: Path):
    tok, trainer = new_bpe(cfg)
    tok.train_from_iterator(train_texts(files, cfg, val), trainer=trainer)
    tok.save(str(tok_path))


def _build(parent: ds.DatasetRef, cfg: TokenizeConfig, writer: ds.DatasetWriter) -> dict:
    files = parent.files()
    tok_path = writer.path("tokenizer.json")
    tok, vs, framing = _tokenizer(files, cfg, writer, tok_path)
    vocab_size, bos, eot_id = _framing_ids(tok, cfg, framing)
    dtype = token_dtype(vocab_size)
    out = _TokenShards(writer, dtype, score_columns(parent))
    stats = ds.StageStats()
    rejected: list[dict] = []
    try:
        for batch in iter_docs(files, cfg.batch_size, [f.name for f in out.scores]):
            ids = batch.column("doc_id").to_pylist()
            sources = batch.column("source_id").to_pylist()
            texts = batch.column("text").to_pylist()
            stats.rows_in += len(ids)
            stats.bytes_in += sum(len(t.encode()) for t in texts if t)
            encodings = tok.encode_batch([t or "" for t in texts], add_special_tokens=False)
            extra = [batch.column(f.name).to_pylist() for f in out.scores]
            for j, (doc_id, source_id, enc) in enumerate(zip(ids, sources, encodings)):
                if not enc.ids:
                    rejected.append({"doc_id": doc_id, "source_id": source_id, "reason": "empty_after_tokenize",
                                     "detail": "text is null or encodes to zero tokens"})
                    stats.rejected["empty_after_tokenize"] += 1
                    continue
                split = "val" if doc_id in vs.val else "train"
                out.add(doc_id, source_id, split, bos, enc.ids, eot_id, [c[j] for c in extra])
            if len(out.rows["doc_id"]) >= SIDE_ROWS_PER_FILE:
                out.flush_rows(stats)
        out.flush_rows(stats)
    finally:
        out.close()
    for s in SPLITS:
        writer.add_file(out.shards[s], kind="extra")
    if rejected:
        writer.write_table(ds.rejected_table(rejected, NAME), kind="rejected")
    offsets, docs = out.offsets, out.docs
    stats.bytes_out = sum(offsets.values()) * dtype.itemsize
    stats.counters.update({f"tokens_{s}": offsets[s] for s in SPLITS} | {f"docs_{s}": docs[s] for s in SPLITS})
    vs.tokens = offsets["val"]
    overlap = _overlap(files, cfg, vs, writer)
    return {
        "stats": stats,
        "extra": {
            "tokenizer_sha256": fs.sha256_file(tok_path),
            "tokenizer_file": "tokenizer.json",
            "dtype": dtype.name,
            "vocab_size": vocab_size,
            "eot_id": eot_id,
            "num_tokens": dict(offsets),
            "num_docs": dict(docs),
            "shards": {s: [out.shards[s]] for s in SPLITS},
            "val_split": vs.summary(),
            "contamination": overlap | {"ngram": cfg.contamination_ngram},
        },
    }


def _tokenizer(files: list[Path], cfg: TokenizeConfig, writer: ds.DatasetWriter, tok_path: Path):
    """(the tokenizer, the validation split, a base model's framing tokens or None): the given tokenizer copied or
    a BPE trained (again, if the token floor moved documents into validation), saved with its HF config."""
    from tokenizers import Tokenizer

    given = given_tokenizer(cfg)
    vs = valsplit.docs_floor(files, cfg, iter_docs)
    if given is not None:
        fs.atomic_write_bytes(tok_path, Path(given.path).read_bytes())
        if fs.sha256_file(tok_path) != given.sha256:
            raise RuntimeError(f"tokenize.tokenizer_file {given.path} changed while it was being copied")
    else:
        _train_bpe(files, cfg, vs.val, tok_path)
    framing = base_tokens(cfg.base_model) if cfg.base_model is not None else None
    framed = 1 + (framing is not None and framing.bos_id is not None)  # EOS (+ BOS) around every document

    def count(texts: list[str]) -> list[int]:
        encoder = Tokenizer.from_file(str(tok_path))
        return [len(e.ids) + framed for e in encoder.encode_batch(texts, add_special_tokens=False)]

    if valsplit.tokens_floor(vs, files, cfg, iter_docs, count) and given is None:
        _train_bpe(files, cfg, vs.val, tok_path)  # the moved documents must not shape the vocabulary
    for note in vs.notes:
        log.warning("tokenize: %s", note)
        print(f"[tokenize] {note}")
    writer.add_file("tokenizer.json", kind="extra")
    tok = Tokenizer.from_file(str(tok_path))  # encode with exactly what was saved
    fs.atomic_write_json(writer.path("tokenizer_config.json"), hf_tokenizer_config(cfg, tok, framing))
    writer.add_file("tokenizer_config.json", kind="extra")
    return tok, vs, framing


def _framing_ids(tok, cfg: TokenizeConfig, framing: base.BaseTokens | None) -> tuple[int, list[int], int]:
    """(vocab size, the BOS ids before every document, the end-of-text id after it)."""
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    bos = []
    if framing is not None:
        eot_id, bos = framing.eos_id, [framing.bos_id] if framing.bos_id is not None else []
        vocab_size = max(vocab_size, tokenizer_rows(Path(framing.tokenizer)))
    else:
        eot_id = tok.token_to_id(cfg.eot_token)
    if eot_id is None:
        raise ValueError(f"tokenize.tokenizer_file {cfg.tokenizer_file} has no token {cfg.eot_token!r} (eot_token)")
    return vocab_size, bos, eot_id


class _TokenShards:
    """The token shards (one flat file per split) and the side table: each document's split, shard and token
    range, with the parent's score columns."""

    def __init__(self, writer: ds.DatasetWriter, dtype: np.dtype, scores: list[pa.Field]):
        self.writer, self.dtype, self.scores = writer, dtype, scores
        self.shards = {s: shard_name(s) for s in SPLITS}
        self.outs = {s: open(writer.path(self.shards[s]), "wb") for s in SPLITS}
        self.offsets = dict.fromkeys(SPLITS, 0)
        self.docs: Counter = Counter()
        self.side_schema = SIDE_SCHEMA
        for f in scores:
            self.side_schema = self.side_schema.append(f)
        self.rows: dict[str, list] = {name: [] for name in self.side_schema.names}

    def add(self, doc_id: str, source_id: str, split: str, bos: list[int], ids: list[int], eot_id: int,
            extra: list) -> None:
        arr = np.asarray(bos + ids + [eot_id], dtype=self.dtype)
        arr.tofile(self.outs[split])
        start = self.offsets[split] + len(bos)  # a BOS sits just before token_start
        self.offsets[split] += arr.size
        self.docs[split] += 1
        row = (doc_id, source_id, split, self.shards[split], start, self.offsets[split] - 1, *extra)
        for name, value in zip(self.side_schema.names, row):
            self.rows[name].append(value)

    def flush_rows(self, stats: ds.StageStats) -> None:
        if self.rows["doc_id"]:
            self.writer.write_table(pa.table(self.rows, schema=self.side_schema))
            stats.rows_kept += len(self.rows["doc_id"])
            for col in self.rows.values():
                col.clear()

    def close(self) -> None:
        for f in self.outs.values():
            f.close()


def _overlap(files: list[Path], cfg: TokenizeConfig, vs, writer: ds.DatasetWriter) -> dict:
    """The train/validation overlap check (checks.py); its report goes into the dataset."""

    def batches():
        for b in iter_docs(files, cfg.batch_size):
            yield b.column("doc_id").to_pylist(), b.column("source_id").to_pylist(), b.column("text").to_pylist()

    overlap, report = checks.train_val_overlap(batches, vs.val, cfg)
    fs.atomic_write_json(writer.path(checks.REPORT), report)
    writer.add_file(checks.REPORT, kind="extra")
    return overlap


def run_tokenize(parent: ds.DatasetRef, cfg: TokenizeConfig, workdir: str) -> ds.DatasetRef:
    """Return the committed token dataset for (parent, cfg, this code), building it if needed."""
    code = code_version(__package__)
    ref = ds.materialize(workdir, NAME, cfg, code, lambda w: _build(parent, cfg, w), parents=[parent],
                         inputs=given_inputs(cfg))
    # the data checks, on the committed result (a rerun of a failed check reuses the dataset and fails again)
    checks.check_overlap(ref.manifest()["contamination"], cfg, ref.dir / checks.REPORT)
    return ref


STAGE = StageCode(run=run_tokenize)  # what the registry (`lifecycle.tasks.stages`) runs, as one task
