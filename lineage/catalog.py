"""A DuckDB catalog over everything a work dir holds: every committed manifest (all runs, all configs), the
stage statistics, the kept and rejected rows, the token side tables, the training runs, and the MLflow model
registry. Nothing is recomputed: the tables are read from manifests and Parquet files as they are.

Tables and views (query them with `lifecycle sql "SELECT ..."`):

- `datasets`: one row per committed dataset: stage, fingerprint, sha256, num_rows, num_rejected, created_at,
  code_version, path, manifest, config (JSON), rows_in, rows_kept, rows_rejected, bytes_in, bytes_out.
- `parents`: dataset_sha256 -> parent_sha256 (with both manifests): the lineage graph.
- `raw_inputs`: dataset_sha256, path, sha256, bytes of every raw input file a collect dataset read.
- `drops`: dataset_sha256, stage, created_at, reason, n (the manifests' rejected_by_reason).
- `rejected`: every rejected row of every dataset (doc_id, source_id, stage, reason, detail, ...) plus
  dataset_path; join `datasets` on `path` for its run time or config.
- `kept`: every kept document row of the document stages (collect, filter, dedup, scrub) plus dataset_path.
- `tokens`: the tokenize side tables (doc_id, source_id, split, shard, token_start, token_end) plus dataset_path.
- `signatures`: every row that holds a document's MinHash signature (data derived from its text): the
  `dedup-signatures` datasets, each dedup dataset's index rows and the published `dedup-index/` parts
  (doc_id, exact_hash, band_keys, signature) plus dataset_path (the index directory for a published part).
- `checkpoints`: training runs and their committed checkpoints (run_dir, step, tag_dir, token_dataset_sha256,
  marker_sha256).
- `models`: registered model versions (name, version, aliases, run_id, package_sha256, tokenize_sha256,
  val_bpb, promotion) from the MLflow registry, when the work dir has one.

Confinement: everything is read from inside the work dir (symlinks resolved; a manifest that lists a file
outside it is refused), and once the catalog is built the DuckDB connection is locked down: it can read only
the catalog's own Parquet files, so `lifecycle sql` cannot read, list, attach or write any other file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from lifecycle.core.dataset import MANIFEST

from lifecycle.core.fs import sha256_file
from lifecycle.core.paths import resolve_within
from lifecycle.tasks.stages import DOCUMENT_STAGES

DOC_STAGES = DOCUMENT_STAGES
SIG_STAGE, INDEX_FILE = "dedup-signatures", "dedup-index.parquet"  # lifecycle.tasks.data.dedup.stage's names (not imported: no numba here)


def inside(workdir: str | Path, path: str | Path, what: str) -> Path:
    """`path` resolved, refused unless it lies in the work dir: a symlink, a crafted manifest entry or a tag
    must not make an audit command read (or write) anything else."""
    return resolve_within(path, [workdir], f"{what} is not inside the work dir")


def manifests(workdir: str | Path) -> list[tuple[Path, dict]]:
    out = []
    for mp in sorted(Path(workdir).glob(f"datasets/*/*/{MANIFEST}")):
        mp = inside(workdir, mp, "manifest")
        try:
            out.append((mp, json.loads(mp.read_text())))
        except (OSError, ValueError):
            continue  # a manifest is written atomically; an unreadable one is not ours to interpret
    return out


def checkpoint_rows(workdir: str | Path) -> list[dict]:
    rows = []
    for cfg_path in sorted(Path(workdir).glob("train/*/config.json")):
        run = json.loads(inside(workdir, cfg_path, "training run config").read_text())
        for marker in sorted(cfg_path.parent.glob("checkpoints/step_*/COMMITTED.json")):
            m = json.loads(inside(workdir, marker, "checkpoint marker").read_text())
            rows.append({"run_dir": str(cfg_path.parent), "step": m["step"], "tag_dir": str(marker.parent),
                         "token_dataset": run.get("token_dataset"),
                         "token_dataset_sha256": m.get("dataset_sha256") or run.get("tokens", {}).get("dataset_sha256"),
                         "tokenizer_sha256": m.get("tokenizer_sha256"), "marker_sha256": sha256_file(marker),
                         "time": m.get("time")})
    return rows


def model_rows(tracking_uri: str | None) -> list[dict]:
    if not tracking_uri:
        return []
    from mlflow import MlflowClient

    from lifecycle.lineage.tracking import open_server

    open_server(tracking_uri)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    rows = []
    for rm in client.search_registered_models():
        for mv in client.search_model_versions(f"name = '{rm.name}'"):
            t = mv.tags
            rows.append({"name": mv.name, "version": int(mv.version),
                         "aliases": ",".join(a for a, v in (rm.aliases or {}).items() if str(v) == str(mv.version)),
                         "run_id": mv.run_id, "package_sha256": t.get("lifecycle.model_package_sha256"),
                         "package_manifest": t.get("lifecycle.model_package_manifest"),
                         "tokenize_sha256": t.get("lifecycle.dataset.tokenize.sha256"),
                         "checkpoint_dir": t.get("lifecycle.checkpoint_dir"),
                         "checkpoint_marker_sha256": t.get("lifecycle.checkpoint_marker_sha256"),
                         "val_bpb": float(t["metric.val_bpb"]) if "metric.val_bpb" in t else None,
                         "promotion": t.get("lifecycle.promotion.decision"),
                         "created": mv.creation_timestamp})
    return rows


def _table(rows: list[dict], columns: dict[str, pa.DataType]) -> pa.Table:
    return pa.table({c: pa.array([r.get(c) for r in rows], type=t) for c, t in columns.items()})


def default_tracking_uri(workdir: str | Path) -> str | None:
    db = Path(workdir) / "mlflow.db"
    return f"sqlite:///{inside(workdir, db, 'mlflow.db')}" if db.exists() else None


def tracking_uri_inside(workdir: str | Path, uri: str | None) -> str | None:
    """A tracking URI that names a local file (sqlite:, file:, a plain path) must name one in the work dir;
    a server URL (http, https, databricks...) is passed on."""
    if uri is None:
        return None
    for scheme in ("sqlite:///", "file://", ""):  # sqlite:///rel.db, sqlite:////abs.db, file:///abs, a path
        if uri.startswith(scheme) and (scheme or "://" not in uri):
            inside(workdir, uri[len(scheme):].split("?", 1)[0], f"--tracking-uri {uri}")
            break
    return uri


def lock_down(con, readable: list[str]) -> None:
    """From here on the connection reads exactly the catalog's own files: no other file, no directory listing,
    no ATTACH, no COPY, no extension install, and the settings cannot be changed back (DuckDB's
    `enable_external_access`, `allowed_paths`, `lock_configuration`)."""
    con.execute("SET allowed_paths = ?", [readable])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def connect(workdir: str | Path, tracking_uri: str | None = None, with_models: bool = True):
    """An in-memory DuckDB connection with the catalog's tables and views registered."""
    import duckdb

    workdir = Path(workdir).expanduser().resolve()
    if not (workdir / "datasets").is_dir():
        raise FileNotFoundError(f"{workdir} has no datasets/ directory: not a lifecycle work dir")
    tracking_uri_inside(workdir, tracking_uri)
    con = duckdb.connect()
    ds_rows, parent_rows, raw_rows, drop_rows = [], [], [], []
    files: dict[str, list[str]] = {"rejected": [], "kept": [], "tokens": [], "signatures": []}
    for mp, m in manifests(workdir):
        d, st = mp.parent, m.get("stats") or {}
        ds_rows.append({"stage": m["stage"], "fingerprint": m["fingerprint"], "sha256": m["sha256"],
                        "num_rows": m["num_rows"], "num_rejected": m.get("num_rejected", 0),
                        "created_at": m.get("created_at"), "code_version": m.get("code_version"), "path": str(d),
                        "manifest": str(mp), "config": json.dumps(m.get("config")),
                        **{k: st.get(k) for k in ("rows_in", "rows_kept", "rows_rejected", "bytes_in", "bytes_out")}})
        parent_rows += [{"dataset_sha256": m["sha256"], "manifest": str(mp), "parent_sha256": p["sha256"],
                         "parent_manifest": p["manifest"], "parent_stage": p["stage"]} for p in m.get("parents", [])]
        raw_rows += [{"dataset_sha256": m["sha256"], **r} for r in m.get("inputs", [])]
        drop_rows += [{"dataset_sha256": m["sha256"], "stage": m["stage"], "created_at": m.get("created_at"),
                       "reason": k, "n": v} for k, v in st.get("rejected_by_reason", {}).items()]
        listed = lambda kind: [str(inside(workdir, d / f["path"], f"{mp}: file")) for f in m.get(kind, [])]
        files["rejected"] += listed("rejected")
        if m["stage"] in DOC_STAGES:
            files["kept"] += listed("files")
        elif m["stage"] == "tokenize":
            files["tokens"] += listed("files")
        elif m["stage"] == SIG_STAGE:
            files["signatures"] += listed("files")
        if m["stage"] == "dedup":
            files["signatures"] += [p for p in listed("extra") if p.endswith("/" + INDEX_FILE)]
    files["signatures"] += [str(inside(workdir, p, "dedup index part"))
                            for p in sorted(workdir.glob("dedup-index/*/part-*.parquet"))]
    s, i = pa.string(), pa.int64()
    con.register("datasets", _table(ds_rows, {"stage": s, "fingerprint": s, "sha256": s, "num_rows": i,
                                              "num_rejected": i, "created_at": s, "code_version": s, "path": s,
                                              "manifest": s, "config": s, "rows_in": i, "rows_kept": i,
                                              "rows_rejected": i, "bytes_in": i, "bytes_out": i}))
    con.register("parents", _table(parent_rows, {"dataset_sha256": s, "manifest": s, "parent_sha256": s,
                                                 "parent_manifest": s, "parent_stage": s}))
    con.register("raw_inputs", _table(raw_rows, {"dataset_sha256": s, "path": s, "sha256": s, "bytes": i}))
    con.register("drops", _table(drop_rows, {"dataset_sha256": s, "stage": s, "created_at": s, "reason": s, "n": i}))
    con.register("checkpoints", _table(checkpoint_rows(workdir), {
        "run_dir": s, "step": i, "tag_dir": s, "token_dataset": s, "token_dataset_sha256": s,
        "tokenizer_sha256": s, "marker_sha256": s, "time": s}))
    models = model_rows(tracking_uri or default_tracking_uri(workdir)) if with_models else []
    con.register("models", _table(models, {"name": s, "version": i, "aliases": s, "run_id": s,
                                           "package_sha256": s, "package_manifest": s, "tokenize_sha256": s,
                                           "checkpoint_dir": s, "checkpoint_marker_sha256": s,
                                           "val_bpb": pa.float64(), "promotion": s, "created": i}))
    fallback = {"rejected": "doc_id, source_id, stage, reason, detail",
                "kept": "doc_id, source_id", "signatures": "doc_id", "tokens": "doc_id, source_id, split, shard, token_start, token_end"}
    for view, paths in files.items():
        if paths:
            lst = ", ".join("'" + p.replace("'", "''") + "'" for p in paths)
            con.execute(f"CREATE VIEW {view} AS SELECT * EXCLUDE (filename), "
                        f"regexp_replace(filename, '(/shard-[0-9]+)?/[^/]*$', '') AS dataset_path "
                        f"FROM read_parquet([{lst}], union_by_name=true, filename=true)")
        else:  # an empty view with the shared columns, so queries still bind
            cols = ", ".join(f"NULL::VARCHAR AS {c}" for c in fallback[view].split(", "))
            con.execute(f"CREATE VIEW {view} AS SELECT {cols}, NULL::VARCHAR AS dataset_path WHERE false")
    lock_down(con, [p for paths in files.values() for p in paths])
    return con


def query(con, sql: str, params: list[Any] | None = None) -> list[dict]:
    cur = con.execute(sql, params or [])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]
