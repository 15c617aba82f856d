"""checkpoint (publish): verify the committed training checkpoint and package it as a model dataset.

The package is a dataset directory like any other (manifest written last), holding the consolidated
weights (`model.safetensors`), `model_config.json`, the `tokenizer.json` the model was trained with, the
checkpoint's commit marker, and `lineage.json`: the chain of datasets (sha256 and manifest) from the token
shards back to the raw input files. The registry entry points at this package.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lifecycle.core.code import code_version
from lifecycle.core.dataset import DatasetRef, DatasetWriter, materialize
from lifecycle.core.fs import sha256_file
from lifecycle.core.shards import StageCode
from lifecycle.tasks.train.commit import MARKER, read_marker, verify

NAME = "checkpoint"
MODEL_FILES = ("model.safetensors", "model_config.json")


def dataset_chain(ref: DatasetRef) -> list[dict]:
    """Every dataset from `ref` back to collect, following manifest parents, with the raw input files."""
    chain, manifest_path = [], ref.manifest_path
    seen = set()
    stack = [Path(manifest_path)]
    while stack:
        mp = stack.pop()
        if str(mp) in seen:
            continue
        seen.add(str(mp))
        m = json.loads(mp.read_text())
        chain.append({"stage": m["stage"], "sha256": m["sha256"], "fingerprint": m["fingerprint"],
                      "num_rows": m["num_rows"], "manifest": str(mp), "inputs": m.get("inputs", [])})
        stack.extend(Path(p["manifest"]) for p in m.get("parents", []))
    return chain


def package_model(train, tokens: DatasetRef, workdir: str) -> DatasetRef:
    """The checkpoint stage: verify the trained checkpoint (`train.checkpoint_dir`) and package it with its
    tokenizer and lineage as a committed dataset, which the flow registers in MLflow."""
    ckpt = Path(train.checkpoint_dir)
    problem = verify(ckpt)  # every file listed in the commit marker, re-hashed
    if problem:
        raise RuntimeError(f"checkpoint {ckpt} is not a valid committed checkpoint: {problem}")
    marker = read_marker(ckpt)
    marker_sha = sha256_file(ckpt / MARKER)
    tok_manifest = tokens.manifest()
    config = {"checkpoint_marker_sha256": marker_sha, "tokens_sha256": tokens.sha256}

    def build(writer: DatasetWriter) -> dict:
        for name in MODEL_FILES:
            shutil.copyfile(ckpt / name, writer.path(name))
            writer.add_file(name)
        shutil.copyfile(ckpt / MARKER, writer.path(MARKER))
        writer.add_file(MARKER)
        shutil.copyfile(tokens.dir / "tokenizer.json", writer.path("tokenizer.json"))
        writer.add_file("tokenizer.json")
        base = getattr(train, "base_model", None)
        if base:  # a base model's own BOS/EOS tokens (the export reads them)
            shutil.copyfile(tokens.dir / "tokenizer_config.json", writer.path("tokenizer_config.json"))
            writer.add_file("tokenizer_config.json")
        lineage = {
            "checkpoint_dir": str(ckpt),
            "checkpoint_step": marker.get("step"),
            "checkpoint_marker_sha256": marker_sha,
            "tokenizer_sha256": tok_manifest.get("tokenizer_sha256"),
            "datasets": dataset_chain(tokens),
        }
        if base:  # the Hugging Face checkpoint the run continued: a parent above the data
            lineage["base_model"] = {"dir": base, "files": [{"name": n, "sha256": h}
                                                            for n, h in sorted(train.base_model_files.items())]}
        writer.path("lineage.json").write_text(json.dumps(lineage, indent=2))
        writer.add_file("lineage.json")
        return {"num_rows": 0, "extra": {"checkpoint_marker_sha256": marker_sha,
                                         "tokenizer_sha256": tok_manifest.get("tokenizer_sha256")}}

    return materialize(workdir, NAME, config, code_version(__package__), build, parents=[tokens])


STAGE = StageCode(run=package_model)  # what the registry (`lifecycle.tasks.stages`) runs, as one task


def warm_start(package_dir: str | Path, train_cfg) -> tuple[Path | None, str]:
    """The package's weights if a run with `train_cfg` can start from them (`train.init_from: champion`):
    the architecture must be the same (`model.vocab_size` null matches any, since the package's tokenizer
    is reused). Returns (weights or None, the reason)."""
    package_dir = Path(package_dir)
    if train_cfg.model_size == "auto":
        return None, "model_size is auto: the architecture is chosen per run, so it cannot be compared"
    # a package written before ModelConfig gained fields reads as their defaults
    theirs = type(train_cfg.model).model_validate_json((package_dir / "model_config.json").read_text()).model_dump(mode="json")
    ours = train_cfg.model_arch.model_dump(mode="json")  # with the experts of train.moe
    if ours.get("vocab_size") is None:
        ours["vocab_size"] = theirs.get("vocab_size")
    diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    if diff:
        return None, "model config differs from the champion's in " + ", ".join(
            f"{k} ({theirs.get(k)} -> {ours.get(k)})" for k in diff)
    return package_dir / "model.safetensors", "same model config as the champion"
