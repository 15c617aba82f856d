"""Readers of a committed token dataset, used by train and evaluate (the dataset itself: `stage.py`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from lifecycle.core import dataset as ds
from lifecycle.core import fs

NAME = "tokenize"


class TokenShards(BaseModel):
    """What a consumer needs to read a committed token dataset."""

    model_config = ConfigDict(frozen=True)
    dataset_sha256: str
    tokenizer_sha256: str
    tokenizer_path: str
    dtype: str
    vocab_size: int
    eot_id: int
    train: list[str]
    val: list[str]
    num_tokens: dict[str, int]

    def memmap(self, split: str) -> list[np.memmap]:
        """Read-only maps of a split's shards (recreate them per batch in long loops: see train_loop)."""
        return [np.memmap(p, dtype=self.dtype, mode="r") for p in getattr(self, split) if Path(p).stat().st_size]


def token_shards(ref: ds.DatasetRef) -> TokenShards:
    m = ref.manifest()
    if m.get("stage") != NAME or "tokenizer_sha256" not in m:
        raise ValueError(f"{ref.manifest_path} is not a tokenize dataset (stage={m.get('stage')!r})")
    d = ref.dir
    return TokenShards(
        dataset_sha256=ref.sha256,
        tokenizer_sha256=m["tokenizer_sha256"],
        tokenizer_path=str(d / m["tokenizer_file"]),
        dtype=m["dtype"],
        vocab_size=m["vocab_size"],
        eot_id=m["eot_id"],
        train=[str(d / p) for p in m["shards"]["train"]],
        val=[str(d / p) for p in m["shards"]["val"]],
        num_tokens=m["num_tokens"],
    )


def load_tokenizer(ref: ds.DatasetRef):
    """The trained `tokenizers.Tokenizer`, after checking its sha256 against the manifest."""
    from tokenizers import Tokenizer

    meta = token_shards(ref)
    actual = fs.sha256_file(meta.tokenizer_path)
    if actual != meta.tokenizer_sha256:
        raise ValueError(f"{meta.tokenizer_path}: sha256 {actual} != manifest {meta.tokenizer_sha256}")
    return Tokenizer.from_file(meta.tokenizer_path)


def hf_tokenizer(ref: ds.DatasetRef):
    """The dataset's tokenizer as `transformers.PreTrainedTokenizerFast` (digest checked first)."""
    from transformers import PreTrainedTokenizerFast

    load_tokenizer(ref)  # raises on a digest mismatch
    return PreTrainedTokenizerFast.from_pretrained(str(ref.dir))
