"""dedup's first half, sharded (`SIGNATURES`, a per-file stage): per parent file, the normalised-text hash,
MinHash signature (or SimHash) and band keys of every row, in the `dedup-signatures` dataset; and `shingles` and
`signature`, datasketch's reference signature the benchmark compares against."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_serializer

from lifecycle.core.dataset import DatasetRef, StageStats
from lifecycle.core.shards import PerFileStage
from lifecycle.tasks.data.dedup.config import SIG_STAGE, DedupConfig
from lifecycle.tasks.data.dedup.params import MinHashConfig, SimHashConfig

BATCH_DOCS = 4096  # documents per vectorised signature batch (memory ~ batch x words)
_WORD = re.compile(r"\w+", re.UNICODE)
_WORD = re.compile(r"\w+", re.UNICODE)

if TYPE_CHECKING:
    from datasketch import LeanMinHash


def shingles(text: str, n: int) -> set[bytes]:
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {" ".join(words).encode()} if words else set()
    return {" ".join(words[i : i + n]).encode() for i in range(len(words) - n + 1)}


def signature(sh: set[bytes], p: MinHashConfig) -> LeanMinHash:
    """datasketch's own per-document signature (SHA-1 shingle hashes): the reference the benchmark compares
    against. The stage itself uses `lifecycle.tasks.data.dedup.minhash.signatures`."""
    from datasketch import LeanMinHash, MinHash  # here, not at the top: datasketch imports scipy (seconds)

    m = MinHash(num_perm=p.num_perm, seed=p.seed)
    if sh:
        m.update_batch(list(sh))
    return LeanMinHash(m)


class SignatureConfig(BaseModel):
    """What a signature file depends on (a `DedupConfig` minus the decisions made from the signatures)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    params: MinHashConfig = Field(description="`dedup.minhash`, without `verify_jaccard` (a decision).")
    minhash: bool = Field(description="Compute signatures and band keys (false: exact dedup only, hashes alone).")
    simhash: SimHashConfig | None = Field(None, description="Compute SimHashes and their table keys instead.")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """As fingerprinted before `dedup.minhash` was a section: its signature fields at the top, beside the
        `minhash` flag; no `simhash` key without SimHash."""
        d = handler(self)
        d = {**self.params.signature_fields(), **{k: v for k, v in d.items() if k != "params"}}
        if d.get("simhash", 0) is None:
            del d["simhash"]
        return d


def signature_config(cfg: DedupConfig) -> SignatureConfig:
    need = cfg.near or cfg.incremental
    return SignatureConfig(params=cfg.minhash.model_copy(update={"verify_jaccard": None}),
                           minhash=need and cfg.method == "minhash",
                           simhash=cfg.simhash if need and cfg.method == "simhash" else None)


_EXACT_HASH = r"md5(regexp_replace(lower(trim(text)), '\s+', ' ', 'g'))"  # lower-case, collapsed whitespace


def warm_signatures(cfg: SignatureConfig) -> None:
    """Load numba and the compiled MinHash kernel once in the worker, before its shard processes fork
    (`lifecycle.core.shards.warm_worker`), instead of once in each (its cost: docs/benchmarks.md, "Data stages")."""
    if cfg.minhash:
        from lifecycle.tasks.data.dedup import minhash as minhash_module

        p = cfg.params
        minhash_module.signatures(["warm up the kernel"], p.ngram, p.num_perm, p.seed)


def signature_shard(cfg: SignatureConfig, files: list[str], writer) -> StageStats:
    """One signature file per parent file, rows in the parent's order: doc_id, source_id, exact_hash and,
    with `minhash`, the MinHash signature and its LSH band keys (`lifecycle.tasks.data.dedup.minhash`, one numba kernel)."""
    from lifecycle.tasks.data.dedup import minhash as minhash_module  # numba: only where signatures are computed

    stats = StageStats()
    con = duckdb.connect()
    try:
        for path in files:
            t = con.sql(f"SELECT doc_id, source_id, {_EXACT_HASH} AS exact_hash, text FROM read_parquet($f, "
                        "file_row_number = true) ORDER BY file_row_number", params={"f": path}).to_arrow_table()
            text = t.column("text").combine_chunks()
            out = t.drop_columns(["text"])
            if cfg.minhash:
                p = cfg.params
                sig = np.zeros((t.num_rows, p.num_perm), np.uint32)
                for start in range(0, t.num_rows, BATCH_DOCS):  # a signature does not depend on its batch
                    sig[start : start + BATCH_DOCS] = minhash_module.signatures(
                        text.slice(start, BATCH_DOCS), p.ngram, p.num_perm, p.seed)
                keys = minhash_module.band_keys(sig, p.bands, p.rows)
                out = out.append_column("band_keys", _fixed_list(keys, pa.uint64()))
                out = out.append_column("signature", _fixed_list(sig, pa.uint32()))
            if cfg.simhash is not None:
                from lifecycle.tasks.data.dedup import simhash as simhash_module

                sh = cfg.simhash
                h = np.concatenate([simhash_module.simhashes(text.slice(s, BATCH_DOCS), sh.ngram)
                                    for s in range(0, t.num_rows, BATCH_DOCS)] or [np.zeros(0, np.uint64)])
                keys = simhash_module.table_keys(h, sh.k, sh.blocks)
                out = out.append_column("band_keys", _fixed_list(keys.reshape(len(h), -1), pa.uint64()))
                out = out.append_column("simhash", pa.array(h.view(np.int64), pa.int64()))
            writer.write_table(out)
            stats.rows_in += t.num_rows
            stats.rows_kept += t.num_rows
            stats.bytes_in += pc.sum(pc.binary_length(text)).as_py() or 0
    finally:
        con.close()
    return stats


def _fixed_list(a: np.ndarray, t: pa.DataType) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(a.ravel(), t), a.shape[1])


def _matrix(col: pa.ChunkedArray | pa.Array, width: int, dtype) -> np.ndarray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks else pa.array([], pa.list_(pa.uint8(), width))
    return col.flatten().to_numpy().astype(dtype, copy=False).reshape(-1, width) if len(col) else np.zeros((0, width), dtype)


def _signature_config(parent: DatasetRef, cfg: DedupConfig) -> SignatureConfig:
    return signature_config(cfg)


# the sharded half: one signature file per kept file of the parent (small files grouped in a shard)
SIGNATURES = PerFileStage(SIG_STAGE, __package__, signature_shard, warm=warm_signatures, config=_signature_config)
plan_signatures = SIGNATURES.plan
