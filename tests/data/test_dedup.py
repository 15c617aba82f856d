"""dedup: exact duplicates (normalised), MinHash near-duplicates, clusters and the keep policy."""

import json

import numpy as np
import pyarrow as pa
from tests.conftest import corpus_records
from datasketch import MinHashLSH

from lifecycle.lineage.charts import funnel_rows

from lifecycle.tasks.data.collect.stage import CollectConfig, run_collect
from lifecycle.tasks.data.dedup.stage import DedupConfig, run_dedup, shingles, signature

BASE = ("the committee met on tuesday to discuss the budget for the coming year and agreed that the "
        "library should receive additional funding for new books computers and longer opening hours in winter")


def make(tmp_path, texts):
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return run_collect(CollectConfig(inputs=[str(p)]), str(tmp_path / "w"))


def test_exact_near_and_unique(tmp_path):
    texts = [
        BASE,                                      # d0 kept, cluster of 3
        "  " + BASE.upper().replace(" ", "\n  "),  # d1 exact duplicate after normalisation
        BASE.replace("winter", "summer"),          # d2 near duplicate (one word changed)
        "an entirely different document about river fishing licences and the rules for catching trout in spring",
    ]
    ref = run_dedup(make(tmp_path, texts), DedupConfig(), str(tmp_path / "w"))
    kept = ref.read().to_pylist()
    assert [r["source_id"] for r in kept] == ["d0", "d3"]
    assert kept[0]["cluster_size"] == 3 and kept[0]["cluster_id"] == kept[0]["doc_id"]
    assert kept[1]["cluster_size"] == 1
    rej = {r["source_id"]: r for r in ref.read_rejected().to_pylist()}
    keeper = kept[0]["doc_id"]
    assert {sid: (r["reason"], r["duplicate_kind"], r["duplicate_of"]) for sid, r in rej.items()} == {
        "d1": ("duplicate", "exact", keeper), "d2": ("duplicate", "near", keeper)}
    assert rej["d1"]["detail"] == f"exact duplicate of {keeper}" and rej["d2"]["detail"] == f"near duplicate of {keeper}"
    s = ref.manifest()["stats"]
    assert s["rows_in"] == 4 == s["rows_kept"] + s["rows_rejected"]
    assert s["rejected_by_reason"] == {"duplicate": 2}
    assert s["counters"] == {"duplicate_exact": 1, "duplicate_near": 1}  # the kinds are counted, not lost
    # the funnel chart shows the one reason split by kind
    assert funnel_rows({"dedup": ref.manifest()})[0]["top_reasons"] == [("duplicate (exact)", 1), ("duplicate (near)", 1)]


def test_switches_and_verification(tmp_path):
    texts = [BASE, BASE, BASE.replace("winter", "summer")]
    parent = make(tmp_path, texts)
    only_exact = run_dedup(parent, DedupConfig(near=False), str(tmp_path / "w"))
    assert [r["source_id"] for r in only_exact.read().to_pylist()] == ["d0", "d2"]
    only_near = run_dedup(parent, DedupConfig(exact=False), str(tmp_path / "w"))
    assert [r["source_id"] for r in only_near.read().to_pylist()] == ["d0"]
    assert only_near.read().to_pylist()[0]["cluster_size"] == 3
    # a strict true-Jaccard check refuses the near pair (Jaccard of 5-gram sets is about 0.85 here)
    strict = run_dedup(parent, DedupConfig(minhash={"verify_jaccard": 0.99}), str(tmp_path / "w"))
    assert [r["source_id"] for r in strict.read().to_pylist()] == ["d0", "d2"]


def test_distinct_documents_are_not_merged(tmp_path):
    texts = [BASE, "completely unrelated prose about mountains glaciers valleys and the weather in the alps today"]
    ref = run_dedup(make(tmp_path, texts), DedupConfig(), str(tmp_path / "w"))
    assert ref.num_rows == 2 and ref.read_rejected().num_rows == 0


def test_shingles():
    assert shingles("A b, c d e f", 5) == {b"a b c d e", b"b c d e f"}
    assert shingles("short text", 5) == {b"short text"}
    assert shingles("", 5) == set()


def _edit(text: str, rate: float, rng) -> str:
    """Replace a fraction `rate` of the words with fresh tokens (word-level edits)."""
    w = text.split()
    k = int(round(rate * len(w)))
    for i in rng.choice(len(w), k, replace=False) if k else []:
        w[i] = f"zq{rng.integers(1 << 30)}"
    return " ".join(w)


def _jaccard(a: str, b: str, n: int = 5) -> float:
    x, y = shingles(a, n), shingles(b, n)
    return len(x & y) / max(1, len(x | y))


def _reference_kept(texts: list[str], cfg: DedupConfig) -> list[int]:
    """The previous near-duplicate path: datasketch's per-document signature + MinHashLSH + union-find."""
    p = cfg.minhash
    lsh = MinHashLSH(num_perm=p.num_perm, params=(p.bands, p.rows))
    sigs = [signature(shingles(t, p.ngram), p) for t in texts]
    for i, s in enumerate(sigs):
        lsh.insert(i, s)
    root = list(range(len(texts)))

    def find(i):
        while root[i] != i:
            i = root[i]
        return i

    for i, s in enumerate(sigs):
        for j in lsh.query(s):
            a, b = find(i), find(j)
            root[max(a, b)] = min(a, b)
    return [i for i in range(len(texts)) if find(i) == i]


def test_vectorised_signatures_make_the_same_decisions_as_datasketch(tmp_path):
    """The stage's vectorised signatures and band keys keep the same documents as datasketch's MinHash +
    MinHashLSH on real documents with planted near-copies (J >= 0.9) and far copies (50-70% edits, J < 0.3).
    Between those, both decide at random (that is LSH), so the zone is left to the quality test."""
    rng = np.random.default_rng(3)
    base = [r["text"] for r in corpus_records(400) if len(r["text"].split()) >= 150][:120]
    texts = list(base)
    for t in base[:40]:
        texts.append(_edit(t, 0.005, rng))
        assert _jaccard(t, texts[-1]) >= 0.9
    for t in base[40:80]:
        texts.append(_edit(t, float(rng.uniform(0.5, 0.7)), rng))
        assert _jaccard(t, texts[-1]) < 0.3
    cfg = DedupConfig(exact=False, incremental=False)
    ref = run_dedup(make(tmp_path, texts), cfg, str(tmp_path / "w"))
    ours = sorted(int(r["source_id"][1:]) for r in ref.read().to_pylist())
    assert ours == _reference_kept(texts, cfg)
    assert set(range(120, 160)).isdisjoint(ours) and set(range(160, 200)) <= set(ours)


def test_empty_parent(tmp_path):
    parent = make(tmp_path, [""])  # collect rejects the empty text: a parent dataset without files
    assert parent.num_rows == 0
    ref = run_dedup(parent, DedupConfig(), str(tmp_path / "w"))
    assert ref.num_rows == 0 and ref.manifest()["stats"]["rows_in"] == 0


def test_signature_batches_do_not_change_the_output(tmp_path, monkeypatch):
    texts = [BASE, BASE.replace("winter", "summer"), "short one", BASE.upper(), BASE.replace("books", "maps")]
    parent = make(tmp_path, texts)
    whole = run_dedup(parent, DedupConfig(), str(tmp_path / "a"))
    monkeypatch.setattr("lifecycle.tasks.data.dedup.signatures.BATCH_DOCS", 2)
    batched = run_dedup(parent, DedupConfig(), str(tmp_path / "b"))
    assert batched.sha256 == whole.sha256 and whole.read_rejected().num_rows >= 2


def test_decisions_do_not_depend_on_how_the_parent_is_split_into_files(tmp_path):
    """Signatures are computed per parent file (one shard each) and decided globally: the same documents split
    over many files give the same kept rows and the same duplicate links, with the true-Jaccard check reading
    back candidate texts across files."""
    texts = [BASE, "unrelated words about river fishing licences and trout in the spring season", BASE.upper(),
             BASE.replace("winter", "summer"), "short one", BASE.replace("books", "maps"), "short one"]
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))

    def outcome(rows_per_shard, cfg):
        wd = str(tmp_path / f"w{rows_per_shard}")
        parent = run_collect(CollectConfig(inputs=[str(p)], rows_per_shard=rows_per_shard), wd)
        ref = run_dedup(parent, cfg, wd)
        by_id = {r["doc_id"]: r["source_id"] for r in parent.read().to_pylist()}
        return (len(parent.files()), [(r["source_id"], r["cluster_size"]) for r in ref.read().to_pylist()],
                sorted((r["source_id"], by_id[r["duplicate_of"]], r["duplicate_kind"])
                       for r in ref.read_rejected().to_pylist()))

    for cfg in (DedupConfig(), DedupConfig(minhash={"verify_jaccard": 0.5}), DedupConfig(minhash={"verify_jaccard": 0.99})):
        one, split = outcome(100, cfg), outcome(2, cfg)
        assert one[0] == 1 and split[0] == 4 and one[1:] == split[1:], cfg
    links = outcome(2, DedupConfig())[2]
    assert {("d2", "d0", "exact"), ("d3", "d0", "near"), ("d6", "d4", "exact")} <= set(links), links
    assert outcome(2, DedupConfig(minhash={"verify_jaccard": 0.99}))[2] == [("d2", "d0", "exact"), ("d6", "d4", "exact")]


def test_catalog_knows_the_signature_files():
    """lifecycle.lineage.catalog names dedup's signature stage and index file without importing it (numba)."""
    from lifecycle.lineage import catalog
    from lifecycle.tasks.data.dedup import stage as dedup

    assert (catalog.SIG_STAGE, catalog.INDEX_FILE) == (dedup.SIG_STAGE, dedup.INDEX_FILE)


def _union_find_roots(n, edges):
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in edges:
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)
    return {v: find(v) for e in edges for v in e}


def test_components_in_duckdb_match_union_find():
    """The global half's connected components (large-star / small-star in DuckDB) equal a union-find's, with
    the smallest node as the root, on random graphs and on long chains, also with shuffled node numbers; a chain
    converges in O(log n) rounds, not n."""
    import duckdb

    from lifecycle.tasks.data.dedup.stage import components

    rng = np.random.default_rng(0)
    chain = [(i + 1, i) for i in range(4096)]
    perm = rng.permutation(4097)  # the same chain with its nodes in random order: labels do not follow the path
    cases = [chain, list(reversed(chain)), [(int(max(perm[i + 1], perm[i])), int(min(perm[i + 1], perm[i])))
                                            for i in range(4096)],
             [(2 * i + 1, 2 * i) for i in range(2000)] + [(4000 - i, 3999 - i) for i in range(0, 3990, 7)]]
    for _ in range(5):
        a = rng.integers(0, 3000, 2500)
        b = rng.integers(0, 3000, 2500)
        cases.append([(int(max(x, y)), int(min(x, y))) for x, y in zip(a, b) if x != y])
    for edges in cases:
        con = duckdb.connect()
        arrow = pa.table({"a": pa.array([a for a, _ in edges], pa.int64()), "b": pa.array([b for _, b in edges], pa.int64())})  # noqa: F841 (DuckDB reads it by name)
        con.execute("CREATE TABLE edges AS SELECT * FROM arrow")
        rounds = components(con)
        got = dict(con.execute("SELECT node, l FROM lab").fetchall())
        assert got == _union_find_roots(5000, edges)
        assert rounds <= 20, rounds  # log2(4096) = 12; min-label propagation needs ~1500 on the shuffled chain


def test_a_small_duckdb_memory_limit_spills_and_decides_the_same(tmp_path):
    """The global half runs in DuckDB under `memory_limit` (its scratch database lives on disk): a small limit
    gives the same dataset, byte for byte, as the default, and the scratch directory is removed. That the
    memory stays flat as the corpus grows is measured by `bench.dedup_memory`, not here."""
    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(3000)]
    texts = []
    for i in range(6000):
        if i % 5 == 4:  # every fifth document a near copy of an earlier one, one word changed
            t = texts[int(rng.integers(0, i))].split()
            t[int(rng.integers(0, len(t)))] = "changed"
            texts.append(" ".join(t))
        elif i % 7 == 6:
            texts.append(texts[int(rng.integers(0, i))].upper())  # an exact copy after normalisation
        else:
            texts.append(" ".join(rng.choice(words, 60)))
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    refs = []
    for name, limit in (("big", "2GB"), ("small", "24MB")):
        wd = str(tmp_path / name)
        parent = run_collect(CollectConfig(inputs=[str(p)], rows_per_shard=1000), wd)
        refs.append(run_dedup(parent, DedupConfig(), wd, memory_limit=limit))
        assert not list((tmp_path / name / "datasets" / "dedup").glob(".spill-*"))  # the spill dir is removed
    big, small = refs
    assert big.sha256 == small.sha256 and big.num_rows == small.num_rows
    s = big.manifest()["stats"]["counters"]
    assert s["duplicate_near"] > 500 and s["duplicate_exact"] > 300, s
