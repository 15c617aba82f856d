"""Quality scores, kept apart from the decision (Dolma's tag-then-mix): this step writes a per-document score
column and never drops a row; `select` (tasks/data/select/) keeps rows by a rule on it. A changed threshold
changes only select's fingerprint: the scores, and everything before them, are reused.

Scorer: a fastText classifier trained here (`classifier.py`, DCLM's recipe). Positives: the documents of
`quality.reference_inputs` (any format collect reads, read by collect's own reader). Negatives: about
`negatives_per_positive` x as many corpus documents, the first in sha256(seed, doc_id) order. A
`heldout_fraction` of both is kept out of training; precision, recall and F1 on it (at 0.5) go into the manifest
(`metrics`) and MLflow. The model file `quality.bin` is in the dataset, its sha256 in the manifest
(`model_sha256`) and on the MLflow run. Every document gets `quality_fasttext` = P(high quality), float32.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lifecycle.core import dataset as ds
from lifecycle.core import fs
from lifecycle.core.code import code_version
from lifecycle.core.shards import StageCode
from lifecycle.tasks.data.collect.stage import CollectConfig, collect_shard, resolve_inputs
from lifecycle.tasks.data.quality import classifier

NAME = "quality"
COLUMN = "quality_fasttext"
MODEL_FILE = "quality.bin"


class QualityConfig(BaseModel):
    """The scoring step: which reference documents are "high quality", and how the classifier is trained."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Score documents (and select on the score: `select`). Off: tokenize reads the previous step's output."""
    reference_inputs: list[str] = []
    """Glob patterns of high-quality reference documents, in any format collect reads: the positives."""
    negatives_per_positive: float = Field(1.0, gt=0)
    """Corpus documents sampled as negatives, per positive."""
    heldout_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of positives and negatives kept out of training to measure precision, recall and F1."""
    seed: int = 0
    """Salt of the negative sample and the held-out split; also fastText's seed."""
    epoch: int = Field(20, ge=1)
    """fastText training epochs (its default 5 gave F1 0.828 on the bundled corpus, 20 gave 0.950)."""
    lr: float = Field(0.5, gt=0)
    """fastText learning rate (its default 0.1 was too low at these epochs, see `epoch`)."""
    word_ngrams: int = Field(2, ge=1)
    """fastText wordNgrams (DCLM: 2)."""
    dim: int = Field(64, ge=1)
    """fastText word-vector dimension."""
    min_count: int = Field(1, ge=1)
    """fastText minCount: words seen fewer times are dropped from the vocabulary."""
    max_chars: int = Field(10_000, ge=100)
    """Characters of a document the classifier reads (training and scoring)."""
    batch_rows: int = Field(4096, ge=1)
    """Documents scored per `predict` call."""

    @model_validator(mode="after")
    def _refs(self) -> "QualityConfig":
        if self.enabled and not self.reference_inputs:
            raise ValueError("quality.enabled is true but quality.reference_inputs is empty: name the high-quality "
                             "reference documents the classifier learns from")
        return self


class _Rows:
    """A writer that keeps collect's kept tables in memory (reference sets are small)."""

    def __init__(self):
        self.tables: list[pa.Table] = []

    def write_table(self, table: pa.Table, kind: str = "files", name: str | None = None) -> None:
        if kind == "files":
            self.tables.append(table)


def reference_texts(cfg: QualityConfig) -> list[tuple[str, str]]:
    """(doc_id, text) of the reference documents, read as collect reads them."""
    raws = resolve_inputs(cfg.reference_inputs)
    if not raws:
        raise FileNotFoundError(f"quality.reference_inputs {cfg.reference_inputs} match no file")
    rows = _Rows()
    collect_shard(CollectConfig(inputs=cfg.reference_inputs), [r.path for r in raws], rows)
    out = [(d, t) for tb in rows.tables for d, t in zip(tb.column("doc_id").to_pylist(), tb.column("text").to_pylist())]
    if not out:
        raise ValueError(f"quality.reference_inputs {cfg.reference_inputs}: no document could be read")
    return out


def _order(doc_id: str, seed: int) -> bytes:
    return hashlib.sha256(f"{seed}:negative:{doc_id}".encode()).digest()


def sample_negatives(files: list[Path], n: int, seed: int, exclude: set[str]) -> list[tuple[str, str]]:
    """The first `n` corpus documents in sha256(seed, doc_id) order (two passes: ids, then their texts)."""
    keys = []
    for f in files:
        keys += [(_order(d, seed), d) for d in ds.open_parquet(f).read(columns=["doc_id"]).column(0).to_pylist()
                 if d not in exclude]
    wanted = {d for _, d in sorted(keys)[:n]}
    out = []
    for f in files:
        t = ds.open_parquet(f).read(columns=["doc_id", "text"])
        out += [(d, x) for d, x in zip(t.column(0).to_pylist(), t.column(1).to_pylist()) if d in wanted and x]
    return sorted(out)


def _build(parent: ds.DatasetRef, cfg: QualityConfig, writer: ds.DatasetWriter) -> dict:
    files = parent.files()
    pos = reference_texts(cfg)
    neg = sample_negatives(files, round(len(pos) * cfg.negatives_per_positive), cfg.seed, {d for d, _ in pos})
    examples = [(classifier.LABEL_HQ, d, t) for d, t in pos] + [(classifier.LABEL_LQ, d, t) for d, t in neg]
    train_ex, test_ex = [], []
    for label, d, t in examples:
        line = classifier.line_of(t, cfg.max_chars)
        (test_ex if classifier.held_out(d, cfg.seed, cfg.heldout_fraction) else train_ex).append((label, line))
    model = classifier.train(train_ex, writer.path("train.txt"), cfg)
    writer.add_file("train.txt", kind="extra")
    model.save_model(str(writer.path(MODEL_FILE)))
    writer.add_file(MODEL_FILE, kind="extra")
    metrics = classifier.prf(classifier.hq_scores(model, [x for _, x in test_ex]),
                             [label == classifier.LABEL_HQ for label, _ in test_ex])
    stats = ds.StageStats()
    for f in files:
        table = ds.read_parquet(f)
        if COLUMN in table.column_names:
            raise ValueError(f"{NAME}: {f} already has a {COLUMN} column; was it scored already?")
        texts = table.column("text").to_pylist()
        scores: list[float] = []
        for i in range(0, len(texts), cfg.batch_rows):
            scores += classifier.hq_scores(model, [classifier.line_of(t or "", cfg.max_chars)
                                                   for t in texts[i:i + cfg.batch_rows]])
        writer.write_table(table.append_column(pa.field(COLUMN, pa.float32()), pa.array(scores, type=pa.float32())))
        n = sum(len((t or "").encode()) for t in texts)
        stats = stats + ds.StageStats(rows_in=table.num_rows, rows_kept=table.num_rows, bytes_in=n, bytes_out=n)
    stats.counters.update({"reference_docs": len(pos), "negative_docs": len(neg), "train_examples": len(train_ex)})
    return {"stats": stats, "extra": {"model_file": MODEL_FILE,
                                      "model_sha256": fs.sha256_file(writer.path(MODEL_FILE)),
                                      "metrics": {f"classifier_{k}": v for k, v in metrics.items()},
                                      "score_column": COLUMN}}


def run_quality(parent: ds.DatasetRef, cfg: QualityConfig, workdir: str) -> ds.DatasetRef:
    """Score every document of `parent` (never dropping one) into a committed `quality` dataset."""
    return ds.materialize(workdir, NAME, cfg, code_version(__package__), lambda w: _build(parent, cfg, w),
                          parents=[parent], inputs=resolve_inputs(cfg.reference_inputs))


STAGE = StageCode(run=run_quality)  # what the registry (`lifecycle.tasks.stages`) runs, as one task
