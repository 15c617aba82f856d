"""The evaluation set as a committed dataset with a digest, and re-scoring a champion package on it.

The evaluation set of a run is the held-out (val) split that evaluate scores: its documents (doc_id, text) in
shard order, written as `eval_set.jsonl` into the evaluate stage's committed dataset. Its digest,
`eval_set_sha256`, is the sha256 of the canonical JSON of {the documents' sha256, the tokenizer's sha256 (the
val token stream is the documents under that tokenizer), and the scoring cut `max_batches` (+ `batch_size` when
a cut is set)}. It goes into the evaluate manifest, onto the registered model version
(`lifecycle.eval_set_sha256`) and onto the parent run. The promotion policy (`lineage.registry.promote`)
compares val_bpb only between versions of the same digest; otherwise it asks `rescore_package` for the
champion's val_bpb on the candidate's set, and refuses promotion with the reason when that is not possible.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lifecycle.core.dataset import DatasetRef, sha256_json, verify_dataset

EVAL_SET_FILE = "eval_set.jsonl"


def eval_set_digest(docs: list[tuple[str, str]], tokenizer_sha256: str, max_batches: int | None,
                    batch_size: int) -> str:
    """sha256 naming what val_bpb was computed on (see the module doc)."""
    cut = None if max_batches is None else {"max_batches": max_batches, "batch_size": batch_size}
    return sha256_json({"docs_sha256": sha256_json([list(d) for d in docs]), "tokenizer_sha256": tokenizer_sha256,
                        "cut": cut})


def write_eval_set(path: Path, docs: list[tuple[str, str]]) -> None:
    with open(path, "w") as f:
        for doc_id, text in docs:
            f.write(json.dumps({"doc_id": doc_id, "text": text}) + "\n")


def eval_set_of(evaluate_ref: DatasetRef) -> str | None:
    """The eval-set digest of a committed evaluate dataset (None for one written before digests existed)."""
    return evaluate_ref.manifest().get("eval_set_sha256")


def rescore_package(package_dir: str | Path, evaluate_ref: DatasetRef) -> tuple[float | None, str]:
    """(val_bpb, how) of a packaged model (checkpoint stage output) on the evaluation set of `evaluate_ref`,
    scored exactly as evaluate scored the candidate; (None, why not) when it cannot be."""
    from tokenizers import Tokenizer

    from lifecycle.tasks.data.tokenize.stage import token_shards
    from lifecycle.tasks.eval.evaluate.scoring import held_out_loss, token_byte_lengths
    from lifecycle.tasks.train import commit as ckpt

    package_dir = Path(package_dir)
    if not package_dir.is_dir():
        return None, f"the champion's package {package_dir} is gone"
    problems = verify_dataset(package_dir)
    if problems:
        return None, f"the champion's package {package_dir} does not verify: {problems[0]}"
    lineage = json.loads((package_dir / "lineage.json").read_text())
    manifest = evaluate_ref.manifest()
    parents = manifest.get("parents") or []
    if len(parents) != 1:
        raise ValueError(f"{evaluate_ref.manifest_path}: expected the token dataset as its one parent")
    tokens = DatasetRef.from_dir(Path(parents[0]["manifest"]).parent)
    meta = token_shards(tokens)
    if lineage.get("tokenizer_sha256") != meta.tokenizer_sha256:
        return None, (f"the champion's tokenizer {str(lineage.get('tokenizer_sha256'))[:12]} is not the candidate's "
                      f"{meta.tokenizer_sha256[:12]}: re-scoring would need the set re-tokenized, which the gate "
                      f"does not do")
    cfg = manifest["config"]["evaluate"]
    model = ckpt.load_model(package_dir, check=False)  # the package's files were verified above
    maps = meta.memmap("val")
    data = np.concatenate(maps) if maps else np.zeros(0, dtype=meta.dtype)
    scores = held_out_loss(model, data, token_byte_lengths(Tokenizer.from_file(meta.tokenizer_path)),
                           cfg["batch_size"], cfg["max_batches"])
    return scores["val_bpb"], f"re-scored on eval set {eval_set_of(evaluate_ref)[:12]}"
