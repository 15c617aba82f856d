"""collect's config: `CollectConfig` (the `collect:` section) and `CollectRun` (it plus the work dir's tombstones),
and `part_bytes`, the bytes of strings a shard buffers before it writes a part."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lifecycle.tasks.data.collect.tombstones import ForgetFilter

BASE_MEMORY = 192 << 20  # a collect process before its rows: the interpreter, pyarrow, trafilatura, warcio
# (measured: docs/benchmarks.md, "Issue 25: memory that does not grow with the input files, and scaling to 862 MB")
_ROW_OVERHEAD = 400  # a buffered row beyond its strings: its dict (7 keys) and list slot


def part_bytes(cfg: "CollectConfig") -> int:
    """Bytes of strings a shard buffers before it writes a part (`max_memory_bytes`' description)."""
    return (cfg.max_memory_bytes - BASE_MEMORY - 4 * cfg.max_line_bytes) // 8


class CollectConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    inputs: list[str] = Field(description=(
        "Glob patterns of input files (.jsonl, .jsonl.gz, .jsonl.zst, .parquet, .txt, .rst, .md, .markdown "
        "(each also .gz/.zst), .html, .warc, .warc.gz)."))
    max_doc_bytes: int = Field(
        8 << 20,
        gt=0,
        description="Documents whose UTF-8 text is larger than this are rejected as `too_large` "
        "(8 MiB: far above any real page, small enough to keep a shard in memory).",
    )
    max_line_bytes: int = Field(
        32 << 20,
        gt=0,
        description="A JSONL line longer than this is rejected as `too_large` without being held in memory "
        "(32 MiB: room for a max_doc_bytes text with JSON escapes and metadata).",
    )
    max_json_depth: int = Field(
        64, gt=0, description="A JSONL record nested deeper than this (objects/arrays) is rejected as `json_too_deep`."
    )
    rows_per_shard: int = Field(20_000, gt=0, description="Kept rows per output Parquet file (at most; a file is "
                                "cut earlier when its rows hold `max_part_bytes`, or more than `max_memory_bytes` "
                                "allows).")
    max_part_bytes: int = Field(
        8 << 20, gt=0, description="A kept output Parquet file (a part) is also cut once its rows' strings hold this "
        "many bytes (8 MiB). Every later stage holds one part at a time, so this, not the size of the input files, "
        "bounds their memory: a 300 MB .jsonl.gz (never split, being compressed) still becomes parts of 8 MiB. "
        "Smaller means more files; the kept rows, their order and every decision are the same at any value.")
    max_memory_bytes: int = Field(
        2 << 30, gt=0, description="Bound on the peak memory of one collect shard (2 GiB), whatever its files "
        "decompress to (a `.jsonl.gz` of 1 MiB lines compresses 1000:1): kept and rejected rows are written out "
        "as soon as the strings they hold reach (max_memory_bytes - 192 MiB - 4 x max_line_bytes) / 8 bytes "
        "(a part is held as Python strings, Arrow arrays and Parquet pages at once, plus the allocator's slack; a "
        "line being read, up to 4 times). Must be at least 192 MiB + 12 x max_line_bytes.")
    incremental: bool = Field(
        False, description="Skip input files (same path and sha256) that a completed earlier run in this work dir "
        "already collected (ledger `<workdir>/collected.parquet`).")
    shard_bytes: int = Field(
        8 << 20, gt=0, description="Input files are grouped, in order, into shards of at most this many raw bytes (a "
        "larger file is a shard of its own); shards are collected in parallel and each is resumable on its own.")
    min_shards: int = Field(
        8, ge=1, description="Smaller input is cut into shards of at most 1/min_shards of its raw bytes (but not "
        "under 256 KiB), so a 24 MB corpus still runs on every worker: files are grouped by that size, and "
        "uncompressed JSONL is split by it. The cut depends on the input alone, not on the worker count, so a "
        "rerun with other workers resumes the same shards.")
    split_bytes: int = Field(
        64 << 20, ge=0, description="An uncompressed JSONL file larger than this (or than the shard size "
        "`min_shards` gives) is split at line boundaries into shards of about that many bytes, so one huge file "
        "is still collected in parallel (0: never split). Compressed files, Parquet, text, HTML and WARC files "
        "are never split.")

    @model_validator(mode="after")
    def _sizes(self) -> "CollectConfig":
        if self.max_line_bytes < self.max_doc_bytes:
            raise ValueError(f"max_line_bytes ({self.max_line_bytes}) must be >= max_doc_bytes ({self.max_doc_bytes})")
        if self.max_memory_bytes < BASE_MEMORY + 12 * self.max_line_bytes:
            raise ValueError(f"max_memory_bytes ({self.max_memory_bytes}) must be >= 192 MiB + 12 x max_line_bytes "
                             f"({BASE_MEMORY + 12 * self.max_line_bytes}): a line is held up to 4 times while it is "
                             "read and parsed, and a part must hold at least one")
        return self



class CollectRun(CollectConfig):
    """The config a collect plan runs with: the user's `CollectConfig` plus the work dir's tombstones (only when
    there are some, so that an empty ledger leaves the fingerprint as it was)."""

    forgotten: ForgetFilter | None = Field(None, description="Tombstones to reject (set by `plan_collect`).")
