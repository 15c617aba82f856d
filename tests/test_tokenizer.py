import json
import shutil

import numpy as np
import pyarrow as pa
import pytest
from tokenizers import Tokenizer

from lifecycle import dataset as ds
from tasks.tokenizer import TokenizeConfig, load_tokenizer, run_tokenize, split_of, token_shards

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def make_docs(workdir, texts: list[str | None]) -> ds.DatasetRef:
    """A committed document dataset (DOC_SCHEMA) holding `texts`, as the scrub stage would hand it over."""
    n = len(texts)
    table = pa.table(
        {
            "doc_id": [f"d{i:04d}" for i in range(n)],
            "source_id": [f"src.jsonl:{i + 1}" for i in range(n)],
            "text": texts,
            "source": ["src.jsonl"] * n,
            "url": [None] * n,
            "meta": ["{}"] * n,
        },
        schema=ds.DOC_SCHEMA,
    )

    def build(w):
        w.write_table(table.slice(0, n // 2))
        w.write_table(table.slice(n // 2))
        return {}

    return ds.materialize(workdir, "scrub", {"texts": texts}, "test", build)


def corpus(n: int = 60) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) + f" doc {i}." for i in range(n)]


CFG = TokenizeConfig(vocab_size=300, min_frequency=2, val_fraction=0.2, seed=1, batch_size=16)  # several encode batches


def test_tokenize_round_trip_shards_and_side_table(tmp_path):
    texts = corpus() + ["", None]
    parent = make_docs(tmp_path, texts)
    ref = run_tokenize(parent, CFG, str(tmp_path))
    meta = token_shards(ref)
    m = ref.manifest()
    tok = load_tokenizer(ref)

    # accounting: every input document is packed or rejected with a reason
    assert ref.num_rows == 60 and m["num_rejected"] == 2
    rej = ref.read_rejected()
    assert set(rej.column("doc_id").to_pylist()) == {"d0060", "d0061"}
    assert set(rej.column("reason").to_pylist()) == {"empty_after_tokenize"}

    # manifest extras describe the shards exactly
    assert meta.dtype == "uint16" and meta.vocab_size == tok.get_vocab_size()
    assert meta.eot_id == tok.token_to_id("<|endoftext|>")
    assert m["tokenizer_sha256"] == ds.sha256_file(ref.dir / "tokenizer.json")
    extra = {e["path"] for e in m["extra"]}
    assert {"tokenizer.json", "train-00000.bin", "val-00000.bin"} <= extra

    side = ref.read().to_pylist()
    by_id = {r["doc_id"]: r for r in side}
    for split in ("train", "val"):
        arr = np.fromfile(getattr(meta, split)[0], dtype=np.uint16)
        assert arr.size == meta.num_tokens[split]  # shard = exact token count
        rows = sorted((r for r in side if r["split"] == split), key=lambda r: r["token_start"])
        assert rows, f"no {split} documents"
        # ranges tile the shard: doc tokens, then one end-of-text, then the next doc
        assert rows[0]["token_start"] == 0 and rows[-1]["token_end"] + 1 == arr.size
        for a, b in zip(rows, rows[1:]):
            assert b["token_start"] == a["token_end"] + 1
        assert int((arr == meta.eot_id).sum()) == len(rows)
        for r in rows:  # every range decodes back to its document
            assert r["shard"] == f"{split}-00000.bin"
            assert arr[r["token_end"]] == meta.eot_id
            text = texts[int(r["doc_id"][1:])]
            assert tok.decode(arr[r["token_start"] : r["token_end"]].tolist()) == text
            assert split_of(r["doc_id"], CFG) == split
    # val split is by document and deterministic by doc_id hash
    assert {d for d, r in by_id.items() if r["split"] == "val"} == {
        f"d{i:04d}" for i in range(60) if split_of(f"d{i:04d}", CFG) == "val"
    }
    assert 0 < m["num_docs"]["val"] < 30


def test_tokenizer_trained_on_train_split_only(tmp_path):
    # A word that only occurs in validation documents must not become a token.
    texts = corpus()
    val_ids = [i for i in range(len(texts)) if split_of(f"d{i:04d}", CFG) == "val"]
    for i in val_ids:
        texts[i] = "zyzzyvaqq " * 20
    cfg = CFG.model_copy(update={"vocab_size": 600})  # room for every train word to become one token
    ref = run_tokenize(make_docs(tmp_path, texts), cfg, str(tmp_path))
    tok = Tokenizer.from_file(str(ref.dir / "tokenizer.json"))
    assert tok.get_vocab_size() < 600  # the vocabulary was not exhausted, yet...
    assert len(tok.encode(" quick").ids) == 1
    assert len(tok.encode(" zyzzyvaqq").ids) > 3  # ...the validation-only word was never merged


def test_rerun_is_reused_and_config_changes_fingerprint(tmp_path):
    parent = make_docs(tmp_path, corpus())
    first = run_tokenize(parent, CFG, str(tmp_path))
    again = run_tokenize(parent, CFG, str(tmp_path))
    assert not first.reused and again.reused and again.sha256 == first.sha256
    other = run_tokenize(parent, CFG.model_copy(update={"seed": 2}), str(tmp_path))
    assert other.fingerprint != first.fingerprint
    # BPE training is deterministic: the same texts give a byte-identical tokenizer
    shutil.rmtree(first.dir)
    rebuilt = run_tokenize(parent, CFG, str(tmp_path))
    assert not rebuilt.reused and rebuilt.manifest()["tokenizer_sha256"] == first.manifest()["tokenizer_sha256"]
    assert rebuilt.sha256 == first.sha256


def test_config_validation():
    with pytest.raises(ValueError, match="eot_token"):
        TokenizeConfig(special_tokens=("<|pad|>",))
    with pytest.raises(ValueError, match="extra"):
        TokenizeConfig(vocab=10)
    assert json.loads(CFG.model_dump_json())["vocab_size"] == 300
