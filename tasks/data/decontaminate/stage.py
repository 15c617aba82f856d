"""Decontamination: reject training documents that share a word n-gram with an eval item, before tokenize.

GPT-3 removed 13-gram overlaps with its benchmarks; datatrove indexes the n-grams of lighteval tasks. Here the
eval sets are `decontaminate.sets` (files or built-ins, `sets.py`). Every n-gram of every item goes into one
index; a document with any n-gram in it is rejected with reason `contaminated`, its detail naming the set, the
item and the shared words. Every other row is kept unchanged. Off by default: when off the step does not run and
tokenize reads scrub's output, so the default run's fingerprints and outputs are what they were.

Normalisation (`ngrams.py`): lower-cased `\\w+` words, so case, punctuation and whitespace never hide an overlap.
Items shorter than `ngram` words cannot be matched (`NgramIndex.too_short` counts them per set).
"""

from __future__ import annotations

import json
from functools import lru_cache

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lifecycle.core.dataset import StageStats, rejected_table
from lifecycle.core.shards import PerFileStage, map_tables
from lifecycle.tasks.data.decontaminate.ngrams import ngram_hashes, words
from lifecycle.tasks.data.decontaminate.sets import raw_inputs, read_items, resolve_set

NAME = "decontaminate"
REASON = "contaminated"


class DecontaminateConfig(BaseModel):
    """Which eval sets no training document may overlap, and how overlap is counted."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Run the step (between scrub and tokenize). Off: tokenize reads scrub's output directly."""
    sets: tuple[str, ...] = ()
    """Eval sets: built-in names (`humaneval`) or files (.jsonl/.jsonl.gz with a text field, else plain text,
    one item per non-blank line). Their sha256 is in the step's fingerprint."""
    ngram: int = Field(13, ge=1)
    """Words per n-gram (GPT-3: 13; datatrove's lighteval decontamination: 12)."""
    text_fields: tuple[str, ...] = ("text",)
    """JSONL fields whose strings, joined by a newline, are an item's text (the present ones, in this order)."""
    id_fields: tuple[str, ...] = ("id", "task_id", "doc_id")
    """JSONL fields naming an item in the `detail` (first present one); else its line number."""

    @model_validator(mode="after")
    def _sets(self) -> "DecontaminateConfig":
        if self.enabled and not self.sets:
            raise ValueError("decontaminate.enabled is true but decontaminate.sets is empty: name at least one "
                             "eval set (a file, or a built-in such as `humaneval`)")
        if len(set(self.sets)) != len(self.sets):
            raise ValueError(f"decontaminate.sets has duplicates: {list(self.sets)}")
        return self


class NgramIndex:
    """n-gram hash -> (set, item) of the first item holding it, over every item of every set."""

    def __init__(self, items: list[tuple[str, str, str]], n: int):
        self.n = n
        self.index: dict[int, tuple[str, str]] = {}
        self.items: dict[str, int] = {}
        self.too_short: dict[str, int] = {}
        for set_name, item, text in items:
            self.items[set_name] = self.items.get(set_name, 0) + 1
            if len(words(text)) < n:
                self.too_short[set_name] = self.too_short.get(set_name, 0) + 1
            for h, _ in ngram_hashes(text, n):
                self.index.setdefault(h, (set_name, item))

    def match(self, text: str) -> tuple[str, str, str] | None:
        """(set, item, the shared words) of the first n-gram of `text` found in an eval item, or None."""
        w = None
        for h, i in ngram_hashes(text, self.n):
            hit = self.index.get(h)
            if hit is not None:
                w = w or words(text)
                return hit[0], hit[1], " ".join(w[i:i + self.n])
        return None


@lru_cache(maxsize=4)
def build_index(cfg: DecontaminateConfig) -> NgramIndex:
    items = []
    for spec in cfg.sets:
        s = resolve_set(spec)
        items += [(s.name, name, text) for name, text in read_items(s, cfg.text_fields, cfg.id_fields)]
    return NgramIndex(items, cfg.ngram)


def decontaminate_table(table: pa.Table, index: NgramIndex) -> tuple[pa.Table, pa.Table, StageStats]:
    """(kept rows, unchanged; rejected rows with reason `contaminated`; stats)."""
    stats = StageStats(rows_in=table.num_rows)
    keep, rejected = [], []
    ids, sources = table.column("doc_id").to_pylist(), table.column("source_id").to_pylist()
    for i, text in enumerate(table.column("text").to_pylist()):
        nbytes = len((text or "").encode("utf-8"))
        stats.bytes_in += nbytes
        hit = index.match(text)
        if hit is None:
            keep.append(i)
            stats.bytes_out += nbytes
            continue
        set_name, item, shared = hit
        stats.rejected[REASON] += 1
        stats.counters[f"contaminated_{set_name}"] += 1
        rejected.append({"doc_id": ids[i], "source_id": sources[i], "reason": REASON,
                         "detail": json.dumps({"set": set_name, "item": item, "ngram": shared}, sort_keys=True)})
    stats.rows_kept = len(keep)
    kept = table if len(keep) == table.num_rows else table.take(pa.array(keep, type=pa.int64()))
    return kept, rejected_table(rejected, NAME), stats


def decontaminate_shard(cfg: DecontaminateConfig, files: list[str], writer) -> StageStats:
    index = build_index(cfg)
    return map_tables(files, writer, lambda t: decontaminate_table(t, index))


def set_inputs(cfg: DecontaminateConfig) -> list:
    """The eval sets as raw inputs: their digests are in the fingerprint."""
    return raw_inputs(cfg.sets)


# one shard per kept file of the parent (each builds the n-gram index of the sets)
STAGE = PerFileStage(NAME, __package__, decontaminate_shard, inputs=set_inputs, grouped=False)
run_decontaminate = STAGE.run
