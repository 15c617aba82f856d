"""The tokenizer of a base model (a Hugging Face checkpoint directory), for `tokenize.base_model`.

Torch-free: reads `config.json`, `tokenizer.json` and, when present, `tokenizer_config.json` as JSON. The stage
encodes with the model's own `tokenizer.json` (no BPE is trained) and frames every document as the model's
config says: BOS first when the config has a `bos_token_id` that differs from its `eos_token_id` (and
`tokenizer_config.json` does not say `add_bos_token: false`), EOS (`eos_token_id`; the first of a list) last.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

CONFIG, TOKENIZER, TOKENIZER_CONFIG = "config.json", "tokenizer.json", "tokenizer_config.json"


class BaseTokenizerError(ValueError):
    """A base model directory whose tokenizer cannot be used as it is."""


class BaseTokens(BaseModel):
    """What the tokenize stage takes from a base model directory."""

    model_config = ConfigDict(frozen=True)
    tokenizer: str
    """Path of its tokenizer.json."""
    bos_id: int | None
    """Token put before every document, or None."""
    eos_id: int
    """Token put after every document (the shards' end-of-text id)."""
    embedding_rows: int
    """The model's `vocab_size`: every token id must be below it."""


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise BaseTokenizerError(f"{path}: missing (a base model directory needs {CONFIG} and {TOKENIZER})")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BaseTokenizerError(f"{path}: not readable JSON ({e})") from None


def tokenizer_rows(path: Path) -> int:
    """One past the largest id of a tokenizer.json (its model vocabulary and its added tokens)."""
    tok = read_json(path)
    vocab = (tok.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # Unigram: a list
    ids += [t["id"] for t in tok.get("added_tokens") or []]
    if not ids:
        raise BaseTokenizerError(f"{path}: no vocabulary")
    return max(ids) + 1


def base_tokens(base_dir: str | Path) -> BaseTokens:
    """BOS/EOS ids and the tokenizer of a base model directory, checked: the tokenizer's ids fit the embedding."""
    d = Path(base_dir).expanduser().resolve()
    cfg = read_json(d / CONFIG)
    tok_path = d / TOKENIZER
    rows = cfg.get("vocab_size")
    if not isinstance(rows, int):
        raise BaseTokenizerError(f"{d / CONFIG}: vocab_size={rows!r} is not a number of embedding rows")
    n = tokenizer_rows(tok_path)
    if n > rows:
        raise BaseTokenizerError(f"{tok_path}: the tokenizer has ids up to {n - 1} but the model's embedding has "
                                 f"{rows} rows (vocab_size in {d / CONFIG})")
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int):
        raise BaseTokenizerError(f"{d / CONFIG}: eos_token_id={cfg.get('eos_token_id')!r}: documents need an EOS")
    bos = cfg.get("bos_token_id")
    tok_cfg = read_json(d / TOKENIZER_CONFIG) if (d / TOKENIZER_CONFIG).is_file() else {}
    if not isinstance(bos, int) or bos == eos or tok_cfg.get("add_bos_token") is False:
        bos = None
    for name, i in (("eos_token_id", eos), ("bos_token_id", bos)):
        if i is not None and not 0 <= i < n:
            raise BaseTokenizerError(f"{d / CONFIG}: {name}={i} is not a token of {tok_path}")
    return BaseTokens(tokenizer=str(tok_path), bos_id=bos, eos_id=eos, embedding_rows=rows)
