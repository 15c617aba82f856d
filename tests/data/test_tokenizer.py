import json
import shutil

import numpy as np
import pyarrow as pa
import pytest
from tokenizers import Tokenizer

from lifecycle.core import dataset as ds
from lifecycle.core import fs
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, load_tokenizer, run_tokenize, split_of, token_shards

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def make_docs(workdir, texts: list[str | None], sources: list[str] | None = None,
              urls: list[str | None] | None = None) -> ds.DatasetRef:
    """A committed document dataset (DOC_SCHEMA) holding `texts`, as the scrub stage would hand it over. By
    default every document is a line of one JSONL file (`source` src.jsonl, no url): each is its own split group."""
    n = len(texts)
    sources = sources or ["src.jsonl"] * n
    urls = urls or [None] * n
    table = pa.table(
        {
            "doc_id": [f"d{i:04d}" for i in range(n)],
            "source_id": [f"src.jsonl:{i + 1}" for i in range(n)],
            "text": texts,
            "source": sources,
            "url": urls,
            "meta": ["{}"] * n,
        },
        schema=ds.DOC_SCHEMA,
    )

    def build(w):
        w.write_table(table.slice(0, n // 2))
        w.write_table(table.slice(n // 2))
        return {}

    return ds.materialize(workdir, "scrub", {"texts": texts, "sources": sources, "urls": urls}, "test", build)


def corpus(n: int = 60) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) + f" doc {i}." for i in range(n)]


# several encode batches; no validation floor: these tests check the hash split itself (floor: test_data_checks.py,
# groups: test_split_overlap.py)
CFG = TokenizeConfig(vocab_size=300, min_frequency=2, val_fraction=0.2, seed=1, batch_size=16, min_val_docs=0,
                     min_val_tokens=0)


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
    assert m["tokenizer_sha256"] == fs.sha256_file(ref.dir / "tokenizer.json")
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
    # lines of one JSONL file are independent: each its own group, split by its doc_id hash, deterministically
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


def test_saved_tokenizer_loads_with_transformers(tmp_path):
    from lifecycle.tasks.data.tokenize.stage import hf_tokenizer

    texts = corpus()
    ref = run_tokenize(make_docs(tmp_path, texts), CFG, str(tmp_path))
    tok, hf = load_tokenizer(ref), hf_tokenizer(ref)
    for text in texts[:10] + ["unseen wörds ✓ and <|endoftext|>"]:
        assert hf.encode(text) == tok.encode(text, add_special_tokens=False).ids
        assert hf.decode(hf.encode(text)) == text
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == token_shards(ref).eot_id
    assert hf.pad_token == "<|pad|>" and len(hf) == token_shards(ref).vocab_size
    # the digest is checked before handing the tokenizer out
    (ref.dir / "tokenizer.json").write_text((ref.dir / "tokenizer.json").read_text() + " ")  # still valid JSON
    with pytest.raises(ValueError, match="sha256"):
        hf_tokenizer(ref)


def word_level_tokenizer(path, n_words: int) -> list[str]:
    """A given tokenizer.json (WordLevel over a whitespace split) with `n_words` words plus two specials."""
    from tokenizers import models, pre_tokenizers

    words = [f"w{i}" for i in range(n_words)]
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, "[UNK]": 2} | {w: i + 3 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>", "<|pad|>"])
    tok.save(str(path))
    return words


def test_given_tokenizer_is_used_as_is_and_large_vocab_packs_uint32(tmp_path):
    given = tmp_path / "given.json"
    words = word_level_tokenizer(given, 70_000)  # ids above 65535: shards must be uint32
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words[-200:], size=12)) for _ in range(40)]
    cfg = CFG.model_copy(update={"tokenizer_file": str(given)})
    ref = run_tokenize(make_docs(tmp_path, texts), cfg, str(tmp_path / "w"))
    meta = token_shards(ref)
    assert meta.tokenizer_sha256 == fs.sha256_file(given)  # a byte copy, not a retrained tokenizer
    assert meta.dtype == "uint32" and meta.vocab_size == 70_003
    tok = load_tokenizer(ref)
    for r in ref.read().to_pylist():
        arr = np.fromfile(ref.dir / r["shard"], dtype=np.uint32)
        assert tok.decode(arr[r["token_start"] : r["token_end"]].tolist()) == texts[int(r["doc_id"][1:])]
    assert max(int(np.fromfile(p, dtype=np.uint32).max()) for p in meta.train) > 65535
    assert any(i["sha256"] == meta.tokenizer_sha256 for i in ref.manifest()["inputs"])
    # editing the given file (same path) is a different dataset
    word_level_tokenizer(given, 69_999)
    assert run_tokenize(make_docs(tmp_path, texts), cfg, str(tmp_path / "w")).fingerprint != ref.fingerprint


def test_given_tokenizer_without_eot_is_refused(tmp_path):
    from tokenizers import models

    given = tmp_path / "noeot.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(given))
    with pytest.raises(ValueError, match="eot_token"):
        run_tokenize(make_docs(tmp_path, corpus(5)), CFG.model_copy(update={"tokenizer_file": str(given)}), str(tmp_path))
    with pytest.raises(FileNotFoundError, match="tokenizer_file"):
        run_tokenize(make_docs(tmp_path, corpus(5)), CFG.model_copy(update={"tokenizer_file": str(tmp_path / "x")}),
                     str(tmp_path))


def test_token_dtype_boundary():
    from lifecycle.tasks.data.tokenize.stage import token_dtype

    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
