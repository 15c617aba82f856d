"""The MLflow model registry: register a packaged model with its lineage as version tags, and the promotion
policy that moves the `champion` alias. Run logging is `lineage.tracking`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from lifecycle.core.dataset import DatasetRef, sha256_json
from lifecycle.lineage.tracking import Tracker

CHAMPION = "champion"  # registry alias of the best model version so far
PROMOTION_METRIC = "val_bpb"  # lower is better; comparable across tokenizers
TAINT_TAG = "lifecycle.forget.tainted"  # tombstone ids of forgotten documents a version was trained on
EVAL_SET_TAG = "lifecycle.eval_set_sha256"  # digest of the evaluation set a version's metrics were computed on
WEIGHTS_TAG = "lifecycle.model_weights_sha256"  # digest of what the model computes with (`model_identity`)
MODEL_IDENTITY_FILES = ("model.safetensors", "model_config.json", "tokenizer.json", "tokenizer_config.json")


def model_identity(model_ref: DatasetRef) -> str:
    """sha256 over the package's weights, model config and tokenizer files (their digests in its manifest): the
    same for a package rebuilt from a repaired checkpoint with bitwise identical weights, whose commit marker
    (and so the package digest) differs."""
    files = model_ref.manifest().get("extra", [])
    return sha256_json(sorted((f["path"], f["sha256"]) for f in files if f["path"] in MODEL_IDENTITY_FILES))

# (champion's package directory) -> (its PROMOTION_METRIC on the candidate's evaluation set, how) or (None, why not)
Rescore = Callable[[Path], tuple[float | None, str]]


class Registry:
    """Model versions of `tracking.model_name`, registered from (and tagged onto) a tracker's parent run."""

    def __init__(self, tracker: Tracker):
        self.tracker, self.client, self.model_name = tracker, tracker.client, tracker.cfg.model_name

    @property
    def parent_id(self) -> str:
        return self.tracker.parent_id

    def register_model(self, model_dir: str | Path, tags: dict[str, str], description: str = "") -> tuple[str, str]:
        """Log the packaged model files to the parent run and register them as a new model version."""
        from mlflow.exceptions import MlflowException

        self.client.log_artifacts(self.parent_id, str(model_dir), "model")
        name = self.model_name
        try:
            self.client.create_registered_model(name)
        except MlflowException as e:
            if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
                raise
        source = f"{self.client.get_run(self.parent_id).info.artifact_uri}/model"
        mv = self.client.create_model_version(name, source=source, run_id=self.parent_id, tags=tags,
                                              description=description)
        self.client.set_tag(self.parent_id, "lifecycle.model_version", f"{name}/{mv.version}")
        return name, str(mv.version)

    def register_or_reuse(self, model_ref: DatasetRef, metrics: dict[str, Any], eval_set_sha256: str | None = None,
                          rescore: Rescore | None = None) -> tuple[str, str]:
        """Register the packaged model once; a rerun that produced the same package, or a package with bitwise
        identical weights, config and tokenizer (from a repaired checkpoint), reuses its version.

        Version tags: the package's, the weights' (`WEIGHTS_TAG`) and the checkpoint marker's sha256, the tokenizer digest, the config hash,
        the git commit, `lifecycle.dataset.<stage>.sha256` for every dataset from collect to the token shards,
        `lifecycle.raw_input.<i>` = "sha256 path" for every raw input file (and `lifecycle.raw_inputs_sha256`
        over the whole list), `metric.<name>` for the evaluation metrics and `lifecycle.eval_set_sha256`, the digest
        of the evaluation set they were computed on (see `promote`)."""
        name = self.model_name
        if eval_set_sha256:
            self.client.set_tag(self.parent_id, EVAL_SET_TAG, eval_set_sha256)
        identity = model_identity(model_ref)
        try:
            for mv in self.client.search_model_versions(f"name = '{name}'"):
                if mv.tags.get("lifecycle.model_package_sha256") == model_ref.sha256 or \
                        mv.tags.get(WEIGHTS_TAG) == identity:
                    self.client.set_tag(self.parent_id, "lifecycle.model_version", f"{name}/{mv.version}")
                    return name, str(mv.version)
        except Exception as e:  # no registered model yet
            if "RESOURCE_DOES_NOT_EXIST" not in str(e):
                raise
        lineage = json.loads((model_ref.dir / "lineage.json").read_text())
        parent_tags = self.tracker.parent_tags()
        raw = sorted({r["path"]: r["sha256"] for d in lineage["datasets"] for r in d["inputs"]}.items())
        tags = {
            "lifecycle.model_package_sha256": model_ref.sha256,
            WEIGHTS_TAG: identity,
            "lifecycle.model_package_manifest": str(model_ref.manifest_path),
            "lifecycle.checkpoint_marker_sha256": lineage["checkpoint_marker_sha256"],
            "lifecycle.checkpoint_dir": lineage["checkpoint_dir"],
            "lifecycle.checkpoint_step": str(lineage.get("checkpoint_step")),
            "lifecycle.tokenizer_sha256": str(lineage.get("tokenizer_sha256")),
            "lifecycle.config_sha256": parent_tags.get("lifecycle.config_sha256", ""),
            "lifecycle.git_commit": parent_tags.get("lifecycle.git_commit", ""),
            "lifecycle.raw_inputs_sha256": sha256_json(raw),
            "lifecycle.raw_inputs": json.dumps(raw)[:7900],
        }
        if base := lineage.get("base_model"):  # which open model this version continued
            tags["lifecycle.base_model"] = base["dir"]
            tags["lifecycle.base_model_sha256"] = sha256_json(base["files"])
        for i, (path, sha) in enumerate(raw):
            tags[f"lifecycle.raw_input.{i}"] = f"{sha} {path}"[:7900]
        for d in lineage["datasets"]:
            tags[f"lifecycle.dataset.{d['stage']}.sha256"] = d["sha256"]
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                tags[f"metric.{k}"] = repr(float(v))
        if eval_set_sha256:
            tags[EVAL_SET_TAG] = eval_set_sha256
        name, version = self.register_model(model_ref.dir, tags, description=f"lineage: {model_ref.manifest_path}")
        self.promote(name, version, metrics.get(PROMOTION_METRIC), eval_set_sha256, rescore)
        return name, version

    def register_package(self, model_ref: DatasetRef, metrics: dict[str, Any], kind: str) -> tuple[str, str]:
        """Register a model package without the text path's lineage.json (the image path's dual encoder, `kind`
        clip) once; a rerun with the same package, or the same weights, config and tokenizer, reuses its version.
        Tags: the package's and the weights' digests, `lifecycle.dataset.<stage>.sha256` of every dataset it came
        from (the manifests' parents, followed up), `metric.<name>`. No champion alias: `promote` compares text
        models' val_bpb."""
        identity = model_identity(model_ref)
        for mv in self.client.search_model_versions(f"name = '{self.model_name}'"):
            if mv.tags.get("lifecycle.model_package_sha256") == model_ref.sha256 or mv.tags.get(WEIGHTS_TAG) == identity:
                self.client.set_tag(self.parent_id, "lifecycle.model_version", f"{self.model_name}/{mv.version}")
                return self.model_name, str(mv.version)
        tags = {"lifecycle.model_kind": kind, "lifecycle.model_package_sha256": model_ref.sha256, WEIGHTS_TAG: identity,
                "lifecycle.model_package_manifest": str(model_ref.manifest_path),
                **{f"metric.{k}": repr(float(v)) for k, v in metrics.items() if isinstance(v, (int, float))}}
        todo = list(model_ref.manifest()["parents"])
        while todo:
            p = todo.pop()
            tags[f"lifecycle.dataset.{p['stage']}.sha256"] = p["sha256"]
            todo += json.loads(Path(p["manifest"]).read_text()).get("parents", [])
        return self.register_model(model_ref.dir, tags, description=f"{kind}: {model_ref.manifest_path}")

    def champion_package(self) -> tuple[str, Path] | None:
        """(version, package directory) of the registered model's champion, or None when there is none."""
        from mlflow.exceptions import MlflowException

        try:
            champ = self.client.get_model_version_by_alias(self.model_name, CHAMPION)
        except MlflowException:
            return None
        manifest = champ.tags.get("lifecycle.model_package_manifest")
        return (str(champ.version), Path(manifest).parent) if manifest else None

    def taint(self, versions: list[dict], tombstone_ids: list[str]) -> list[str]:
        """Tag each version ({name, version}) as trained on forgotten documents (`TAINT_TAG`: the tombstone ids,
        added to any it had). A tainted champion is replaced by the next version that is not tainted, whatever
        the metric (`promote`), and is never a warm start. Returns "name/version" of the versions tagged."""
        done = []
        for v in versions:
            mv = self.client.get_model_version(v["name"], str(v["version"]))
            ids = sorted(set(filter(None, mv.tags.get(TAINT_TAG, "").split(","))) | set(tombstone_ids))
            self.client.set_model_version_tag(v["name"], str(v["version"]), TAINT_TAG, ",".join(ids)[:7900])
            done.append(f"{v['name']}/{v['version']}")
        return done

    def champion_taint(self) -> tuple[str, str] | None:
        """(version, tombstone ids) when the champion was trained on forgotten documents, else None."""
        from mlflow.exceptions import MlflowException

        try:
            champ = self.client.get_model_version_by_alias(self.model_name, CHAMPION)
        except MlflowException:
            return None
        return (str(champ.version), champ.tags[TAINT_TAG]) if champ.tags.get(TAINT_TAG) else None

    def promotion(self, name: str, version: str) -> dict[str, str]:
        """The promotion record of a version (`lifecycle.promotion.*` tags), also copied to the parent run."""
        tags = self.client.get_model_version(name, version).tags
        rec = {k.removeprefix("lifecycle.promotion."): v for k, v in tags.items() if k.startswith("lifecycle.promotion.")}
        for k, v in rec.items():
            self.client.set_tag(self.parent_id, f"lifecycle.promotion.{k}", v)
        return rec

    def promote(self, name: str, version: str, candidate: float | None, eval_set_sha256: str | None = None,
                rescore: Rescore | None = None) -> dict:
        """Move alias `champion` to `version` only if its validation bits per byte is strictly lower than the
        current champion's on the same evaluation set (or there is no champion yet).

        Same set: both versions carry the same `lifecycle.eval_set_sha256`, and their registered values are
        compared. Different sets (or a champion registered without a digest): the champion is re-scored on the
        candidate's set by `rescore(champion's package dir)` and that value is compared; when there is no
        `rescore`, or it cannot score the champion (package gone, another tokenizer), promotion is refused with
        the reason. A champion tagged as trained on forgotten documents (`taint`) is replaced by any version
        that is not, with that reason. The decision, the reason, both numbers and both digests are tags on the new
        version and on the parent run (`lifecycle.promotion.*`)."""
        from mlflow.exceptions import MlflowException

        try:
            champ = self.client.get_model_version_by_alias(name, CHAMPION)
        except MlflowException:
            champ = None
        champ_bpb = float(champ.tags[f"metric.{PROMOTION_METRIC}"]) if champ is not None and \
            f"metric.{PROMOTION_METRIC}" in champ.tags else None
        champ_set = champ.tags.get(EVAL_SET_TAG) if champ is not None else None
        decision, reason, comparison, champ_value = metric_gate(champ, champ_bpb, champ_set, candidate,
                                                                eval_set_sha256, rescore)
        tainted = champ.tags.get(TAINT_TAG) if champ is not None else None
        if (decision != "promoted" and candidate is not None and tainted
                and not self.client.get_model_version(name, version).tags.get(TAINT_TAG)):
            decision = "promoted"
            reason = (f"champion version {champ.version} was trained on forgotten documents (tombstones "
                      f"{tainted[:200]}); a version without them replaces it whatever the metric (the metric "
                      f"gate said: {reason})")
        if decision == "promoted":
            self.client.set_registered_model_alias(name, CHAMPION, version)
        record = {"decision": decision, "reason": reason, "metric": PROMOTION_METRIC,
                  "candidate_version": str(version), "candidate_value": candidate,
                  "champion_version_before": str(champ.version) if champ is not None else None,
                  "champion_value_before": champ_bpb, "champion_value_compared": champ_value,
                  "comparison": comparison, "candidate_eval_set": eval_set_sha256, "champion_eval_set": champ_set}
        for k, v in record.items():
            self.client.set_model_version_tag(name, version, f"lifecycle.promotion.{k}", str(v))
            self.client.set_tag(self.parent_id, f"lifecycle.promotion.{k}", str(v))
        return record


def metric_gate(champ, champ_bpb: float | None, champ_set: str | None, candidate: float | None,
                eval_set_sha256: str | None, rescore: Rescore | None) -> tuple[str, str, str, float | None]:
    """`Registry.promote`'s metric comparison: (decision, reason, comparison, the champion's value compared)."""
    comparison, champ_value = "", champ_bpb
    if candidate is None:
        decision, reason = "not_promoted", f"the new version has no {PROMOTION_METRIC}"
    elif champ is None:
        decision, reason = "promoted", "no champion yet"
    elif champ_bpb is None:
        decision, reason = "promoted", f"champion version {champ.version} has no {PROMOTION_METRIC}"
    else:
        comparison = f"same eval set {str(champ_set)[:12]}"
        if champ_set is None or champ_set != eval_set_sha256:
            sets = (f"champion version {champ.version} was scored on eval set {str(champ_set)[:12]}, "
                    f"the candidate on {str(eval_set_sha256)[:12]}")
            how = "no re-scoring available"
            champ_value = None
            if rescore is not None and eval_set_sha256:
                package = champ.tags.get("lifecycle.model_package_manifest")
                champ_value, how = rescore(Path(package).parent) if package else (None, "it has no package tag")
            comparison = f"{sets}; {how}"
        if champ_value is None:
            decision, reason = "not_promoted", f"not comparable: {comparison}"
        elif candidate < champ_value:
            decision = "promoted"
            reason = f"{PROMOTION_METRIC} {candidate:.6g} < champion's {champ_value:.6g} ({comparison})"
        else:
            decision = "not_promoted"
            reason = f"{PROMOTION_METRIC} {candidate:.6g} >= champion's {champ_value:.6g} ({comparison})"
    return decision, reason, comparison, champ_value
