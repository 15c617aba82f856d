"""dedup's second half, global: exact copies, LSH candidates, clusters and the keep policy, all in DuckDB, which
spills to disk past its memory limit, so this half's memory does not grow with the corpus. Every document is a node:
the index's kept documents 0..m-1 (parts in order), then this run's rows m.. in parent order, so "the smallest node
of a cluster" is the keep policy. `decide` builds the `decision` table stage.py's `dedup` writes from."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lifecycle.tasks.data.dedup.config import DedupConfig
from lifecycle.tasks.data.dedup.index import Index
from lifecycle.tasks.data.dedup import signatures as sig  # `sig.BATCH_DOCS`: one knob for both halves
from lifecycle.tasks.data.dedup.signatures import _matrix, shingles

def _files_table(con: duckdb.DuckDBPyConnection, name: str, files: list[str], counts: list[int], base: int) -> None:
    """A small table (file, file_idx, base): global node of row r of file k = base_k + r."""
    starts = base + np.concatenate([[0], np.cumsum(counts, dtype=np.int64)[:-1]]).astype(np.int64)
    con.register(f"{name}_arrow", pa.table({"file": pa.array(files, pa.string()),
                                            "file_idx": pa.array(range(len(files)), pa.int32()),
                                            "base": pa.array(starts, pa.int64())}))
    con.execute(f"CREATE TABLE {name} AS SELECT * FROM {name}_arrow")
    con.unregister(f"{name}_arrow")


def _nodes(files_table: str, files: list[str], columns: str) -> str:
    """SQL: the rows of `files` (listed in `files_table`) with their global node, file_idx and row."""
    listed = "[" + ", ".join("'" + f.replace("'", "''") + "'" for f in files) + "]"
    return (f"SELECT f.base + s.file_row_number AS node, f.file_idx, s.file_row_number AS row, {columns} "
            f"FROM read_parquet({listed}, filename = true, file_row_number = true) s "
            f"JOIN {files_table} f ON s.filename = f.file")


def components(con: duckdb.DuckDBPyConnection) -> int:
    """Connected components of the undirected graph `edges(a, b)` (a > b) as `lab(node, l)`: l = the smallest
    node of the component, for every node on an edge. The large-star / small-star alternation of Kiveris et al.,
    "Connected Components in MapReduce and Beyond" (SoCC 2014): each step is one aggregate and one join over
    tables DuckDB can spill, it ends with every node linked to its component's minimum, in O(log^2 n) rounds
    (about log n in practice). Returns the rounds."""
    con.execute("CREATE OR REPLACE TABLE cc AS SELECT DISTINCT a, b FROM edges")
    rounds = 0
    while True:
        rounds += 1
        # large star: every larger neighbour of u links to the smallest node around u
        con.execute("""
            CREATE OR REPLACE TABLE cc2 AS
            WITH m AS (SELECT a AS u, min(b) AS m FROM cc GROUP BY a)
            SELECT DISTINCT e.a, coalesce(m.m, e.b) AS b FROM cc e LEFT JOIN m ON m.u = e.b""")
        # small star: u and its smaller neighbours link to the smallest of them
        con.execute("""
            CREATE OR REPLACE TABLE cc3 AS
            WITH m AS (SELECT a AS u, min(b) AS m FROM cc2 GROUP BY a)
            SELECT DISTINCT e.b AS a, m.m AS b FROM cc2 e JOIN m ON m.u = e.a WHERE e.b <> m.m
            UNION SELECT u, m FROM m""")
        changed = con.execute("SELECT (SELECT count(*) FROM (SELECT a, b FROM cc3 EXCEPT SELECT a, b FROM cc)) + "
                              "(SELECT count(*) FROM (SELECT a, b FROM cc EXCEPT SELECT a, b FROM cc3))").fetchone()[0]
        con.execute("DROP TABLE cc")
        con.execute("DROP TABLE cc2")
        con.execute("ALTER TABLE cc3 RENAME TO cc")
        if not changed:
            break
    con.execute("CREATE OR REPLACE TABLE lab AS SELECT a AS node, b AS l FROM cc "
                "UNION SELECT DISTINCT b, b FROM cc")
    con.execute("DROP TABLE cc")
    return rounds


def _verified_edges(con: duckdb.DuckDBPyConnection, cfg: DedupConfig, m: int, spill: Path) -> None:
    """`edges` = the candidate pairs (`pairs`) whose Jaccard is >= `verify_jaccard`: true shingle Jaccard of the
    two texts for a pair of this run's documents, the signatures' estimate against the index (whose texts are
    not kept). Pairs stream through in batches; the passing ones are written to a Parquet file in `spill`."""
    out = spill / "verified-edges.parquet"
    p = cfg.minhash
    schema = pa.schema([("a", pa.int64()), ("b", pa.int64())])
    with pq.ParquetWriter(out, schema) as w:
        queries = (
            ("SELECT p.a, p.b, x.text AS x, y.text AS y FROM pairs p JOIN texts x ON x.node = p.a "
             f"JOIN texts y ON y.node = p.b WHERE p.b >= {m}", "text"),
            ("SELECT p.a, p.b, x.signature AS x, y.signature AS y FROM pairs p JOIN sigs x ON x.node = p.a "
             f"JOIN index_sigs y ON y.node = p.b WHERE p.b < {m}", "signature"),
        )
        for sql, kind in queries:
            if kind == "signature" and not m:
                continue
            reader = con.sql(sql).to_arrow_reader(sig.BATCH_DOCS)
            for batch in reader:
                if not batch.num_rows:
                    continue
                if kind == "text":
                    j = np.array([_jaccard(shingles(x, p.ngram), shingles(y, p.ngram)) for x, y in
                                  zip(batch.column("x").to_pylist(), batch.column("y").to_pylist())])
                else:
                    j = np.mean(_matrix(batch.column("x"), p.num_perm, np.uint32)
                                == _matrix(batch.column("y"), p.num_perm, np.uint32), axis=1)
                ok = pa.array(j >= p.verify_jaccard)
                w.write_table(pa.table({"a": batch.column("a"), "b": batch.column("b")}, schema=schema).filter(ok))
    con.execute("CREATE TABLE edges AS SELECT a, b FROM read_parquet($f)", {"f": str(out)})


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / max(1, len(a | b))


def decide(con: duckdb.DuckDBPyConnection, cfg: DedupConfig, files: list[str], sig_files: list[str],
           counts: list[int], index: Index | None, spill: Path) -> None:
    """Build the table `decision(node, file_idx, row, doc_id, source_id, kind, of_doc, part_idx, cluster_size)`,
    ordered by node: `kind` NULL (kept), 'exact' or 'near'; `of_doc` the doc_id a removed row duplicates and
    `part_idx` the index part that kept it (NULL: this run); `cluster_size` of a kept row."""
    m = index.num_rows if index is not None else 0
    _load_nodes(con, files, sig_files, counts, index, m)
    _exact(con, cfg)
    # 2. near: LSH buckets (band, key) of the exact survivors and the index; candidate edges
    if cfg.near:
        _near_edges(con, cfg, files, sig_files, index, m, spill)
    else:
        con.execute("CREATE TABLE edges (a BIGINT, b BIGINT)")
    components(con)
    _decisions(con)
    for t in ("dec", "ex", "bk", "pairs", "edges", "lab", "docs"):
        con.execute(f"DROP TABLE IF EXISTS {t}")


def _load_nodes(con: duckdb.DuckDBPyConnection, files: list[str], sig_files: list[str], counts: list[int],
                index: Index | None, m: int) -> None:
    """`docs`: this run's rows as nodes m..; `idx`: the index's kept documents as nodes 0..m-1."""
    _files_table(con, "sig_files", sig_files, counts, m)
    _files_table(con, "parent_files", files, counts, m)
    con.execute(f"CREATE TABLE docs AS {_nodes('sig_files', sig_files, 's.doc_id, s.source_id, s.exact_hash AS h')}")
    if m:
        _files_table(con, "index_files", index.paths, index.counts, 0)
        con.execute(f"CREATE TABLE idx AS {_nodes('index_files', index.paths, 's.doc_id, s.exact_hash AS h')}")
        if not index.match_own_doc_ids:  # this run's own documents, kept before: not copies of themselves
            con.execute("DELETE FROM idx WHERE doc_id IN (SELECT doc_id FROM docs)")
    else:
        con.execute("CREATE TABLE idx (node BIGINT, file_idx INT, row BIGINT, doc_id VARCHAR, h VARCHAR)")


def _exact(con: duckdb.DuckDBPyConnection, cfg: DedupConfig) -> None:
    """`ex`: each row's exact-copy decision and its weight in a kept row's cluster_size."""
    exact = "true" if cfg.exact else "false"
    # 1. exact: the first row (smallest node) with the same normalised text, here or in the index
    con.execute(f"""
        CREATE TABLE ex AS
        WITH g AS (SELECT node, h, min(node) OVER (PARTITION BY h) AS first_node,
                          count(*) OVER (PARTITION BY h) AS copies FROM docs),
             i AS (SELECT h, min(node) AS inode FROM idx GROUP BY h)
        SELECT g.node, {exact} AND (g.first_node <> g.node OR i.inode IS NOT NULL) AS dup,
               coalesce(i.inode, g.first_node) AS exact_of,
               -- a kept row's cluster_size counts this run's rows: its exact copies and its near duplicates'
               CASE WHEN NOT {exact} THEN 1 WHEN g.first_node = g.node AND i.inode IS NULL THEN g.copies ELSE 0
               END AS weight
        FROM g LEFT JOIN i USING (h)""")


def _near_edges(con: duckdb.DuckDBPyConnection, cfg: DedupConfig, files: list[str], sig_files: list[str],
                index: Index | None, m: int, spill: Path) -> None:
    """`edges`: the near-duplicate candidate pairs of the exact survivors and the index (LSH buckets, or SimHash
    table keys within Hamming distance k), verified when `verify_jaccard` is set."""
    value = "s.simhash" if cfg.method == "simhash" else "s.signature"
    con.execute(f"CREATE VIEW sigs AS {_nodes('sig_files', sig_files, 's.band_keys, ' + value)}")
    con.execute(f"CREATE VIEW index_sigs AS SELECT * FROM ({_nodes('index_files', index.paths, 's.band_keys, ' + value)}) "
                "WHERE node IN (SELECT node FROM idx)" if m else "CREATE VIEW index_sigs AS SELECT * FROM sigs WHERE false")
    con.execute("""
        CREATE TABLE bk AS
        SELECT node, generate_subscripts(band_keys, 1) AS band, unnest(band_keys) AS key
        FROM (SELECT s.node, s.band_keys FROM sigs s JOIN ex USING (node) WHERE NOT ex.dup
              UNION ALL SELECT node, band_keys FROM index_sigs)""")
    if cfg.method == "simhash":  # every pair sharing a table key, kept when within Hamming distance k
        con.execute(f"""
            CREATE TABLE edges AS
            WITH pairs AS (SELECT DISTINCT x.node AS a, y.node AS b FROM bk x JOIN bk y
                               ON x.band = y.band AND x.key = y.key AND y.node < x.node WHERE x.node >= {m}),
                 h AS (SELECT node, simhash FROM sigs UNION ALL SELECT node, simhash FROM index_sigs)
            SELECT p.a, p.b FROM pairs p JOIN h x ON x.node = p.a JOIN h y ON y.node = p.b
            WHERE bit_count(xor(x.simhash, y.simhash)) <= {cfg.simhash.k}""")
    elif cfg.minhash.verify_jaccard is None:  # every member to its bucket's smallest node: enough for components
        con.execute(f"""
            CREATE TABLE edges AS
            WITH buckets AS (SELECT band, key, min(node) AS first FROM bk GROUP BY band, key HAVING count(*) > 1)
            SELECT DISTINCT bk.node AS a, buckets.first AS b FROM bk JOIN buckets USING (band, key)
            WHERE bk.node <> buckets.first AND bk.node >= {m}""")
    else:  # every pair sharing a bucket (at least one of this run), each verified before it is merged
        con.execute(f"CREATE VIEW texts AS {_nodes('parent_files', files, 's.text')}")
        con.execute(f"""
            CREATE TABLE pairs AS
            SELECT DISTINCT x.node AS a, y.node AS b FROM bk x JOIN bk y
                ON x.band = y.band AND x.key = y.key AND y.node < x.node
            WHERE x.node >= {m}""")
        _verified_edges(con, cfg, m, spill)


def _decisions(con: duckdb.DuckDBPyConnection) -> None:
    """`decision`, from `docs`, `ex`, `lab` (the components) and `idx`."""
    # 3. decisions, cluster sizes and the doc_id each removed row duplicates
    con.execute("""
        CREATE TABLE dec AS
        SELECT d.node, d.file_idx, d.row, d.doc_id, d.source_id, ex.weight,
               CASE WHEN ex.dup THEN 'exact' WHEN coalesce(lab.l, d.node) <> d.node THEN 'near' END AS kind,
               CASE WHEN ex.dup THEN ex.exact_of ELSE coalesce(lab.l, d.node) END AS of_node
        FROM docs d JOIN ex USING (node) LEFT JOIN lab USING (node)""")
    con.execute("""
        CREATE TABLE decision AS
        WITH sizes AS (SELECT of_node AS node, sum(weight) AS size FROM dec WHERE kind IS NULL OR kind = 'near'
                       GROUP BY of_node),
             named AS (SELECT node, doc_id, NULL::INT AS part_idx FROM docs
                       UNION ALL SELECT node, doc_id, file_idx FROM idx)
        SELECT dec.node, dec.file_idx, dec.row, dec.doc_id, dec.source_id, dec.kind,
               CASE WHEN dec.kind IS NOT NULL THEN named.doc_id END AS of_doc,
               CASE WHEN dec.kind IS NOT NULL THEN named.part_idx END AS part_idx,
               CASE WHEN dec.kind IS NULL THEN sizes.size::INT END AS cluster_size
        FROM dec LEFT JOIN named ON named.node = dec.of_node LEFT JOIN sizes ON sizes.node = dec.node
        ORDER BY dec.node""")
