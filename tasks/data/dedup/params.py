"""The near-duplicate methods' parameters, declared once: dedup's `minhash:` and `simhash:` sections.

dedup makes its signatures and decisions with them, keys its signature datasets and its persisted index on them,
and the tombstone ledger (`lifecycle.tasks.data.collect.tombstones`) records them and matches later documents with
them. Light on purpose (pydantic only): collect reads it through the ledger, and every module collect imports is
part of collect's code version.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MinHashConfig(BaseModel):
    """`dedup.minhash`: MinHash LSH (tasks/data/dedup/minhash.py). Word n-gram shingles, `bands` x `rows`
    permutations; two documents are candidates when they share one band's key (datasketch's
    `MinHashLSH(params=(bands, rows))`). FineWeb's choice is the default: 5-grams, 14 x 8 = 112 permutations,
    about 92% recall at Jaccard 0.8."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ngram: int = Field(5, ge=1, description="Word n-gram size of the shingles (FineWeb: 5).")
    bands: int = Field(14, ge=1, description="LSH bands (FineWeb: 14 bands x 8 rows = 112 permutations).")
    rows: int = Field(8, ge=1, description="LSH rows per band.")
    seed: int = Field(1, description="Seed of the MinHash permutations.")
    verify_jaccard: float | None = Field(
        None, ge=0, le=1, description="If set, merge a candidate pair only when its true shingle Jaccard is >= this.")

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows

    def signature_fields(self) -> dict:
        """What a signature and its band keys depend on (everything but `verify_jaccard`, a decision)."""
        return {"ngram": self.ngram, "bands": self.bands, "rows": self.rows, "seed": self.seed}


class SimHashConfig(BaseModel):
    """`dedup.simhash`, used when `dedup.method` is simhash (tasks/data/dedup/simhash.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    k: int = Field(3, ge=0, description="Near-duplicates: SimHashes at Hamming distance <= k (Manku et al.: 3).")
    blocks: int = Field(6, ge=1, le=64, description="Blocks the 64 bits are cut into (> k); C(blocks, k) tables "
                        "of keys on blocks - k blocks each.")
    ngram: int = Field(3, ge=1, description="Word n-gram size of the SimHash features.")

    @model_validator(mode="after")
    def _tables(self):
        from lifecycle.tasks.data.dedup.simhash import check

        try:
            check(self.k, self.blocks)
        except ValueError as e:
            raise ValueError(str(e)) from None
        return self
