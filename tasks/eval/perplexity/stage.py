"""Perplexity under the registered champion model (CCNet's idea, with this project's own model instead of KenLM):
the pipeline scores its next corpus with the model it trained last. Like the quality step it writes a score
column and never drops a row; `select` may keep rows by it (lower perplexity is better there).

The flow resolves the registry's champion (the alias `lineage.registry` moves, found by the same
`Registry.champion_package` as `train.init_from: champion`) and hands this stage a `ScoringModel`: the packaged
model's directory, its registered version and the package's sha256. Version and sha256 are part of the dataset's
fingerprint (`PerplexityRun`): a new champion rescores, the same champion reuses the scores. With no champion the
flow skips the stage and says why; nothing here runs.

Score: per document, exp of the mean next-token negative log-likelihood over its first `max_tokens` tokens
(capped at the model's context), tokenized with the champion's own packaged tokenizer and preceded by its
document-start token (the BOS the packaged tokenizer names, our BPE's `<|endoftext|>`, which ends every document
in the training stream), so the first token is scored too. Documents are batched by length (right padding: with
causal attention a pad never changes an earlier position), under `threads` torch threads. Column
`quality_perplexity`, float32; a document with no token gets null (select never keeps a null).

The package lives in the eval layer because it loads the training layer's model; no data stage imports it.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core import dataset as ds
from lifecycle.core.code import code_version
from lifecycle.core.shards import StageCode

NAME = "perplexity"
COLUMN = "quality_perplexity"  # `quality_*`: carried into the token side table, shown by `lineage doc`


class PerplexityConfig(BaseModel):
    """Scoring documents by their perplexity under the registered champion model."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Score documents with the champion (and let `select` choose on `quality_perplexity`). With no champion
    registered yet the step is skipped, with the reason on the run, and the run goes on."""
    max_tokens: int = Field(256, ge=1)
    """Tokens of a document that are scored (its first ones); the model's context (`seq_len`) caps it too."""
    batch_docs: int = Field(8, ge=1)
    """Documents per forward pass (sorted by length within a file, to pad little). On the demo-size model, one
    thread: 4-8 scored ~1.3x the documents per CPU-second of 1, 32 less than 8 (its logits outgrow the cache)."""
    threads: int | None = Field(None, ge=1)
    """torch threads while scoring (restored afterwards); null: the machine's cores, at most 4."""


class ScoringModel(BaseModel):
    """The champion the flow found: where its package is, which registered version it is, the package's sha256."""

    model_config = ConfigDict(frozen=True)
    version: str
    package_dir: str
    package_sha256: str

    @classmethod
    def of_package(cls, version: str, package_dir: str | Path) -> "ScoringModel":
        """Read the package's committed manifest (DatasetDamaged, naming it, when it cannot be read)."""
        return cls(version=str(version), package_dir=str(package_dir),
                   package_sha256=ds.DatasetRef.from_dir(Path(package_dir)).sha256)


class PerplexityRun(PerplexityConfig):
    """The fingerprinted config of one scoring: the section plus the champion's identity (not its path)."""

    champion_version: str
    champion_package_sha256: str


@contextlib.contextmanager
def torch_threads(n: int | None):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n or max(1, min(os.cpu_count() or 1, 4)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Scorer:
    """A loaded champion: `perplexities(texts)` -> one float (or None for a document without tokens) each."""

    def __init__(self, package_dir: str | Path, cfg: PerplexityConfig):
        from lifecycle.tasks.eval.export import load_model_dir, special_tokens

        self.model, self.tokenizer = load_model_dir(package_dir)
        self.cfg = cfg
        self.limit = min(cfg.max_tokens, self.model.cfg.seq_len)  # predicted tokens per document
        start = special_tokens(Path(package_dir) / "tokenizer.json").get("bos_token")
        self.start = self.tokenizer.token_to_id(start) if start else None  # None: the first token is context only

    def ids(self, texts: list[str]) -> list[list[int]]:
        prefix = [] if self.start is None else [self.start]
        return [(prefix + e.ids)[: self.limit + 1]
                for e in self.tokenizer.encode_batch([t or "" for t in texts], add_special_tokens=False)]

    def perplexities(self, texts: list[str]) -> list[float | None]:
        import torch
        import torch.nn.functional as F

        seqs = self.ids(texts)
        out: list[float | None] = [None] * len(seqs)
        order = sorted((i for i, s in enumerate(seqs) if len(s) >= 2), key=lambda i: (len(seqs[i]), i))
        with torch.no_grad():
            for b in range(0, len(order), self.cfg.batch_docs):
                idx = order[b: b + self.cfg.batch_docs]
                T = max(len(seqs[i]) for i in idx) - 1
                x = torch.zeros((len(idx), T), dtype=torch.long)
                y = torch.full((len(idx), T), -100, dtype=torch.long)  # -100: cross_entropy's ignore_index
                for r, i in enumerate(idx):
                    s = torch.tensor(seqs[i], dtype=torch.long)
                    x[r, : len(s) - 1], y[r, : len(s) - 1] = s[:-1], s[1:]
                logits, _ = self.model(x)
                nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(len(idx), T)
                counts = (y != -100).sum(1)
                for r, i in enumerate(idx):
                    out[i] = math.exp(nll[r].sum().item() / counts[r].item())
        return out


def _build(parent: ds.DatasetRef, cfg: PerplexityRun, model: ScoringModel, writer: ds.DatasetWriter) -> dict:
    stats = ds.StageStats()
    scored = 0
    with torch_threads(cfg.threads):
        scorer = Scorer(model.package_dir, cfg)
        for f in parent.files():
            table = ds.read_parquet(f)
            if COLUMN in table.column_names:
                raise ValueError(f"{NAME}: {f} already has a {COLUMN} column; was it scored already?")
            texts = table.column("text").to_pylist()
            scores = scorer.perplexities(texts)
            writer.write_table(table.append_column(pa.field(COLUMN, pa.float32()), pa.array(scores, pa.float32())))
            n = sum(len((t or "").encode()) for t in texts)
            stats = stats + ds.StageStats(rows_in=table.num_rows, rows_kept=table.num_rows, bytes_in=n, bytes_out=n)
            scored += sum(s is not None for s in scores)
    stats.counters.update({"scored_docs": scored, "unscored_docs": stats.rows_in - scored})
    return {"stats": stats, "extra": {"score_column": COLUMN, "scoring_model": {
        "version": model.version, "package_sha256": model.package_sha256, "package_dir": model.package_dir,
        "scored_tokens_cap": scorer.limit}}}


def run_perplexity(parent: ds.DatasetRef, cfg: PerplexityConfig, workdir: str,
                   model: ScoringModel | None = None) -> ds.DatasetRef:
    """Score every document of `parent` (never dropping one) with the champion `model` into a committed dataset."""
    if model is None:
        raise ValueError(f"{NAME}: no scoring model given; the flow skips this stage when no champion is "
                         "registered (perplexity.enabled needs a registered champion)")
    run = PerplexityRun(**cfg.model_dump(), champion_version=model.version,
                        champion_package_sha256=model.package_sha256)
    return ds.materialize(workdir, NAME, run, code_version(__package__),
                          lambda w: _build(parent, run, model, w), parents=[parent])


STAGE = StageCode(run=run_perplexity)  # what the registry (`lifecycle.tasks.stages`) runs, as one task
