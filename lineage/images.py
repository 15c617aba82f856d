"""`lifecycle lineage doc IMAGE_ID` on the image path: an image's way from its raw file through every image stage,
the shard it was preprocessed into and the registered dual encoders that trained on it (or held it out), read from
the catalog (lineage/catalog.py: the `images`, `image_index` and `rejected` views, `models`, `datasets`).

Which registered versions trained on an image: those whose image_preprocess dataset (`lifecycle.dataset.
image_preprocess.sha256`) holds it and whose clip_train did not hold it out (`clip_train.holdout`, a hash of the
image_id: `lifecycle.tasks.clip.config.held_out`); a held-out image was only scored by clip_evaluate."""

from __future__ import annotations

import json

from lifecycle.lineage import catalog as cat
from lifecycle.tasks.clip.config import held_out

ORDER = (*cat.IMAGE_STAGES, "image_preprocess")
KEPT_EXTRA = ("cluster_size", "faces", "caption_pii", "scrubbed_sha256")


def _where(ident: str) -> tuple[str, list]:
    return "(image_id = ? OR source_id = ?)", [ident, ident]


def _events(con, ident: str) -> list[dict]:
    where, params = _where(ident)
    cols = {r["column_name"] for r in cat.query(con, "DESCRIBE images")}
    sel = ", ".join(["image_id", "source_id", "source", "dataset_path", *(c for c in KEPT_EXTRA if c in cols)])
    events = [{"outcome": "kept", **r} for r in cat.query(con, f"SELECT {sel} FROM images WHERE {where}", params)]
    rej = {r["column_name"] for r in cat.query(con, "DESCRIBE rejected")}
    rsel = ", ".join(["doc_id AS image_id", "source_id", "dataset_path", "reason", "detail",
                      *(["duplicate_of"] if "duplicate_of" in rej else [])])
    events += [{"outcome": "rejected", **r} for r in cat.query(
        con, f"SELECT {rsel} FROM rejected WHERE (doc_id = ? OR source_id = ?) AND stage IN (SELECT unnest(?))",
        [*params, list(cat.IMAGE_STAGES)])]
    events += [{"outcome": "preprocessed", **r} for r in cat.query(
        con, f"SELECT image_id, source_id, dataset_path, shard, member FROM image_index WHERE {where}", params)]
    info = {r["path"]: r for r in cat.query(con, "SELECT stage, sha256, path, created_at FROM datasets")}
    for e in events:
        d = info.get(e["dataset_path"], {})
        e.update(stage=d.get("stage"), dataset_sha256=d.get("sha256"), created_at=d.get("created_at"))
    events = [{k: v for k, v in e.items() if v is not None or k in ("stage", "created_at")} for e in events]
    return sorted(events, key=lambda e: (e.get("created_at") or "", ORDER.index(e["stage"])
                                          if e.get("stage") in ORDER else 99))


def _raw_files(con, events: list[dict]) -> list[dict]:
    """The raw input files the image came from: a kept row's `source`, else the image_collect input file its
    source_id (`<file>:<key or row>`) names."""
    sources = {e["source"] for e in events if e.get("source")}
    sids = {e["source_id"] for e in events}
    out = {}
    for r in cat.query(con, "SELECT DISTINCT r.path, r.sha256, r.bytes FROM raw_inputs r JOIN datasets d "
                            "ON d.sha256 = r.dataset_sha256 WHERE d.stage = 'image_collect'"):
        if r["path"] in sources or any(s.startswith(r["path"] + ":") for s in sids):
            out[r["path"]] = r
    return sorted(out.values(), key=lambda r: r["path"])


def _holdout(con, package_sha256: str | None) -> float | None:
    rows = cat.query(con, "SELECT config FROM datasets WHERE stage = 'clip_train' AND sha256 = ?", [package_sha256])
    return json.loads(rows[0]["config"]).get("holdout") if rows else None


def image_lineage(con, ident: str) -> dict:
    """Every image dataset that kept or rejected the image(s) with this image_id or source_id, the shard it is
    in, and the registered models that trained on it or held it out. `events` is empty for an unknown id."""
    events = _events(con, ident)
    image_ids = sorted({e["image_id"] for e in events if e.get("image_id")})
    shards = {e["dataset_sha256"] for e in events if e["outcome"] == "preprocessed"}
    trained, evaluated = [], []
    models = cat.query(con, "SELECT name, version, aliases, package_sha256, image_preprocess_sha256 FROM models "
                            "WHERE kind = 'clip' ORDER BY name, version")
    for m in models if events else ():
        if m["image_preprocess_sha256"] not in shards:
            continue
        holdout = _holdout(con, m["package_sha256"])
        row = {"name": m["name"], "version": m["version"], "aliases": m["aliases"], "holdout": holdout}
        (evaluated if holdout is not None and all(held_out(i, holdout) for i in image_ids) else trained).append(row)
    return {"kind": "image", "query": ident, "image_ids": image_ids,
            "source_ids": sorted({e["source_id"] for e in events}), "raw_files": _raw_files(con, events) if events
            else [], "events": events, "trained_by": trained, "evaluated_by": evaluated}


def versions_trained_on_images(con, ids: list[str]) -> list[dict]:
    """{name, version} of every registered version that trained on one of these images (for `Registry.taint`)."""
    found = {(m["name"], m["version"]) for i in ids for m in image_lineage(con, i)["trained_by"]}
    return [{"name": n, "version": v} for n, v in sorted(found)]


def add_images(con, report: dict) -> dict:
    """A `lineage forget` report (lineage/forget_report.py) with the images among the requested ids: each one's
    lineage (`images`), and the versions that trained on it added to `model_versions`."""
    images = [x for x in (image_lineage(con, i) for i in report["requested_source_ids"]) if x["events"]]
    if images:
        report["images"] = images
        report["not_found"] = [i for i in report["not_found"] if i not in {x["query"] for x in images}]
        have = {(m["name"], m["version"]) for m in report["model_versions"]}
        for m in (m for x in images for m in x["trained_by"]):
            if (m["name"], m["version"]) not in have:
                have.add((m["name"], m["version"]))
                report["model_versions"].append(m)
    return report


def print_images(report: dict) -> None:
    for x in report.get("images", []):
        last = x["events"][-1]
        where = f"{last['stage']} {last['outcome']}" + (f" ({last['reason']})" if last.get("reason") else "")
        print(f"  image       {', '.join(x['image_ids'])}  from {', '.join(f['path'] for f in x['raw_files'])}; "
              f"last: {where}; `lifecycle lineage doc {x['query']}` for every stage")
