"""Audit commands, answered from manifests and MLflow (nothing is recomputed). Every command takes `--json`.

    lifecycle lineage model NAME[/VERSION|@ALIAS]   model version -> checkpoint -> token shards -> ... -> raw files
    lifecycle lineage doc ID                        a doc_id's, image_id's or source_id's path through every
                                                    stage, and the model versions that trained on it
    lifecycle lineage forget SOURCE_ID...           every dataset, checkpoint and model version holding those
                                                    documents; writes a report under <workdir>/audit/, changes nothing
    lifecycle lineage step RUN STEP                 the documents a training step read (the sampler's windows,
                                                    recomputed from the run's config.json; the one thing recomputed)
    lifecycle sql "SELECT ..."                      DuckDB over the catalog (see lineage/catalog.py)

A command names its run as every `lifecycle` command does: CONFIG (-c) and --set, else --workdir, else
$LIFECYCLE_WORKDIR, else the default config's work dir (lifecycle/cli.py: `resolve_workdir`).
Every command reads only inside the work dir (symlinks resolved; a manifest, tag or --tracking-uri naming a file
elsewhere is refused), and `sql` runs SELECT queries only, on a DuckDB connection that can read nothing but the
catalog's own files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from lifecycle.core.errors import UsageError
from lifecycle.core.paths import PathEscape
from lifecycle.core.suggest import did_you_mean, near_ids
from lifecycle.lineage import catalog as cat
from lifecycle.lineage.forget_report import forget_report, print_forget, raw_summary
from lifecycle.lineage.images import add_images, image_lineage, print_images
from lifecycle.lineage.tracking import open_server
from lifecycle.tasks.stages import NAMES

STAGE_ORDER = NAMES


def _workdir(args) -> Path:
    """The work dir resolved: every file an audit command reads or writes must lie inside it."""
    wd = Path(args.workdir).expanduser().resolve()
    if not wd.is_dir():
        raise FileNotFoundError(f"work dir {args.workdir} ({getattr(args, 'workdir_from', '--workdir')}): "
                                "no such directory")
    return wd


def _uri(args) -> str | None:
    wd = _workdir(args)
    return cat.tracking_uri_inside(wd, args.tracking_uri) or cat.default_tracking_uri(wd)


def _models(args) -> list[dict]:
    """The registered model versions, from the work dir's catalog (MLflow is read only when its registry changed)."""
    wd = _workdir(args)
    uri = _uri(args)
    if uri is None:
        raise LookupError(f"{args.workdir} has no mlflow.db; pass --tracking-uri")
    open_server(uri)
    if not (wd / "datasets").is_dir():  # a registry without datasets: nothing to catalogue but the models
        return cat.models(uri)["rows"]
    return cat.update(wd, uri)["models"]["rows"]


# --------------------------------------------------------------------------------------------------
# lineage model


def resolve_version(versions: list[dict], spec: str) -> dict:
    """NAME (latest version), NAME/VERSION or NAME@ALIAS -> that version's catalog row."""
    if "@" in spec:
        name, alias = spec.split("@", 1)
        found = [v for v in versions if v["name"] == name and alias in (v["aliases"] or "").split(",")]
        if not found:
            raise LookupError(f"registered model {name!r} has no alias {alias!r}")
        return found[0]
    if "/" in spec:
        name, version = spec.rsplit("/", 1)
        found = [v for v in versions if v["name"] == name and str(v["version"]) == version]
        if not found:
            raise LookupError(f"registered model {name!r} has no version {version!r}")
        return found[0]
    found = [v for v in versions if v["name"] == spec]
    if not found:
        raise LookupError(f"no registered model named {spec!r}")
    return max(found, key=lambda v: int(v["version"]))


def _scorer(manifest: dict, manifest_path: str) -> dict | None:
    """The model a scoring step scored with: the fastText classifier quality trained (its file and sha256), or the
    registered champion perplexity used (its version and package sha256)."""
    if manifest.get("model_sha256"):
        return {"kind": "fasttext", "file": str(Path(manifest_path).with_name(manifest.get("model_file") or "")),
                "sha256": manifest["model_sha256"]}
    if s := manifest.get("scoring_model"):
        return {"kind": "champion", "version": s.get("version"), "package": s.get("package_dir"),
                "sha256": s.get("package_sha256")}
    return None


def model_lineage(versions: list[dict], spec: str, workdir: str | Path) -> dict:
    """The version's chain, read from its package's lineage.json and the manifests it names, all of which must
    lie in `workdir` (the registry's tags name them; a tag pointing elsewhere is refused)."""
    mv = resolve_version(versions, spec)
    t = json.loads(mv["tags"])
    manifest = t.get("lifecycle.model_package_manifest") or (mv["description"] or "").removeprefix("lineage: ").strip()
    pkg = Path(manifest).parent
    lineage = json.loads(cat.inside(workdir, pkg / "lineage.json", "model package lineage").read_text())
    chain = []
    for d in sorted(lineage["datasets"], key=lambda d: STAGE_ORDER.index(d["stage"])
                    if d["stage"] in STAGE_ORDER else 99, reverse=True):
        m = json.loads(cat.inside(workdir, d["manifest"], "dataset manifest").read_text())
        chain.append({"stage": d["stage"], "sha256": d["sha256"], "num_rows": d["num_rows"], "manifest": d["manifest"],
                      "code_version": m.get("code_version"), "config": m.get("config"),
                      "parents": [p["sha256"] for p in m.get("parents", [])],
                      "raw_inputs": m.get("inputs", []),
                      **({"tokenizer_sha256": m["tokenizer_sha256"]} if "tokenizer_sha256" in m else {}),
                      **({"scorer": scorer} if (scorer := _scorer(m, d["manifest"])) else {})})
    return {
        "model": {"name": mv["name"], "version": str(mv["version"]),
                  "aliases": [a for a in (mv["aliases"] or "").split(",") if a], "run_id": mv["run_id"],
                  "source": mv["source"]},
        "checkpoint": {"dir": lineage["checkpoint_dir"], "step": lineage.get("checkpoint_step"),
                       "marker_sha256": lineage["checkpoint_marker_sha256"], "package_manifest": manifest,
                       "package_sha256": t.get("lifecycle.model_package_sha256")},
        "tokenizer_sha256": lineage.get("tokenizer_sha256"),
        "config_sha256": t.get("lifecycle.config_sha256"), "git_commit": t.get("lifecycle.git_commit"),
        "metrics": {k.removeprefix("metric."): float(v) for k, v in t.items() if k.startswith("metric.")},
        "unlearning": lineage.get("unlearning"),
        "tombstones_honoured": _honoured(lineage, workdir),
        "promotion": {k.removeprefix("lifecycle.promotion."): v for k, v in t.items()
                      if k.startswith("lifecycle.promotion.")},
        "base_model": lineage.get("base_model"),
        "datasets": chain,
    }


def _honoured(lineage: dict, workdir: str | Path) -> list[str]:
    """Tombstone ids the version's data honours: those its collect datasets rejected by (their config's
    `forgotten`), and, for an unlearned version, those it was unlearned for."""
    ids: set[str] = set((lineage.get("unlearning") or {}).get("tombstones", []))
    for d in lineage["datasets"]:
        if d["stage"] == "collect":
            m = json.loads(cat.inside(workdir, d["manifest"], "dataset manifest").read_text())
            ids |= set(((m.get("config") or {}).get("forgotten") or {}).get("tombstone_ids", []))
    return sorted(ids)


def print_model(r: dict, files: bool = False) -> None:
    m, c = r["model"], r["checkpoint"]
    print(f"model {m['name']} version {m['version']}" + (f" @{','.join(m['aliases'])}" if m["aliases"] else "")
          + f"  (MLflow run {m['run_id']})")
    print(f"  git {r['git_commit']}  config {r['config_sha256'][:16]}  tokenizer {r['tokenizer_sha256'][:16]}")
    print(f"  val_bpb {r['metrics'].get('val_bpb')}  promotion: {r['promotion'].get('decision')} "
          f"({r['promotion'].get('reason')})")
    print(f"  checkpoint step {c['step']}  marker {c['marker_sha256'][:16]}  {c['dir']}")
    if r["tombstones_honoured"]:
        print(f"  tombstones honoured: {', '.join(r['tombstones_honoured'])}")
    if r["unlearning"]:
        u, m = r["unlearning"], r["unlearning"]["metrics"]
        el = next((k.removeprefix("never_seen_") for k in m if k.startswith("never_seen_el")), "el")
        print(f"  unlearned from {u['unlearned_from']} (Jang et al. gradient ascent, {m['unlearn_steps']} steps, "
              f"{m['forget_sequences']} sequence(s) of {m['sequence_tokens']} tokens)")
        print(f"    forgotten  MA {m['forgotten_ma_before']:.3f} -> {m['forgotten_ma_after']:.3f}   "
              f"{el.upper()} {m[f'forgotten_{el}_before']:.3f} -> {m[f'forgotten_{el}_after']:.3f}")
        print(f"    never-seen MA {m['never_seen_ma']:.3f}            {el.upper()} {m[f'never_seen_{el}']:.3f}")
        print(f"    val_loss   {m['val_loss_before']:.4f} -> {m['val_loss_after']:.4f} ({m['val_loss_increase']:+.2%})")
    if base := r.get("base_model"):  # the open model the run continued, above the data it continued on
        print(f"  <- base model  {base['dir']}")
        for f in base["files"]:
            print(f"       file {f['sha256'][:16]}  {f['name']}")
    for d in r["datasets"]:
        print(f"  <- {d['stage']:<9} {d['sha256'][:16]}  {d['num_rows']:>7} rows  code {d['code_version']}  "
              f"{d['manifest']}")
        if sc := d.get("scorer"):
            where = sc["file"] if sc["kind"] == "fasttext" else f"version {sc['version']}  {sc['package']}"
            print(f"       scored by {sc['kind']} {(sc['sha256'] or '')[:16]}  {where}")
        if d["raw_inputs"] and not files:
            print(f"       {raw_summary(d['raw_inputs'])}")
        for raw in d["raw_inputs"] if files else ():
            print(f"       raw {raw['sha256'][:16]}  {raw['bytes']:>9} B  {raw['path']}")


# --------------------------------------------------------------------------------------------------
# lineage doc


def doc_lineage(con, ident: str) -> dict:
    """Every dataset that kept or rejected the document(s) with this doc_id or source_id."""
    ids = cat.query(con, "SELECT DISTINCT doc_id, source_id FROM (SELECT doc_id, source_id FROM kept UNION ALL "
                         "SELECT doc_id, source_id FROM rejected) WHERE doc_id = ? OR source_id = ?", [ident, ident])
    doc_ids = sorted({r["doc_id"] for r in ids if r["doc_id"]})
    events: list[dict] = []
    if ids:
        where = "(doc_id IN (SELECT unnest(?)) OR source_id = ?)"
        params = [doc_ids, ident]
        kept_cols = {r["column_name"] for r in cat.query(con, "DESCRIBE kept")}
        extra = [c for c in ("cluster_id", "cluster_size", "dedup_cuts") if c in kept_cols] + \
                sorted(c for c in kept_cols if c.startswith(("pii_", "quality_")))
        sel = ", ".join(["doc_id", "source_id", "dataset_path"] + extra)
        for r in cat.query(con, f"SELECT {sel} FROM kept WHERE {where}", params):
            events.append({"outcome": "kept", **{k: v for k, v in r.items() if v is not None}})
        rej_cols = {r["column_name"] for r in cat.query(con, "DESCRIBE rejected")}
        rsel = ", ".join(["doc_id", "source_id", "dataset_path", "reason", "detail"] +
                         [c for c in ("duplicate_of", "duplicate_kind", "cluster_id") if c in rej_cols])
        for r in cat.query(con, f"SELECT {rsel} FROM rejected WHERE {where}", params):
            events.append({"outcome": "rejected", **{k: v for k, v in r.items() if v is not None}})
        scores = sorted(r["column_name"] for r in cat.query(con, "DESCRIBE tokens")
                        if r["column_name"].startswith("quality_"))  # the quality step's scores, when it ran
        for r in cat.query(con, "SELECT " + ", ".join(["doc_id", "source_id", "dataset_path", "split", "shard",
                                                         "token_start", "token_end", *scores])
                           + f" FROM tokens WHERE {where}", params):
            events.append({"outcome": "tokenized", **{k: v for k, v in r.items() if v is not None or k in
                                                      ("split", "shard", "token_start", "token_end")}})
    info = {r["path"]: r for r in cat.query(con, "SELECT stage, sha256, path, created_at FROM datasets")}
    for e in events:
        d = info.get(e["dataset_path"], {})
        e.update(stage=d.get("stage"), dataset_sha256=d.get("sha256"), created_at=d.get("created_at"),
                 dataset_dir=Path(e["dataset_path"] or "").name)  # the fingerprint directory, datasets/<stage>/<it>
    events.sort(key=lambda e: (e["created_at"] or "", STAGE_ORDER.index(e["stage"]) if e["stage"] in STAGE_ORDER else 99))
    trained_on = {e["dataset_sha256"] for e in events if e["outcome"] == "tokenized" and e["split"] == "train"}
    held_out = {e["dataset_sha256"] for e in events if e["outcome"] == "tokenized" and e["split"] == "val"}
    models = cat.query(con, "SELECT name, version, aliases, tokenize_sha256, val_bpb FROM models ORDER BY name, version")
    for e in events:  # which registered models a tokenize dataset fed: a failed run's fed none
        if e["outcome"] == "tokenized":
            e["models"] = ", ".join(f"{m['name']}/{m['version']}" for m in models
                                    if m["tokenize_sha256"] == e["dataset_sha256"]) or "none registered"
    near = [] if ids else near_ids(con, "(SELECT doc_id, source_id FROM kept UNION ALL SELECT doc_id, source_id "
                                        "FROM rejected)", ident)
    return {"query": ident, "doc_ids": doc_ids, "source_ids": sorted({r["source_id"] for r in ids}),
            "events": events, "near": near,
            "trained_by": [{k: m[k] for k in ("name", "version", "aliases")} for m in models
                           if m["tokenize_sha256"] in trained_on],
            "evaluated_by": [{k: m[k] for k in ("name", "version", "aliases")} for m in models
                             if m["tokenize_sha256"] in held_out]}


def print_doc(r: dict) -> None:
    if not r["events"]:
        print(f"no document with doc_id or source_id {r['query']!r} in any dataset" + did_you_mean(r["near"]))
        return
    print(f"{r['query']}: doc_id {', '.join(r['doc_ids'])}  source_id {', '.join(r['source_ids'])}")
    _print_events(r, {"doc_id"}, 9, "held out (val)")


def print_image(r: dict) -> None:
    """`lineage doc` of an image (lineage/images.py `image_lineage`)."""
    print(f"{r['query']}: image_id {', '.join(r['image_ids'])}  source_id {', '.join(r['source_ids'])}")
    for f in r["raw_files"]:
        print(f"  raw file {f['path']}  sha256 {f['sha256'][:16]}  {f['bytes']} B")
    _print_events(r, {"image_id", "source"}, 16, "held out (clip_evaluate)")


def _print_events(r: dict, skip: set[str], width: int, held: str) -> None:
    skip = skip | {"source_id", "dataset_path", "stage", "dataset_sha256", "dataset_dir", "created_at", "outcome"}
    for e in r["events"]:
        rest = "  ".join(f"{k}={v}" for k, v in e.items() if k not in skip)
        print(f"  {e['created_at']}  {e['stage']:<{width}} {e['outcome']:<{max(9, width - 4)}} {rest}  "
              f"[datasets/{e['stage']}/{Path(e['dataset_path'] or '').name}, sha256 {e['dataset_sha256'][:12]}]")
    fmt = lambda ms: ", ".join(f"{m['name']}/{m['version']}" + (f" @{m['aliases']}" if m["aliases"] else "")
                               for m in ms) or "none"
    print(f"  trained on by model versions: {fmt(r['trained_by'])}")
    print(f"  {held} for model versions: {fmt(r['evaluated_by'])}")


# --------------------------------------------------------------------------------------------------
# commands


def _emit(args, obj: Any, printer) -> int:
    if args.json:
        print(json.dumps(obj, default=str))
    else:
        printer(obj)
    return 0


def _fail(args, e: Exception) -> int:
    """A refused or unanswerable request: `lifecycle` prints it as one line (and a JSON line under --json), exit 2."""
    raise UsageError(str(e)) from e


def cmd_model(args) -> int:
    try:
        return _emit(args, model_lineage(_models(args), args.spec, _workdir(args)),
                     lambda x: print_model(x, args.files))
    except Exception as e:  # unknown model/version/alias (LookupError), PathEscape, an MLflow error
        return _fail(args, e)


def cmd_doc(args) -> int:
    try:
        con = cat.connect(_workdir(args), args.tracking_uri)
        r = image_lineage(con, args.id)  # an image's id (the image path), else a document's
        r = r if r["events"] else doc_lineage(con, args.id)
    except (FileNotFoundError, PathEscape) as e:
        return _fail(args, e)
    _emit(args, r, print_image if r.get("kind") == "image" else print_doc)
    return 0 if r["events"] else 3


def cmd_step(args) -> int:
    from lifecycle.lineage.steps import print_step, step_documents

    try:
        wd = _workdir(args)
        given = Path(args.run)
        run_dir = cat.inside(wd, given if given.is_absolute() or given.exists() else wd / "train" / args.run,
                             "run directory")
        r = step_documents(run_dir, args.step, check=lambda p, what: cat.inside(wd, p, what))
    except (FileNotFoundError, ValueError, PathEscape) as e:
        return _fail(args, e)
    return _emit(args, r, print_step)


def cmd_forget(args) -> int:
    try:
        wd = _workdir(args)
        con = cat.connect(wd, args.tracking_uri)
        r = add_images(con, forget_report(con, args.source_ids, wd))  # an image id: its lineage and models too
        out = wd / "audit" / f"forget-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
        cat.inside(wd, out.parent, "report directory").mkdir(parents=True, exist_ok=True)
        out = cat.inside(wd, out, "report")  # `audit` may exist already: a symlink out of the work dir is refused
    except (FileNotFoundError, PathEscape) as e:
        return _fail(args, e)
    out.write_text(json.dumps(r, indent=2, default=str))
    r["report"] = str(out)
    return _emit(args, r, lambda x: (print_forget(x, out, args.files), print_images(x)))


SQL_STATEMENTS = ("SELECT", "EXPLAIN")  # DESCRIBE, SHOW, SUMMARIZE and WITH ... SELECT are SELECT statements


def read_only_query(sql: str) -> None:
    """`lifecycle sql` answers questions; it changes nothing: COPY, ATTACH, SET, PRAGMA, INSTALL, CREATE... are
    refused before anything runs (and the connection itself can read only the catalog's files)."""
    import duckdb

    if not duckdb.extract_statements(sql):
        raise ValueError("no SQL statement given")
    for st in duckdb.extract_statements(sql):
        if st.type.name not in SQL_STATEMENTS:
            raise PermissionError(f"only SELECT queries are allowed, not {st.type.name}: {st.query.strip()[:80]!r}")


def cmd_sql(args) -> int:
    try:
        read_only_query(args.query)
        con = cat.connect(_workdir(args), args.tracking_uri)
        rows = cat.query(con, args.query)
    except Exception as e:  # duckdb errors name the table/column
        return _fail(args, e)
    if args.json:
        print(json.dumps(rows, default=str))
    else:
        cur = con.sql(args.query)
        cur.show(max_rows=args.max_rows, max_width=200)
    return 0


def _common(p) -> None:
    """--workdir, -c/--config and --set come from `lifecycle` (`names_run`), resolved the same for every command."""
    p.set_defaults(names_run=True)
    p.add_argument("--tracking-uri", help="MLflow tracking/registry URI (default: sqlite <workdir>/mlflow.db)")
    p.add_argument("--json", action="store_true", help="Print one JSON document.")


def register(sub) -> None:
    lin = sub.add_parser("lineage", help="Audit trail: model -> data, document -> models, deletion reports.")
    lsub = lin.add_subparsers(dest="what", required=True)
    m = lsub.add_parser("model", help="A model version's chain back to the raw input files.")
    m.add_argument("spec", metavar="NAME[/VERSION|@ALIAS]",
                   help="a registered model: its latest version, a version number or an alias (e.g. @champion)")
    _common(m)
    m.add_argument("--files", action="store_true", help="list every raw input file (default: their count)")
    m.set_defaults(func=cmd_model)
    d = lsub.add_parser("doc", help="A document's or image's path through every stage and the models that trained "
                                    "on it.")
    d.add_argument("id", metavar="ID", help="a doc_id, image_id or source_id")
    _common(d)
    d.set_defaults(func=cmd_doc)
    st = lsub.add_parser("step", help="The documents one training step read (recomputed from the sampler), "
                                      "sequence by sequence.")
    st.add_argument("run", metavar="RUN", help="a train run: its id under <workdir>/train/, or its directory")
    st.add_argument("step", type=int, metavar="STEP", help="the training step, as logged (1..max_steps)")
    _common(st)
    st.set_defaults(func=cmd_step)
    f = lsub.add_parser("forget", help="Everything holding these documents (a report; changes nothing; "
                                       "`lifecycle forget` acts on it).")
    f.add_argument("source_ids", nargs="+", metavar="ID", help="a source_id or doc_id")
    _common(f)
    f.add_argument("--files", action="store_true",
                   help="list every raw input file of the datasets holding them (default: their count)")
    f.set_defaults(func=cmd_forget)
    s = sub.add_parser("sql", help="DuckDB over the catalog of manifests, stats and rows (see lineage/catalog.py).")
    s.add_argument("query", help="one SELECT statement (tables: datasets, parents, raw_inputs, drops, rejected, "
                                 "kept, tokens, signatures, images, image_index, checkpoints, models)")
    s.add_argument("--max-rows", type=int, default=40, help="rows to print at most (default 40; --json prints all)")
    _common(s)
    s.set_defaults(func=cmd_sql)
