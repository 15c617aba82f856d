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
- `images`: every kept row of the image stages without its bytes (image_id, source_id, source: the raw file,
  sha256, pixel_sha256, phash, ...); `image_index`: image_preprocess's image -> shard tables; both + dataset_path.
- `tokens`: the tokenize side tables (doc_id, source_id, split, shard, token_start, token_end) plus dataset_path.
- `signatures`: every row that holds a document's MinHash signature (data derived from its text): the
  `dedup-signatures` datasets, each dedup dataset's index rows and the published `dedup-index/` parts
  (doc_id, exact_hash, band_keys, signature) plus dataset_path (the index directory for a published part).
- `checkpoints`: training runs and their committed checkpoints (run_dir, step, tag_dir, token_dataset_sha256,
  marker_sha256).
- `models`: registered model versions (name, version, aliases, run_id, package_sha256, tokenize_sha256,
  val_bpb, promotion, kind: `clip` for a dual encoder, image_preprocess_sha256: the image shards it trained on)
  from the MLflow registry, when the work dir has one.
- `model_docs`: name, version, doc_id, source_id, split: the documents each registered version trained on
  (split `train`) or was validated on (`val`), from its own tokenize dataset. "Which documents trained this model"
  is `SELECT count(DISTINCT doc_id) FROM model_docs WHERE name = ? AND version = ? AND split = 'train'`.

Confinement: everything is read from inside the work dir (symlinks resolved; a manifest that lists a file
outside it is refused), and once the catalog is built the DuckDB connection is locked down: it can read only
the catalog's own Parquet files, so `lifecycle sql` cannot read, list, attach or write any other file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any

import pyarrow as pa

from lifecycle.core.dataset import MANIFEST
from lifecycle.core.fs import atomic_write_bytes, atomic_write_json, sha256_file
from lifecycle.core.paths import PathEscape, resolve_within
from lifecycle.tasks.stages import DOCUMENT_STAGES

log = logging.getLogger(__name__)
DOC_STAGES = DOCUMENT_STAGES
IMAGE_STAGES = ("image_collect", "image_filter", "image_dedup", "image_scrub")  # tasks/data/images/ (not imported)
SIG_STAGE, INDEX_FILE = "dedup-signatures", "dedup-index.parquet"  # lifecycle.tasks.data.dedup.stage's names (not imported: no numba here)


def inside(workdir: str | Path, path: str | Path, what: str) -> Path:
    """`path` resolved, refused unless it lies in the work dir: a symlink, a crafted manifest entry or a tag
    must not make an audit command read (or write) anything else."""
    return resolve_within(path, [workdir], f"{what} is not inside the work dir")


def manifests(workdir: str | Path) -> list[tuple[Path, dict]]:
    """(manifest path, manifest) of every committed dataset of the work dir, each path checked inside it; an
    unreadable manifest is skipped (manifests are written atomically: one that does not parse is not ours)."""
    out = []
    for mp in sorted(Path(workdir).glob(f"datasets/*/*/{MANIFEST}")):
        mp = inside(workdir, mp, "manifest")
        try:
            out.append((mp, json.loads(mp.read_text())))
        except (OSError, ValueError):
            continue
    return out


def _checkpoint_row(workdir: str | Path, cfg_path: Path, run: dict, marker: Path) -> dict:
    m = json.loads(inside(workdir, marker, "checkpoint marker").read_text())
    return {"run_dir": str(cfg_path.parent), "step": m["step"], "tag_dir": str(marker.parent),
            "token_dataset": run.get("token_dataset"),
            "token_dataset_sha256": m.get("dataset_sha256") or run.get("tokens", {}).get("dataset_sha256"),
            "tokenizer_sha256": m.get("tokenizer_sha256"), "marker_sha256": sha256_file(marker),
            "time": m.get("time")}


def model_rows(tracking_uri: str | None) -> list[dict]:
    """Every registered model version, read from MLflow (imports it: seconds; `models` caches the answer)."""
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
                         "kind": t.get("lifecycle.model_kind"),
                         "image_preprocess_sha256": t.get("lifecycle.dataset.image_preprocess.sha256"),
                         "promotion": t.get("lifecycle.promotion.decision"),
                         "created": mv.creation_timestamp,
                         "source": mv.source, "description": mv.description, "tags": json.dumps(dict(t))})
    return rows


# --------------------------------------------------------------------------------------------------
# the persisted catalog: <workdir>/catalog/ (index.json and one Parquet file per table), built once, then updated with what changed


CATALOG = "catalog"  # <workdir>/catalog/: index.json (what was read, and its rows), one Parquet file per table
CATALOG_VERSION = 2  # 2: the image views and the models' kind and image_preprocess_sha256
VIEWS = ("rejected", "kept", "tokens", "signatures", "images", "image_index")
S, I = pa.string(), pa.int64()
TABLES = {  # catalog table -> its columns
    "datasets": {"stage": S, "fingerprint": S, "sha256": S, "num_rows": I, "num_rejected": I, "created_at": S,
                 "code_version": S, "path": S, "manifest": S, "config": S, "rows_in": I, "rows_kept": I,
                 "rows_rejected": I, "bytes_in": I, "bytes_out": I},
    "parents": {"dataset_sha256": S, "manifest": S, "parent_sha256": S, "parent_manifest": S, "parent_stage": S},
    "raw_inputs": {"dataset_sha256": S, "path": S, "sha256": S, "bytes": I},
    "drops": {"dataset_sha256": S, "stage": S, "created_at": S, "reason": S, "n": I},
    "checkpoints": {"run_dir": S, "step": I, "tag_dir": S, "token_dataset": S, "token_dataset_sha256": S,
                    "tokenizer_sha256": S, "marker_sha256": S, "time": S},
    "models": {"name": S, "version": I, "aliases": S, "run_id": S, "package_sha256": S, "package_manifest": S,
               "tokenize_sha256": S, "checkpoint_dir": S, "checkpoint_marker_sha256": S, "val_bpb": pa.float64(),
               "promotion": S, "created": I, "kind": S, "image_preprocess_sha256": S},
}
_scratch: list = []  # temporary folders holding the tables of a work dir this process cannot write to


def _stamp(path: Path) -> list:
    """What changes when a file is replaced, moved behind a symlink or rewritten: real path, inode, size, mtime."""
    st = path.stat()
    return [os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns]


_warned: set[tuple[str, str]] = set()  # (file, reason) said once per process: a run updates after every commit


def _skip(path: Path, e: Exception) -> None:
    """Warn, once per process, that `path` is left out of the catalog and why (the rest is still catalogued)."""
    reason = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
    if (str(path), reason) not in _warned:
        _warned.add((str(path), reason))
        log.warning("audit catalog: %s left out (%s); the other datasets are catalogued", path, reason)


def _dataset_entry(workdir: Path, mp: Path, m: dict) -> dict:
    """One committed manifest's rows for the catalog tables, and the files of its views."""
    d, st = mp.parent, m.get("stats") or {}
    listed = lambda kind: [str(inside(workdir, d / f["path"], f"{mp}: file")) for f in m.get(kind, [])]
    files = {v: [] for v in VIEWS}
    files["rejected"] = listed("rejected")
    if m["stage"] in DOC_STAGES:
        files["kept"] = listed("files")
    elif m["stage"] == "tokenize":
        files["tokens"] = listed("files")
    elif view := {SIG_STAGE: "signatures", "image_preprocess": "image_index",
                  **dict.fromkeys(IMAGE_STAGES, "images")}.get(m["stage"]):
        files[view] = listed("files")
    if m["stage"] == "dedup":
        files["signatures"] += [p for p in listed("extra") if p.endswith("/" + INDEX_FILE)]
    return {
        "dataset": {"stage": m["stage"], "fingerprint": m["fingerprint"], "sha256": m["sha256"],
                    "num_rows": m["num_rows"], "num_rejected": m.get("num_rejected", 0),
                    "created_at": m.get("created_at"), "code_version": m.get("code_version"), "path": str(d),
                    "manifest": str(mp), "config": json.dumps(m.get("config")),
                    **{k: st.get(k) for k in ("rows_in", "rows_kept", "rows_rejected", "bytes_in", "bytes_out")}},
        "parents": [{"dataset_sha256": m["sha256"], "manifest": str(mp), "parent_sha256": p["sha256"],
                     "parent_manifest": p["manifest"], "parent_stage": p["stage"]} for p in m.get("parents", [])],
        "raw_inputs": [{"dataset_sha256": m["sha256"], **r} for r in m.get("inputs", [])],
        "drops": [{"dataset_sha256": m["sha256"], "stage": m["stage"], "created_at": m.get("created_at"),
                   "reason": k, "n": v} for k, v in st.get("rejected_by_reason", {}).items()],
        "files": files,
    }


def registry_stamp(tracking_uri: str | None) -> str | None:
    """A digest of a SQLite store's model registry (versions, their tags, aliases), read with sqlite3 in
    milliseconds, so that a catalog knows when its `models` rows are stale without importing MLflow. None when
    it cannot be read that way (a server URI, a schema this does not know): then the registry is asked."""
    from lifecycle.lineage.tracking import sqlite_path

    db = sqlite_path(tracking_uri) if tracking_uri else None
    if db is None or not db.is_file():
        return None
    h = hashlib.sha256()
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as con:
            for table in ("registered_models", "model_versions", "model_version_tags", "registered_model_aliases"):
                h.update(table.encode())
                for row in con.execute(f"SELECT * FROM {table} ORDER BY 1, 2"):
                    h.update(repr(row).encode())
    except sqlite3.Error:
        return None
    return h.hexdigest()


def models(tracking_uri: str | None, saved: dict | None = None) -> dict:
    """{"uri", "stamp", "rows"}: `saved` when the registry has not changed since, else read from MLflow."""
    stamp = registry_stamp(tracking_uri)
    if saved and stamp is not None and saved.get("uri") == tracking_uri and saved.get("stamp") == stamp:
        return saved
    return {"uri": tracking_uri, "stamp": stamp, "rows": model_rows(tracking_uri)}


def update(workdir: str | Path, tracking_uri: str | None = None, with_models: bool = True) -> dict:
    """The work dir's catalog, brought up to date and saved in `<workdir>/catalog/`: a manifest or checkpoint
    marker already in it (same real path, inode, size and mtime) is not read again, and the model registry is
    read only when its digest changed. The flow calls this after each commit and after registering a model, so an
    audit command finds it current; anything committed otherwise (a stage run by hand) is picked up here."""
    workdir = Path(workdir).expanduser().resolve()
    if not (workdir / "datasets").is_dir():
        raise FileNotFoundError(f"{workdir} has no datasets/ directory: not a lifecycle work dir")
    path = workdir / CATALOG / "index.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    if old.get("version") != CATALOG_VERSION or old.get("workdir") != str(workdir):
        old = {}
    old_ds, old_ck = old.get("datasets", {}), old.get("checkpoints", {})
    datasets, checkpoints = _dataset_entries(workdir, old_ds), _checkpoint_entries(workdir, old_ck)
    new = {"version": CATALOG_VERSION, "workdir": str(workdir), "datasets": datasets, "checkpoints": checkpoints,
           "index_parts": [str(inside(workdir, p, "dedup index part"))
                           for p in sorted(workdir.glob("dedup-index/*/part-*.parquet"))],
           "models": old.get("models") or {}}
    uri = tracking_uri or default_tracking_uri(workdir)
    if with_models:
        new["models"] = models(uri, old.get("models"))
    new["tables"] = {t: str(path.parent / f"{t}.parquet") for t in TABLES}
    if new != old or not all(Path(p).is_file() for p in new["tables"].values()):
        try:
            inside(workdir, path.parent, "catalog directory").mkdir(exist_ok=True)
            _write_tables(new, path.parent)
            atomic_write_json(inside(workdir, path, "catalog index"), new)  # last: the tables are in place
        except OSError:  # a read-only work dir: this answer's tables go to a temporary folder
            import tempfile

            _scratch.append(tempfile.TemporaryDirectory(prefix="lifecycle-catalog-"))
            new["tables"] = {t: str(Path(_scratch[-1].name) / f"{t}.parquet") for t in TABLES}
            new["scratch"] = True
            _write_tables(new, Path(_scratch[-1].name))
    return new


def _dataset_entries(workdir: Path, old_ds: dict) -> dict:
    """Each committed dataset's catalog entry, by manifest path; one whose manifest is unchanged since `old_ds`
    is taken from there."""
    datasets = {}
    for mp in sorted(workdir.glob(f"datasets/*/*/{MANIFEST}")):
        mp = inside(workdir, mp, "manifest")
        stamp = _stamp(mp)
        if mp.as_posix() in old_ds and old_ds[mp.as_posix()]["stamp"] == stamp:
            datasets[mp.as_posix()] = old_ds[mp.as_posix()]
            continue
        try:
            m = json.loads(mp.read_text())
        except (OSError, ValueError):
            continue  # a manifest is written atomically; an unreadable one is not ours to interpret
        try:
            datasets[mp.as_posix()] = {"stamp": stamp, **_dataset_entry(workdir, mp, m)}
        except PathEscape:
            raise  # a manifest naming a file outside the work dir: the audit command refuses
        except (KeyError, TypeError, AttributeError, ValueError) as e:  # parses, but not as a manifest
            _skip(mp, e)
    return datasets


def _checkpoint_entries(workdir: Path, old_ck: dict) -> dict:
    """Each committed checkpoint's catalog row, by marker path; one unchanged since `old_ck` is taken from there."""
    checkpoints: dict = {}
    for cfg_path in sorted(workdir.glob("train/*/config.json")):
        cfg_path = inside(workdir, cfg_path, "training run config")
        run = None
        for marker in sorted(cfg_path.parent.glob("checkpoints/step_*/COMMITTED.json")):
            stamp = _stamp(marker) + _stamp(cfg_path)
            if marker.as_posix() in old_ck and old_ck[marker.as_posix()]["stamp"] == stamp:
                checkpoints[marker.as_posix()] = old_ck[marker.as_posix()]
                continue
            try:
                run = run if run is not None else json.loads(cfg_path.read_text())
                checkpoints[marker.as_posix()] = {"stamp": stamp,
                                                  "row": _checkpoint_row(workdir, cfg_path, run, marker)}
            except PathEscape:
                raise
            except (KeyError, TypeError, AttributeError, ValueError) as e:
                _skip(marker if run is not None else cfg_path, e)
    return checkpoints


def _write_tables(state: dict, folder: Path) -> None:
    """The catalog's tables as Parquet files, so that a query reads them with DuckDB alone (registering Python
    objects with DuckDB imports pandas: a second or more per call)."""
    import pyarrow.parquet as pq

    entries = list(state["datasets"].values())
    rows = {"datasets": [e["dataset"] for e in entries],
            "parents": [r for e in entries for r in e["parents"]],
            "raw_inputs": [r for e in entries for r in e["raw_inputs"]],
            "drops": [r for e in entries for r in e["drops"]],
            "checkpoints": [c["row"] for c in state["checkpoints"].values()],
            "models": state["models"].get("rows", [])}
    for name, columns in TABLES.items():
        buf = pa.BufferOutputStream()
        pq.write_table(_table(rows[name], columns), buf)
        atomic_write_bytes(folder / f"{name}.parquet", buf.getvalue().to_pybytes())


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
    """An in-memory DuckDB connection with the catalog's tables and views (from `update`), locked down."""
    import duckdb

    workdir = Path(workdir).expanduser().resolve()
    if not (workdir / "datasets").is_dir():
        raise FileNotFoundError(f"{workdir} has no datasets/ directory: not a lifecycle work dir")
    tracking_uri_inside(workdir, tracking_uri)
    state = update(workdir, tracking_uri, with_models)
    files: dict[str, list[str]] = {v: [] for v in VIEWS}
    for e in state["datasets"].values():  # checked again: the index is a file in the work dir like any other
        for view, paths in e["files"].items():
            files[view] += [str(inside(workdir, p, f"{e['dataset']['manifest']}: file")) for p in paths]
    files["signatures"] += [str(inside(workdir, p, "dedup index part")) for p in state["index_parts"]]
    tables = state["tables"] if state.get("scratch") else \
        {t: str(inside(workdir, p, "catalog table")) for t, p in state["tables"].items()}
    con = duckdb.connect()
    for name, path in tables.items():
        if name == "models" and not with_models:
            cols = ", ".join(f"NULL::{'BIGINT' if t == I else 'DOUBLE' if t == pa.float64() else 'VARCHAR'} AS {c}"
                             for c, t in TABLES["models"].items())
            con.execute(f"CREATE VIEW models AS SELECT {cols} WHERE false")
        else:
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet({_quote(path)})")
    fallback = {"rejected": "doc_id, source_id, stage, reason, detail", "images": "image_id, source_id, source",
                "image_index": "image_id, source_id, shard, member",
                "kept": "doc_id, source_id", "signatures": "doc_id", "tokens": "doc_id, source_id, split, shard, token_start, token_end"}
    for view, paths in files.items():
        if paths:
            drop = "filename, image" if view == "images" else "filename"  # an image row's bytes stay in its file
            con.execute(f"CREATE VIEW {view} AS SELECT * EXCLUDE ({drop}), "
                        f"regexp_replace(filename, '(/shard-[0-9]+)?/[^/]*$', '') AS dataset_path "
                        f"FROM read_parquet([{', '.join(map(_quote, paths))}], union_by_name=true, filename=true)")
        else:  # an empty view with the shared columns, so queries still bind
            cols = ", ".join(f"NULL::VARCHAR AS {c}" for c in fallback[view].split(", "))
            con.execute(f"CREATE VIEW {view} AS SELECT {cols}, NULL::VARCHAR AS dataset_path WHERE false")
    # which documents trained (or validated) each registered model version: its own tokenize dataset's rows only,
    # not every tokenize dataset of the work dir (a failed run's committed one held the same documents again)
    con.execute("CREATE VIEW model_docs AS SELECT m.name, m.version, t.doc_id, t.source_id, t.split "
                "FROM models m JOIN datasets d ON d.stage = 'tokenize' AND d.sha256 = m.tokenize_sha256 "
                "JOIN tokens t ON t.dataset_path = d.path")
    lock_down(con, [p for paths in files.values() for p in paths] + list(tables.values()))
    return con


def _quote(path: str) -> str:
    return "'" + path.replace("'", "''") + "'"


def query(con, sql: str, params: list[Any] | None = None) -> list[dict]:
    cur = con.execute(sql, params or [])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]
