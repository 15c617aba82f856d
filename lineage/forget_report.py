"""`lifecycle lineage forget SOURCE_ID...`: every dataset, checkpoint and model version holding those documents
(`forget_report`, printed by `print_forget`), answered from the catalog (catalog.py); changes nothing.
lineage/cli.py runs it and writes the report under <workdir>/audit/.
"""

from __future__ import annotations

from pathlib import Path

from lifecycle.lineage import catalog as cat

TOMBSTONES = "tombstones.parquet"  # lifecycle.tasks.data.collect.tombstones.LEDGER (not imported: no numba here)
POSITIONS = "raw-positions.parquet"  # lifecycle.tasks.data.collect.stage.POSITIONS


def raw_summary(files: list[dict]) -> str:
    """'3,148 raw files, 41,203,112 bytes' (the list itself: --files, or --json)."""
    return f"{len(files):,} raw file(s), {sum(f.get('bytes') or 0 for f in files):,} bytes (--files lists them)"


def raw_positions(workdir: Path, doc_ids: list[str]) -> list[dict]:
    """Where each document came from: raw file, record (line or row) number and byte range, from the collect
    datasets' per-row position files."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    want, out = pa_strings(doc_ids), []
    for mp, m in cat.manifests(workdir):
        if m["stage"] != "collect":
            continue
        for f in m.get("extra", []):
            if f["path"].rsplit("/", 1)[-1] != POSITIONS:
                continue
            t = pq.read_table(cat.inside(workdir, mp.parent / f["path"], f"{mp}: file"))
            out += [{**r, "dataset_sha256": m["sha256"]} for r in t.filter(pc.is_in(t["doc_id"], want)).to_pylist()]
    return out


def pa_strings(values: list[str]):
    import pyarrow as pa

    return pa.array(values, pa.string())


def tombstones_of(workdir: Path, doc_ids: list[str]) -> list[dict]:
    """The ledger rows (no signature) of these doc_ids: the request has been acted on."""
    import pyarrow.parquet as pq

    path = workdir / TOMBSTONES
    if not path.exists():
        return []
    rows = pq.read_table(cat.inside(workdir, path, "tombstone ledger")).drop_columns(["signature"]).to_pylist()
    return [r for r in rows if r["doc_id"] in set(doc_ids)]


def clusters(con, doc_ids: list[str]) -> list[dict]:
    """The near-duplicate clusters these documents belong to (dedup): the kept copy and the dropped copies, which
    hold the same (or near) content and are not named by the request."""
    rej_cols = {r["column_name"] for r in cat.query(con, "DESCRIBE rejected")}
    kept_cols = {r["column_name"] for r in cat.query(con, "DESCRIBE kept")}
    if "duplicate_of" not in rej_cols or "cluster_id" not in kept_cols:
        return []
    heads = cat.query(con, """
        SELECT DISTINCT cluster_id AS kept_doc_id FROM kept WHERE doc_id IN (SELECT unnest(?)) AND cluster_id IS NOT NULL
        UNION SELECT DISTINCT duplicate_of FROM rejected WHERE doc_id IN (SELECT unnest(?)) AND duplicate_of IS NOT NULL
        """, [doc_ids, doc_ids])
    out = []
    for h in sorted(r["kept_doc_id"] for r in heads):
        kept = cat.query(con, "SELECT DISTINCT doc_id, source_id FROM kept WHERE doc_id = ?", [h])
        dropped = cat.query(con, "SELECT DISTINCT doc_id, source_id, duplicate_kind FROM rejected "
                                 "WHERE duplicate_of = ? ORDER BY doc_id", [h])
        if not dropped:
            continue
        out.append({"kept_doc_id": h, "kept_source_ids": sorted({r["source_id"] for r in kept}),
                    "requested_is_kept_copy": h in doc_ids, "dropped_copies": dropped,
                    "dropped_not_requested": [r for r in dropped if r["doc_id"] not in doc_ids]})
    return out


def trained_token_datasets(con, doc_ids: list[str]) -> list[str]:
    """sha256 of every token dataset whose train split holds one of these documents."""
    return [r["sha256"] for r in cat.query(con, """
        SELECT DISTINCT d.sha256 FROM tokens t JOIN datasets d ON d.path = t.dataset_path
        WHERE t.doc_id IN (SELECT unnest(?)) AND t.split = 'train'""", [doc_ids])]


def versions_trained_on(con, doc_ids: list[str], trained: list[str] | None = None) -> list[dict]:
    """Every registered model version trained on one of these documents (name, version, aliases, run_id,
    checkpoint_dir)."""
    trained = trained_token_datasets(con, doc_ids) if trained is None else trained
    return cat.query(con, "SELECT name, version, aliases, run_id, checkpoint_dir FROM models "
                          "WHERE tokenize_sha256 IN (SELECT unnest(?)) ORDER BY name, version", [trained])


def forget_report(con, source_ids: list[str], workdir: Path | None = None) -> dict:
    """Every dataset, checkpoint, model package and model version that holds a document with these source ids or
    doc_ids; with `workdir`, also each document's raw file and record, its near-duplicate cluster and its
    tombstone."""
    ids = cat.query(con, "SELECT DISTINCT doc_id, source_id FROM (SELECT doc_id, source_id FROM kept UNION ALL "
                         "SELECT doc_id, source_id FROM rejected) WHERE source_id IN (SELECT unnest(?)) "
                         "OR doc_id IN (SELECT unnest(?))", [source_ids, source_ids])
    doc_ids = sorted({r["doc_id"] for r in ids if r["doc_id"]})
    found = sorted({r["source_id"] for r in ids} | {r["doc_id"] for r in ids if r["doc_id"] in source_ids})
    holding = cat.query(con, """
        SELECT d.stage, d.sha256, d.path, count(*) AS documents, 'kept rows' AS held_as
        FROM kept k JOIN datasets d ON d.path = k.dataset_path WHERE k.doc_id IN (SELECT unnest(?)) GROUP BY ALL
        UNION ALL
        SELECT d.stage, d.sha256, d.path, count(*), 'tokens (' || string_agg(DISTINCT t.split, ',') || ')'
        FROM tokens t JOIN datasets d ON d.path = t.dataset_path WHERE t.doc_id IN (SELECT unnest(?)) GROUP BY ALL
        UNION ALL
        SELECT d.stage, d.sha256, d.path, count(*), 'rejected rows (text not stored)'
        FROM rejected r JOIN datasets d ON d.path = r.dataset_path WHERE r.doc_id IN (SELECT unnest(?)) GROUP BY ALL
        UNION ALL
        SELECT coalesce(d.stage, 'dedup-index'), coalesce(d.sha256, ''), s.dataset_path, count(*),
               'MinHash signatures (derived from the text)'
        FROM signatures s LEFT JOIN datasets d ON d.path = s.dataset_path WHERE s.doc_id IN (SELECT unnest(?))
        GROUP BY ALL
        ORDER BY 1, 2""", [doc_ids, doc_ids, doc_ids, doc_ids])
    token_trained = trained_token_datasets(con, doc_ids)
    token_any = cat.query(con, """
        SELECT DISTINCT d.sha256 FROM tokens t JOIN datasets d ON d.path = t.dataset_path
        WHERE t.doc_id IN (SELECT unnest(?))""", [doc_ids])
    trained = token_trained
    anytok = [r["sha256"] for r in token_any]
    checkpoints = cat.query(con, "SELECT run_dir, step, tag_dir, marker_sha256, token_dataset_sha256 FROM checkpoints "
                                 "WHERE token_dataset_sha256 IN (SELECT unnest(?)) ORDER BY run_dir, step", [trained])
    packages = cat.query(con, "SELECT d.sha256, d.path FROM datasets d JOIN parents p ON p.dataset_sha256 = d.sha256 "
                              "WHERE d.stage = 'checkpoint' AND p.parent_sha256 IN (SELECT unnest(?))", [anytok])
    models = versions_trained_on(con, doc_ids, trained)
    raw = cat.query(con, "SELECT DISTINCT r.path, r.sha256 FROM raw_inputs r JOIN datasets d ON d.sha256 = "
                         "r.dataset_sha256 JOIN kept k ON k.dataset_path = d.path WHERE k.doc_id IN (SELECT unnest(?)) "
                         "UNION SELECT DISTINCT r.path, r.sha256 FROM raw_inputs r JOIN datasets d ON d.sha256 = "
                         "r.dataset_sha256 JOIN rejected j ON j.dataset_path = d.path "
                         "WHERE j.doc_id IN (SELECT unnest(?))", [doc_ids, doc_ids])
    tokens = cat.query(con, "SELECT t.doc_id, d.sha256 AS dataset_sha256, t.split, t.shard, t.token_start, "
                            "t.token_end FROM tokens t JOIN datasets d ON d.path = t.dataset_path "
                            "WHERE t.doc_id IN (SELECT unnest(?)) ORDER BY 2, 1", [doc_ids])
    return {"requested_source_ids": source_ids, "found_source_ids": found,
            "not_found": sorted(set(source_ids) - set(found)), "doc_ids": doc_ids, "raw_input_files": raw,
            "raw_positions": raw_positions(workdir, doc_ids) if workdir else [],
            "datasets": holding, "token_ranges": tokens, "clusters": clusters(con, doc_ids),
            "checkpoints": checkpoints, "model_packages": packages, "model_versions": models,
            "tombstones": tombstones_of(workdir, doc_ids) if workdir else [],
            "note": "report only: nothing was changed"}


def print_forget(r: dict, path: Path, files: bool = False) -> None:
    print(f"deletion request for {len(r['requested_source_ids'])} source id(s): {len(r['doc_ids'])} document(s) found"
          + (f"; not found: {', '.join(r['not_found'])}" if r["not_found"] else "")
          + f"; held by {len(r['datasets'])} dataset(s), {len(r['checkpoints'])} checkpoint(s), "
            f"{len(r['model_versions'])} model version(s)")
    if not files:
        print(f"  raw input   {raw_summary(r['raw_input_files'])}")
    for raw in r["raw_input_files"] if files else ():
        print(f"  raw input   {raw['sha256'][:12]}  {raw['path']}")
    for p in r["raw_positions"]:
        where = f"record {p['record']}" if p["record"] is not None else "record ?"
        if p["byte_start"] is not None:
            where += f", bytes {p['byte_start']}-{p['byte_end']}"
        print(f"  raw record  {p['doc_id']}  {p['raw_path']}  {where}")
    for d in r["datasets"]:
        print(f"  dataset     {d['stage']:<9} {d['sha256'][:12]}  {d['documents']} doc(s) as {d['held_as']}  {d['path']}")
    for t in r["token_ranges"]:
        print(f"  tokens      {t['doc_id']}  {t['dataset_sha256'][:12]}  {t['split']} {t['shard']} "
              f"[{t['token_start']}, {t['token_end']})")
    for c in r["clusters"]:
        role = "is the kept copy" if c["requested_is_kept_copy"] else f"was dropped as a copy of {c['kept_doc_id']}"
        print(f"  cluster     {c['kept_doc_id']}: the document {role}; copies holding the same content: "
              + (", ".join(f"{x['doc_id']} ({x['source_id']}, {x['duplicate_kind']})" for x in c["dropped_not_requested"])
                 or "none beyond the request"))
    for c in r["checkpoints"]:
        print(f"  checkpoint  step {c['step']}  {c['tag_dir']}")
    for p in r["model_packages"]:
        print(f"  package     {p['sha256'][:12]}  {p['path']}")
    for m in r["model_versions"]:
        print(f"  model       {m['name']}/{m['version']}" + (f" @{m['aliases']}" if m["aliases"] else ""))
    for t in r["tombstones"]:
        print(f"  tombstone   {t['tombstone_id']}  {t['doc_id']}  {t['created_at']}  ({t['reason']})")
    print(f"report written to {path} (nothing was changed)")
