"""dedup's config (`DedupConfig`, the `dedup:` section), what of it enters the fingerprint (`fingerprint_config`), and
the names of its datasets and index files."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from lifecycle.tasks.data.dedup.paragraphs import ParagraphConfig
from lifecycle.tasks.data.dedup.params import MinHashConfig, SimHashConfig
from lifecycle.tasks.data.dedup.substring import SubstringConfig

NAME = "dedup"
SIG_STAGE = "dedup-signatures"  # the sharded first half: one signature file per parent file
INDEX_FILE = "dedup-index.parquet"  # the kept documents' index rows, inside the dataset
INDEX_MANIFEST = "_index.json"


class DedupConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["minhash", "simhash"] = Field(
        "minhash", description="Near-duplicate method (`near`): MinHash LSH (`minhash`) or 64-bit SimHash with "
        "permuted-table blocking (`simhash`). See docs/dedup.md.")
    minhash: MinHashConfig = Field(MinHashConfig(), description="MinHash settings (shingles, permutations, bands, "
                                   "verify_jaccard), used when method is minhash; tombstones record them.")
    simhash: SimHashConfig = Field(SimHashConfig(), description="SimHash settings, used when method is simhash.")
    paragraphs: ParagraphConfig = Field(ParagraphConfig(), description="Paragraph-level exact dedup with a "
                                        "Bloom filter, after document dedup (tasks/data/dedup/paragraphs.py).")
    substring: SubstringConfig = Field(SubstringConfig(), description="Exact-substring dedup with suffix arrays "
                                       "(Lee et al. 2022), after paragraph dedup (tasks/data/dedup/substring.py).")

    exact: bool = Field(True, description="Drop exact duplicates of the normalised text (lowercase, collapsed whitespace).")
    near: bool = Field(True, description="Drop near-duplicates (`method`).")
    incremental: bool = Field(
        True, description="Also drop duplicates of documents kept by earlier dedup runs in this work dir, and "
        "add this run's kept documents to that index (<workdir>/dedup-index/).")

    @model_validator(mode="before")
    @classmethod
    def _minhash_section(cls, data):
        """The MinHash settings were top-level fields before they became the `minhash` section: name the new one."""
        moved = [k for k in MinHashConfig.model_fields if isinstance(data, dict) and k in data]
        if moved:
            raise PydanticCustomError("moved_field", "{old} moved into the `dedup.minhash` section: write {new}", {
                "old": ", ".join(f"`dedup.{k}`" for k in moved),
                "new": ", ".join(f"`dedup.minhash.{k}`" for k in moved)})
        return data


def fingerprint_config(cfg: DedupConfig) -> dict:
    """The config part of the dedup dataset's fingerprint: the method fields only where they are in use, so the
    default (MinHash, no paragraphs, no substrings) fingerprints exactly as before they existed. `substring.shard_bytes`
    never enters it: it changes no result. The `minhash` section's fields stand at the top, where they were before
    it was a section."""
    d = cfg.model_dump(mode="json")
    d.update(d.pop("minhash"))
    if cfg.method == "minhash":
        del d["method"]
    if cfg.method != "simhash":
        del d["simhash"]
    if not cfg.paragraphs.enabled:
        del d["paragraphs"]
    if cfg.substring.enabled:
        del d["substring"]["shard_bytes"]
    else:
        del d["substring"]
    return d
