"""Vectorised MinHash: estimates match true 5-gram Jaccard, edge cases, datasketch's LSH accepts it, and the numba
kernel gives the numpy reference's signatures bit for bit."""

import numpy as np
import pyarrow as pa
import pytest
from datasketch import MinHashLSH

from lifecycle.tasks.data.dedup.minhash import band_keys, lean, signatures, signatures_numpy
from tests.conftest import corpus_records, jaccard

BASE = ("the committee met on tuesday to discuss the budget for the coming year and agreed that the library should "
        "receive additional funding for new books computers and longer opening hours in winter").split()


def test_estimates_track_true_jaccard_and_lsh_finds_near_copies():
    rng = np.random.default_rng(0)
    texts = [" ".join(BASE)]
    for rate in (0.02, 0.05, 0.1, 0.3, 0.6):
        w = list(BASE)
        for i in rng.choice(len(w), max(1, int(rate * len(w))), replace=False):
            w[i] = f"edit{i}"
        texts.append(" ".join(w))
    sig = signatures(texts, 5, 256, 1)
    for t, row in zip(texts[1:], sig[1:]):
        assert abs(lean(sig[0], 1).jaccard(lean(row, 1)) - jaccard(texts[0], t)) < 0.12
    lsh = MinHashLSH(num_perm=256, params=(32, 8))
    for i, row in enumerate(sig):
        lsh.insert(i, lean(row, 1))
    found = set(lsh.query(lean(sig[0], 1)))
    assert 1 in found and 5 not in found  # 2% edits found, 60% edits not


def test_batch_independence_short_and_empty_docs():
    texts = ["", "short text", "!!!", " ".join(BASE), "Short TEXT"]
    sig = signatures(texts, 5, 64, 7)
    assert (sig[0] == 0xFFFFFFFF).all() and (sig[2] == 0xFFFFFFFF).all()  # no words: the empty signature
    assert (sig[1] == sig[4]).all() and not (sig[1] == 0xFFFFFFFF).all()  # one shingle, case-insensitive
    alone = signatures([" ".join(BASE)], 5, 64, 7)[0]
    assert (alone == sig[3]).all()  # a document's signature does not depend on its batch
    small_chunks = signatures_numpy(texts, 5, 64, 7, chunk_shingles=3)
    assert (small_chunks == sig).all()


def test_band_keys_give_datasketch_lsh_candidates():
    """Two signatures share a band key exactly when datasketch's MinHashLSH(params=(bands, rows)) pairs them."""
    rng = np.random.default_rng(1)
    sig = rng.integers(0, 4, size=(300, 14 * 2), dtype=np.uint32)  # tiny alphabet: many shared bands, many not
    keys = band_keys(sig, 14, 2)
    lsh = MinHashLSH(num_perm=28, params=(14, 2))
    for i, row in enumerate(sig):
        lsh.insert(i, lean(row, 1))
    for i in range(0, 300, 7):
        ours = {j for j in range(300) if (keys[j] == keys[i]).any()}
        assert ours == set(lsh.query(lean(sig[i], 1)))
    assert len({j for j in range(300) if (keys[j] == keys[0]).any()}) not in (1, 300)


@pytest.mark.parametrize("parallel", [False, True])
def test_numba_kernel_is_bit_identical_to_the_numpy_reference_on_the_corpus(parallel):
    texts = [r["text"] for r in corpus_records(100_000, every_file=True)]  # the whole bundled corpus, ASCII and non-ASCII documents
    assert any(not t.isascii() for t in texts)
    for n, num_perm, seed in ((5, 112, 1), (3, 64, 7)):
        assert (signatures(texts, n, num_perm, seed, parallel=parallel) == signatures_numpy(texts, n, num_perm, seed)).all()


def test_numba_kernel_word_split_edge_cases():
    """Unicode letters/digits/_ are word characters, everything else splits; upper case folds, also outside ASCII."""
    texts = ["", "   ", "!!!", "A", "a_b c9 D\tE\nF", "Ünïcödé WÖRDS — split, here; then ÆØÅ ΣΑΣ", "İstanbul İİ x y z w",
             "日本語のテキスト 中文 한국어 text mixed with ascii", "emoji 🙂 between🙂words and ２３ fullwidth",
             "café CAFÉ Café", "x" * 1000, "a-b-c-d-e-f-g", "deva: नमस्ते दुनिया", "\x00\x01 ctrl \x7f"]
    ref = signatures_numpy(texts, 5, 32, 3)
    for parallel in (False, True):
        assert (signatures(texts, 5, 32, 3, parallel=parallel) == ref).all()
        assert (signatures(pa.array(texts), 5, 32, 3, parallel=parallel) == ref).all()  # an Arrow array as input
        assert (signatures(pa.array(texts).slice(4), 5, 32, 3, parallel=parallel) == ref[4:]).all()
    assert (signatures(texts[-5:-4], 5, 32, 3) == ref[-5]).all()  # batch independence
