"""Evaluate task: how good is a committed checkpoint on the held-out split, and is that split clean?

1. Loss on the val token shard. The shard is cut into consecutive, non-overlapping windows of `seq_len`
   predictions (window i predicts tokens i·T+1 … i·T+T from tokens i·T … i·T+T-1; the last window may be
   shorter), so every val token is predicted at most once and never from a token of an earlier window. The
   loss is the token-weighted mean over all windows: deterministic and, up to float summation order,
   independent of the batch size. From it: `val_loss` (nats/token), `val_perplexity` and `val_bpb`, bits per
   UTF-8 byte of the predicted tokens, which is comparable across tokenizers. The byte count is exact: the
   tokenizer is byte-level BPE, so every vocabulary symbol stands for exactly one byte and a token's byte
   length is the length of its string; special tokens (end-of-text) count 0 bytes. So
   bpb = sum(nats) / (ln 2 · sum(bytes of the predicted tokens)).
2. Generation: the first `prompt_tokens` tokens of each of `num_prompts` val documents are continued greedily
   (argmax, deterministic) for `continuation_tokens` tokens and scored against the document's true next
   tokens with sacrebleu's corpus BLEU and rouge-score's ROUGE-1/2/L F1 (mean over prompts). The first
   `num_examples` (prompt, reference, generated) triples are returned for the run's artifacts.
3. Contamination (GPT-3 appendix C; lm-eval's decontamination), read, not recomputed: the train/val overlap is a
   data check that tokenize ran before training (`tasks/data/tokenize/checks.py`, failing the run there above
   `tokenize.max_contamination`); its `contamination_*` figures are copied from the token dataset's manifest.
   `contamination_doc_rate` is the share of val documents with at least one word n-gram found in the train split
   ("dirty", GPT-3's definition), `contamination_ngram_rate` the share of val n-grams found there. When the
   decontamination step ran (`tasks/data/decontaminate/`), `decontam_rejected.<set>` is how many training
   documents it removed for overlapping each eval set, and `decontam_sets` how many sets it checked.
4. Beside them: METEOR of the continuations (`metrics_text`), the same text and prompts perturbed
   (`robustness`), toxicity and count-based bias of generations (`safety`); each module documents its metrics.
5. The evaluation set (val doc_ids and texts) is committed as `eval_set.jsonl` with its digest
   `eval_set_sha256` in the manifest, which the champion gate compares (`gate`).

The model is rebuilt from the checkpoint's `model.safetensors` + `model_config.json` (no pickle), after the
commit marker's hashes are checked. torch is imported lazily: the CLI imports this module for `EvaluateConfig`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core.code import code_version
from lifecycle.core.dataset import DatasetRef, materialize
from lifecycle.core.fs import sha256_file
from lifecycle.core.shards import StageCode
from lifecycle.tasks.eval.evaluate import gate, metrics_text
from lifecycle.tasks.eval.evaluate.robustness import RobustnessConfig, robustness
from lifecycle.tasks.eval.evaluate.safety import SafetyConfig, safety
from lifecycle.tasks.eval.evaluate.scoring import (bits_per_byte, greedy_continue, held_out_loss,  # noqa: F401
                                                   token_byte_lengths, windows)
from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.data.decontaminate.ngrams import ContaminationError  # noqa: F401  (raised by tokenize)
from lifecycle.tasks.data.decontaminate.sets import resolve_set
from lifecycle.tasks.data.tokenize.stage import token_shards
from lifecycle.tasks.eval.code.config import CodeEvalConfig


class EvaluateConfig(BaseModel):
    """What to score on the held-out split, and when to fail the run for contamination."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    max_batches: int | None = Field(None, ge=1)
    """Score at most this many batches of full windows (null = the whole val shard, tail window included)."""
    batch_size: int = Field(8, ge=1)
    """Windows per forward pass (changes speed, and the loss only by float summation order)."""
    num_prompts: int = Field(16, ge=0)
    """Val documents whose opening is continued by the model and scored with BLEU/ROUGE (0 = no generation)."""
    prompt_tokens: int = Field(32, ge=1)
    """Tokens of each document given as the prompt."""
    continuation_tokens: int = Field(32, ge=1)
    """Tokens generated (greedy) and compared with the document's true next tokens."""
    num_examples: int = Field(5, ge=0)
    """(prompt, reference, generated) examples kept for the run's artifacts."""
    code: CodeEvalConfig = CodeEvalConfig()
    """pass@k of sampled code completions, run in a sandbox (off by default; tasks/eval/code/)."""
    meteor_synonyms: Literal["auto", "wordnet", "none"] = "auto"
    """METEOR's synonym pass: "wordnet" (WordNet 3.0 from Debian's wordnet-base, which `make install` installs;
    a run stops before any stage when it is absent), "none" (exact + stem matches only, logged as
    gen_meteor_nosyn), or "auto": "wordnet" where the database is installed, else "none", resolved when the run
    starts, which says so (lifecycle/preflight.py)."""
    robustness: RobustnessConfig = RobustnessConfig()
    """Held-out text and prompts scored clean and perturbed (typos, case, whitespace)."""
    safety: SafetyConfig = SafetyConfig()
    """Toxicity share and count-based bias of the generations."""


# --------------------------------------------------------------------------------------------------
# pure functions


def data_checks(tokens: DatasetRef) -> dict[str, float]:
    """The data checks' figures, computed before training: tokenize's train/val overlap (`contamination_*`) and,
    when the decontamination step ran upstream, the training documents it removed per eval set."""
    m = tokens.manifest()
    found = m.get("contamination")
    if found is None:
        raise ValueError(f"{tokens.manifest_path}: no `contamination` figures (a token dataset from before the data "
                         "checks moved to tokenize); rerun tokenize")
    out = {k: v for k, v in found.items() if k.startswith("contamination_")}
    for manifest in _ancestors(m):
        if manifest.get("stage") == "decontaminate":
            counters = (manifest.get("stats") or {}).get("counters", {})
            sets = manifest["config"]["sets"]
            out["decontam_sets"] = len(sets)
            for spec in sets:
                name = resolve_set(spec).name
                out[f"decontam_rejected.{name}"] = counters.get(f"contaminated_{name}", 0)
            break
    return out


def _ancestors(manifest: dict):
    """The manifests above `manifest`, nearest first, following first parents."""
    parents = manifest.get("parents") or []
    while parents:
        m = json.loads(Path(parents[0]["manifest"]).read_text())
        yield m
        parents = m.get("parents") or []


def text_scores(generated: list[str], references: list[str], synonyms: str = "wordnet") -> dict[str, float]:
    """sacrebleu corpus BLEU (0-100), mean rouge-score F1 of ROUGE-1, ROUGE-2 and ROUGE-L (0-1) and mean
    nltk METEOR (0-1; `metrics_text.meteor`)."""
    import sacrebleu
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    per = [scorer.score(ref, gen) for gen, ref in zip(generated, references)]
    out = {"gen_bleu": sacrebleu.corpus_bleu(generated, [references]).score}
    for k in ("rouge1", "rouge2", "rougeL"):
        out[f"gen_{k}"] = float(np.mean([p[k].fmeasure for p in per])) if per else 0.0
    return out | metrics_text.meteor(generated, references, synonyms)


# --------------------------------------------------------------------------------------------------
# the stage


def _side_table(tokens: DatasetRef):
    """doc_id, split, shard, token_start, token_end of every packed document, in shard order."""
    t = tokens.read(["doc_id", "source_id", "split", "shard", "token_start", "token_end"])
    return t.sort_by([("split", "ascending"), ("shard", "ascending"), ("token_start", "ascending")])


def _doc_texts(tokens: DatasetRef) -> dict[str, str]:
    parents = tokens.manifest().get("parents") or []
    if len(parents) != 1:
        raise ValueError(f"{tokens.manifest_path}: expected one parent dataset, found {len(parents)}")
    docs = DatasetRef.from_dir(Path(parents[0]["manifest"]).parent).read(["doc_id", "text"])
    return dict(zip(docs.column("doc_id").to_pylist(), docs.column("text").to_pylist()))


def eval_set_of_tokens(tokens: DatasetRef, side=None) -> list[tuple[str, str]]:
    """The evaluation set: (doc_id, text) of the token dataset's val documents, in side-table order. Its digest
    (`gate.eval_set_digest`) names what val_bpb was computed on, for the promotion gate."""
    side = _side_table(tokens) if side is None else side
    texts = _doc_texts(tokens)
    split = dict(zip(side.column("doc_id").to_pylist(), side.column("split").to_pylist()))
    return [(d, texts[d]) for d, s in split.items() if s == "val"]


def _loss(model, data: np.ndarray, nbytes: np.ndarray, cfg: EvaluateConfig) -> dict:
    return held_out_loss(model, data, nbytes, cfg.batch_size, cfg.max_batches)


def _generate(model, tokenizer, side, shards: dict[str, np.ndarray], cfg: EvaluateConfig) -> tuple[dict, list, tuple]:
    import torch

    P, K = cfg.prompt_tokens, cfg.continuation_tokens
    picked = []
    for r in side.to_pylist():
        if r["split"] == "val" and r["token_end"] - r["token_start"] >= P + K:
            picked.append(r)
            if len(picked) == cfg.num_prompts:
                break
    if not picked:
        return {"gen_prompts": 0}, [], ([], [], [])
    seqs = np.stack([shards[r["shard"]][r["token_start"] : r["token_start"] + P + K] for r in picked]).astype(np.int64)
    out = greedy_continue(model, torch.from_numpy(seqs[:, :P]), K).numpy()
    gen = [tokenizer.decode(o.tolist()) for o in out]
    ref = [tokenizer.decode(s[P:].tolist()) for s in seqs]
    prompts = [tokenizer.decode(s[:P].tolist()) for s in seqs]
    scores = text_scores(gen, ref, cfg.meteor_synonyms) | {"gen_prompts": len(picked)}
    examples = [{"doc_id": r["doc_id"], "source_id": r["source_id"], "prompt": p, "reference": rf, "generated": g}
                for r, p, rf, g in list(zip(picked, prompts, ref, gen))[: cfg.num_examples]]
    return scores, examples, (prompts, ref, gen)


class Parts:
    """The parts of an evaluation, told to `progress` as each starts, with an ETA when an earlier evaluation's
    seconds per part are known (`previous`): its remaining parts' time, scaled by how this run's finished parts
    compare with that one's (a bigger model or more prompts scale alike)."""

    def __init__(self, names: list[str | None], progress: Callable[[str], None] | None,
                 previous: dict[str, float] | None):
        self.names, self.progress, self.previous = [n for n in names if n], progress, previous or {}
        self.seconds: dict[str, float] = {}
        self.current: tuple[str, float] | None = None

    def start(self, name: str, detail: str = "") -> None:
        self._close()
        self.current = (name, time.time())
        if self.progress is None:
            return
        text = f"part {self.names.index(name) + 1}/{len(self.names)}: {name}" + (f", {detail}" if detail else "")
        if (eta := self.eta(name)) is not None:
            text += f" (ETA {int(eta) // 60}:{int(eta) % 60:02d}, from the last evaluation in this work dir)"
        self.progress(text)

    def eta(self, name: str) -> float | None:
        rest = self.names[self.names.index(name):]
        if not self.previous or any(n not in self.previous for n in rest):
            return None
        done = [n for n in self.seconds if n in self.previous and self.previous[n] > 0]
        scale = sum(self.seconds[n] for n in done) / sum(self.previous[n] for n in done) if done else 1.0
        return scale * sum(self.previous[n] for n in rest)

    def finish(self) -> dict[str, float]:
        self._close()
        return {k: round(v, 3) for k, v in self.seconds.items()}

    def _close(self) -> None:
        if self.current is not None:
            self.seconds[self.current[0]] = time.time() - self.current[1]
            self.current = None


def previous_parts(workdir: str) -> dict[str, float] | None:
    """Seconds per part of the evaluation `latest/evaluate` points at in this work dir, if any."""
    manifest = Path(workdir) / "latest" / "evaluate" / "_manifest.json"
    try:
        return json.loads(manifest.read_text()).get("part_seconds")
    except (OSError, ValueError):
        return None


def run_evaluate(checkpoint_dir: str, tokens: DatasetRef, cfg: EvaluateConfig,
                 progress: Callable[[str], None] | None = None, previous: dict[str, float] | None = None) -> dict:
    """{"metrics": {val_loss, val_perplexity, val_bpb, gen_bleu, gen_rouge*, gen_meteor, robust_*, tox_*,
    bias_*, contamination_*, step, ...}, "examples": [{doc_id, prompt, reference, generated}, ...],
    "bias": {...}, "eval_set": [(doc_id, text), ...], "eval_set_sha256": ...} for a committed checkpoint.
    `progress(text)` is told each part as it starts ('part 2/4: generation, 16 prompts'), with an ETA when
    `previous` holds an earlier evaluation's seconds per part (`Parts`); "part_seconds" holds this one's."""
    from tokenizers import Tokenizer

    parts = Parts(["validation loss", "generation" if cfg.num_prompts else None, "robustness", "safety and bias",
                   "code pass@k" if cfg.code.enabled else None], progress, previous)
    part = parts.start

    marker = ckpt.read_marker(checkpoint_dir)
    meta = token_shards(tokens)
    if marker.get("tokenizer_sha256") not in (None, meta.tokenizer_sha256):
        raise ValueError(f"{checkpoint_dir} was trained with tokenizer {marker['tokenizer_sha256']}, "
                         f"but {tokens.path} uses {meta.tokenizer_sha256}")
    tokenizer = Tokenizer.from_file(meta.tokenizer_path)
    model = ckpt.load_model(checkpoint_dir)
    maps = meta.memmap("val")
    data = np.concatenate(maps) if maps else np.zeros(0, dtype=meta.dtype)
    part("validation loss")
    metrics = _loss(model, data, token_byte_lengths(tokenizer), cfg)
    side = _side_table(tokens)
    examples: list = []
    prompts, refs, gen = [], [], []
    if cfg.num_prompts:
        part("generation", f"{cfg.num_prompts} prompts")
        shards = {Path(p).name: np.memmap(p, dtype=meta.dtype, mode="r") for p in meta.val if Path(p).stat().st_size}
        scores, examples, (prompts, refs, gen) = _generate(model, tokenizer, side, shards, cfg)
        metrics.update(scores)
    eval_set = eval_set_of_tokens(tokens, side)
    part("robustness")
    metrics.update(robustness(model, tokenizer, meta.eot_id, [t for _, t in eval_set], prompts, refs,
                              cfg.continuation_tokens, cfg.robustness))
    part("safety and bias")
    safety_metrics, bias = safety(model, tokenizer, gen, cfg.safety)
    metrics.update(safety_metrics)
    metrics.update(data_checks(tokens))
    if cfg.code.enabled:  # pass@k of sampled completions (tasks/eval/code/sampling.py)
        from lifecycle.tasks.eval.code.sampling import code_metrics

        part("code pass@k")
        metrics.update(code_metrics(model, tokenizer, cfg.code))
    metrics["step"] = marker["step"]
    digest = gate.eval_set_digest(eval_set, meta.tokenizer_sha256, cfg.max_batches, cfg.batch_size)
    return {"metrics": metrics, "examples": examples, "bias": bias, "eval_set": eval_set, "eval_set_sha256": digest,
            "part_seconds": parts.finish()}


NAME = "evaluate"


def evaluate_stage(train, tokens: DatasetRef, cfg: EvaluateConfig, workdir: str,
                   progress: Callable[[str], None] | None = None) -> DatasetRef:
    """The evaluate stage: `run_evaluate` on the trained checkpoint, committed as a small dataset
    (`metrics.json`, `examples.json`; the metrics also in the manifest's `metrics`) under a fingerprint of the
    checkpoint's commit marker, the token dataset, this config and this folder's code. A rerun reuses it."""
    checkpoint_dir = train.checkpoint_dir
    marker_sha = sha256_file(Path(checkpoint_dir) / ckpt.MARKER)
    config = {"evaluate": cfg.model_dump(mode="json"), "checkpoint_marker_sha256": marker_sha}

    def build(writer) -> dict:
        result = run_evaluate(checkpoint_dir, tokens, cfg, progress, previous_parts(workdir))
        for name in ("metrics", "examples", "bias"):
            writer.path(f"{name}.json").write_text(json.dumps(result[name], indent=2, sort_keys=True))
            writer.add_file(f"{name}.json")
        gate.write_eval_set(writer.path(gate.EVAL_SET_FILE), result["eval_set"])
        writer.add_file(gate.EVAL_SET_FILE)
        return {"num_rows": 0, "extra": {"metrics": result["metrics"], "checkpoint_dir": checkpoint_dir,
                                         "eval_set_sha256": result["eval_set_sha256"],
                                         "part_seconds": result["part_seconds"]}}

    return materialize(workdir, NAME, config, code_version(__package__), build, parents=[tokens])


STAGE = StageCode(run=evaluate_stage)  # what the registry (`lifecycle.tasks.stages`) runs, as one task


def examples_of(ref: DatasetRef) -> list[dict]:
    return json.loads((ref.dir / "examples.json").read_text())
