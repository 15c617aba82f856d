"""`lifecycle forget`: act on a deletion request (the CLI is `lifecycle.cli`; the pieces are below it).

1. `record_request`: the documents (by doc_id or source_id) are found in the work dir's collect datasets, hashed
   and signed, and written to the tombstone ledger (`tasks/data/collect/tombstones.py`). Every later collect
   rejects them and their near copies as `forgotten`. On the image path (`image_collect.enabled`) the ids are
   image_ids, found in image_collect's datasets, and the ledger is `tasks/data/images/tombstones.py`'s; only
   retraining removes an image from a model (unlearning is the text path's).
2. Then one of two routes:
   - retrain: the CLI reruns the lifecycle; collect's fingerprint holds the ledger's digest, so collect and every
     stage after it are recomputed and the new model's lineage (its collect dataset's config) names the tombstones.
   - unlearn (`unlearn_champion`): the champion package is loaded, gradient ascent forgets the documents' training
     token sequences (`tasks/eval/unlearn.py`, Jang et al. 2022), and the result is registered as a new version
     tagged `lifecycle.unlearned=true` with the tombstones and the forgetting metrics; the champion gate
     (`Registry.promote`, val_bpb) decides the alias as for any version. A refusal (validation loss rose beyond
     the bound, or memorisation did not reach the never-seen level) registers nothing and is logged to MLflow.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from lifecycle.core.dataset import DatasetRef
from lifecycle.core.errors import UsageError
from lifecycle.lineage.registry import CHAMPION, Registry
from lifecycle.lineage.tracking import Tracker
from lifecycle.tasks.data.collect import tombstones as tb
from lifecycle.tasks.eval import unlearn as ul


def image_path(cfg) -> bool:
    """Whether the request is for images: the config runs the image path, or (a work dir named without its
    config) the work dir holds image_collect datasets and no text collect ones."""
    d = Path(cfg.workdir) / "datasets"
    return cfg.image_collect.enabled or ((d / "image_collect").is_dir() and not (d / "collect").is_dir())


def record_request(cfg, ids: list[str], reason: str) -> list[dict]:
    """Tombstones for the documents `ids` (doc_ids or source_ids) in `cfg.workdir`'s ledger; returns the ledger
    rows of all of them (the ones recorded earlier too), without their signatures. Near copies are
    fingerprinted with the configured `dedup.method` (MinHash or SimHash, dedup's parameters)."""
    if not reason.strip():
        raise ValueError("--reason must say why the documents are forgotten (it is kept in the ledger)")
    if image_path(cfg):  # the image path: its own ledger (tasks/data/images/tombstones.py)
        from lifecycle.tasks.data.images import tombstones as itb

        rows = itb.tombstone_rows(itb.find_images(cfg.workdir, ids), reason, cfg.image_dedup.k)
        itb.add_tombstones(cfg.workdir, rows)
        want = {r["tombstone_id"] for r in rows}
        return [r for r in itb.read_ledger(cfg.workdir).to_pylist() if r["tombstone_id"] in want]
    docs = tb.find_documents(cfg.workdir, ids)
    rows = tb.tombstone_rows(docs, reason, tb.params_of(cfg.dedup))
    tb.add_tombstones(cfg.workdir, rows)
    want = {r["tombstone_id"] for r in rows}
    return [{k: v for k, v in r.items() if k != "signature"} for r in tb.read_ledger(cfg.workdir).to_pylist()
            if r["tombstone_id"] in want]


def taint_versions(cfg, tombstones: list[dict]) -> list[str]:
    """Tag every registered model version trained on the tombstoned documents (`Registry.taint`): the champion
    among them gives way to the next version without them, and is no longer a warm start. Returns
    "name/version" of the versions tagged (none when nothing was registered yet)."""
    from lifecycle.lineage import catalog as cat
    from lifecycle.lineage.forget_report import versions_trained_on

    tracker = Tracker(cfg.tracking, cfg.workdir, default_experiment=cfg.name)
    if not (Path(cfg.workdir) / "datasets").is_dir():
        return []
    con = cat.connect(cfg.workdir, tracker.uri)
    try:
        ids = sorted({t["doc_id"] for t in tombstones})
        if image_path(cfg):
            from lifecycle.lineage.images import versions_trained_on_images

            versions = versions_trained_on_images(con, ids)
        else:
            versions = versions_trained_on(con, ids)
    finally:
        con.close()
    return Registry(tracker).taint(versions, sorted({t["tombstone_id"] for t in tombstones})) if versions else []


class UnlearnRequest(BaseModel):
    """The MLflow parent run's config (and run key) of one unlearning."""

    model_config = ConfigDict(frozen=True)
    kind: str = "unlearn"
    champion: str
    tombstones: list[str]
    doc_ids: list[str]
    unlearn: ul.UnlearnConfig


def unlearn_champion(cfg, tombstones: list[dict], ucfg: ul.UnlearnConfig, log=print) -> dict:
    """Forget the tombstoned documents in the champion; register the result (see the module doc). Returns
    {status: registered | refused, model, promotion, metrics, package}."""
    tracker = Tracker(cfg.tracking, cfg.workdir, default_experiment=cfg.name)
    registry = Registry(tracker)
    found = registry.champion_package()
    if found is None:
        raise LookupError(f"model {tracker.cfg.model_name} has no @{CHAMPION} version to unlearn from "
                          "(run the lifecycle first, or use --retrain)")
    version, package = found
    asked = len(tombstones)
    tombstones = covering_tombstones(tombstones, registry.champion_taint(),
                                     tb.read_ledger(cfg.workdir).drop_columns(["signature"]).to_pylist())
    if len(tombstones) > asked:
        log(f"unlearning also forgets {len(tombstones) - asked} earlier tombstone(s) the champion is tainted by: "
            + ", ".join(t["tombstone_id"] for t in tombstones[asked:]))
    champion = DatasetRef.from_dir(package)
    lineage = json.loads((package / "lineage.json").read_text())
    tok = next(d for d in lineage["datasets"] if d["stage"] == "tokenize")
    tokens = DatasetRef.from_dir(Path(tok["manifest"]).parent)
    doc_ids = sorted({t["doc_id"] for t in tombstones})
    ids = sorted({t["tombstone_id"] for t in tombstones})
    request = UnlearnRequest(champion=f"{tracker.cfg.model_name}/{version}", tombstones=ids, doc_ids=doc_ids,
                             unlearn=ucfg)
    tracker.start(f"unlearn-{tracker.cfg.model_name}-v{version}", request,
                  {"lifecycle.kind": "unlearn", "lifecycle.unlearned_from": request.champion,
                   "lifecycle.tombstones": ",".join(ids)[:7900]})
    try:
        model, metrics = ul.unlearn(package, tokens, doc_ids, ucfg, log=log)
    except ul.UnlearningRefused as e:
        tracker.log_metrics("unlearn", {k: v for k, v in e.metrics.items() if isinstance(v, (int, float))})
        tracker.set_parent_tag("lifecycle.unlearn.status", "refused")
        tracker.set_parent_tag("lifecycle.unlearn.reason", str(e)[:5000])
        tracker.end("FINISHED")
        return {"status": "refused", "reason": str(e), "champion": request.champion, "metrics": e.metrics}
    except BaseException as e:  # stopped (SIGTERM, ^C: KILLED) or failed; nothing was registered
        stopped = not isinstance(e, Exception)
        tracker.set_parent_tag("lifecycle.unlearn.status", "stopped" if stopped else "failed")
        tracker.set_parent_tag("lifecycle.unlearn.undone", f"tombstones {', '.join(ids)} still to forget: the "
                               f"champion stays tainted; rerun `lifecycle forget ... --unlearn` (or --retrain)")
        tracker.end("KILLED" if stopped else "FAILED")
        raise
    tracker.log_metrics("unlearn", metrics)
    extra = {"unlearned_from": request.champion, "champion_package_sha256": champion.sha256,
             "tombstones": ids, "doc_ids": doc_ids, "metrics": metrics, "config": ucfg.model_dump()}
    ref = ul.write_package(cfg.workdir, champion, model, extra, request.model_dump(mode="json"))
    # the champion's val_bpb is the evaluate stage's (evaluate.max_batches x batch_size of the val split): compare
    # like with like, and name the evaluation set by the evaluate stage's digest so that the gate compares at all
    gate = _val(model, tokens, package, cfg.evaluate.max_batches, cfg.evaluate.batch_size)
    metrics_for_gate = {**metrics, "val_bpb": gate["val_bpb"], "val_loss": gate["val_loss"]}
    name, new_version = registry.register_or_reuse(ref, metrics_for_gate,
                                                   eval_set_sha256=_eval_set_sha256(tokens, cfg.evaluate))
    for k, v in {"lifecycle.unlearned": "true", "lifecycle.unlearned_from": request.champion,
                 "lifecycle.tombstones": ",".join(ids)[:7900]}.items():
        tracker.client.set_model_version_tag(name, new_version, k, v)
    promotion = registry.promotion(name, new_version)
    tracker.set_parent_tag("lifecycle.unlearn.status", "registered")
    tracker.end("FINISHED")
    return {"status": "registered", "model": {"name": name, "version": new_version}, "champion": request.champion,
            "promotion": promotion, "metrics": metrics, "package": str(ref.manifest_path)}


def covering_tombstones(requested: list[dict], taint: tuple[str, str] | None, ledger: list[dict]) -> list[dict]:
    """The tombstones an unlearning of the champion must cover: the ones requested now and every one the champion
    is tainted with (`Registry.champion_taint`: (version, comma-separated tombstone ids)), such as those of an
    earlier unlearning that was interrupted or refused. A version that forgets fewer would move `@champion` to a
    model that still holds a forgotten document. `ledger`: the tombstone ledger's rows."""
    want = {t["tombstone_id"] for t in requested} | (set(filter(None, taint[1].split(","))) if taint else set())
    have = {t["tombstone_id"] for t in requested}
    extra = [r for r in ledger if r["tombstone_id"] in want - have]
    missing = want - have - {r["tombstone_id"] for r in extra}
    if missing:
        raise UsageError(f"the champion is tainted by tombstone(s) {', '.join(sorted(missing))} that the ledger "
                         "does not hold: refusing to unlearn only part of what it must forget")
    return [*requested, *extra]


def _val(model, tokens: DatasetRef, package: Path, batches: int | None, batch_size: int) -> dict[str, float]:
    from tokenizers import Tokenizer

    return ul.val_loss(model, tokens, Tokenizer.from_file(str(package / "tokenizer.json")), batches, batch_size)


def _eval_set_sha256(tokens: DatasetRef, ecfg) -> str:
    """The digest the evaluate stage gives this token dataset's evaluation set (tasks/eval/evaluate/gate.py)."""
    from lifecycle.tasks.eval.evaluate import gate
    from lifecycle.tasks.data.tokenize.stage import token_shards
    from lifecycle.tasks.eval.evaluate.stage import eval_set_of_tokens

    return gate.eval_set_digest(eval_set_of_tokens(tokens), token_shards(tokens).tokenizer_sha256, ecfg.max_batches,
                                ecfg.batch_size)
