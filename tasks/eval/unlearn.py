"""Knowledge unlearning (Jang et al. 2022, "Knowledge Unlearning for Mitigating Privacy Risks in Language Models"):
gradient ascent on the token sequences of forgotten documents, in small sequential chunks, until the model
holds them no better than text it never saw.

Measures (the paper's section 3):
- memorisation accuracy MA(x) = mean over t of 1[argmax p(. | x_<t) = x_t], for t = 1..T-1;
- extraction likelihood EL_n(x) = mean over t = 1..T-n of OVERLAP_n(f(x_<t), x_>=t), where f greedily continues
  the prefix for as many tokens as the true suffix has and OVERLAP_n is the share of the continuation's n-grams
  that occur in the true suffix.
The target level is the same measures on a matched set of never-seen sequences (held-out `val` documents of the
same token dataset, cut to the same length). Forgetting runs chunk by chunk (`chunk_size` sequences at a time,
the paper's finding: small sequential chunks keep the model's quality where one large batch degrades it); a chunk
is done when its MA and EL_n are at or below the never-seen level. Validation loss is measured before and after;
a rise beyond `max_val_loss_increase` refuses the result (`UnlearningRefused`), and nothing is registered.

Runs in one process with the project's model (`lifecycle.tasks.train.model.GPT`) on the CPU: a few hundred
optimizer steps on a handful of sequences need no DeepSpeed. The result is a model package like the checkpoint
stage's (weights, model config, tokenizer, commit marker, lineage.json), committed as an `unlearn` dataset whose
parent is the champion's package.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.core.code import code_version
from lifecycle.core.dataset import DatasetRef, DatasetWriter, materialize
from lifecycle.core.fs import sha256_file
from lifecycle.tasks.data.tokenize.stage import token_shards
from lifecycle.tasks.train.commit import MARKER, MODEL_CONFIG, WEIGHTS

STAGE = "unlearn"


class UnlearnConfig(BaseModel):
    """Knobs of `lifecycle forget --unlearn` (CLI `--set unlearn.<field>=...`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(5e-5, gt=0)
    """Adam learning rate of the gradient ascent, no weight decay (Jang et al.'s setting: 5e-5 with Adam on
    125M-2.7B models). Small steps matter: the stop rule is checked after every `check_every` steps, and one
    coarse step past the never-seen level costs validation loss for nothing."""
    chunk_size: int = Field(1, ge=1)
    """Sequences forgotten at once; chunks run one after another (the paper: small chunks keep quality)."""
    max_epochs: int = Field(1000, ge=1)
    """Ascent steps per chunk at most (one step is one pass over the chunk, the paper's epoch); a chunk still
    above the never-seen level after them is a refusal."""
    check_every: int = Field(1, ge=1)
    """Check the stop rule (MA and EL_n of the chunk at or below the never-seen level) after every this many
    ascent steps. MA is one forward pass; EL_n (a greedy continuation per prefix) is computed only once MA is
    at the level."""
    sequence_tokens: int = Field(64, ge=8)
    """Length T of each measured and forgotten sequence (capped by the model's seq_len); documents are cut into
    windows of this length."""
    el_n: int = Field(10, ge=1)
    """n of EL_n (the paper reports EL_10)."""
    el_stride: int = Field(1, ge=1)
    """Measure EL at every el_stride-th prefix length (1: every t, the paper's definition)."""
    never_seen: int = Field(32, ge=1)
    """Never-seen sequences measured as the target level (at least as many as there are forgotten ones)."""
    max_val_loss_increase: float = Field(0.10, ge=0)
    """Refuse when validation loss after unlearning exceeds the loss before by more than this share (0.10: 10%)."""
    val_batches: int | None = Field(None, ge=1)
    """Batches of the val shard scored for the validation loss (null: the whole val split, so that the bound is
    measured on as much held-out text as the dataset has)."""
    retain_weight: float = Field(0.0, ge=0)
    """Gradient difference (Liu et al. 2022, "Continual Learning and Private Unlearning"; TOFU's GradDiff): each
    ascent step also descends on `retain_batch` windows of training documents that are kept, the step's loss
    being -loss(forget) + retain_weight * loss(retain), so that what the model knows besides the forgotten text
    is pulled back while it is pushed away. 0: Jang et al.'s pure ascent."""
    retain_batch: int = Field(4, ge=1)
    """Kept training windows per ascent step with retain_weight > 0 (drawn with `seed` from at most
    `retain_pool` windows of the kept training documents)."""
    retain_pool: int = Field(512, ge=1)
    """Windows of kept training documents the retain batches are drawn from."""
    seed: int = 0


class UnlearningRefused(RuntimeError):
    """Unlearning would cost more validation loss than allowed, or did not reach the never-seen level."""

    def __init__(self, message: str, metrics: dict):
        super().__init__(message)
        self.metrics = metrics


# --------------------------------------------------------------------------------------------------
# the measures (pure: a model and int64 token arrays)


def ngrams(seq, n: int) -> list[tuple]:
    return [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]


def overlap(generated, truth, n: int) -> float:
    """OVERLAP_n: the share of the generated sequence's n-grams that are n-grams of the true one."""
    g = ngrams(list(generated), n)
    if not g:
        return 0.0
    t = set(ngrams(list(truth), n))
    return sum(c in t for c in g) / len(g)


def memorisation_accuracy(model, seqs: np.ndarray) -> np.ndarray:
    """MA of every row of seqs (B, T): the share of next tokens the model's argmax gets right."""
    import torch

    with torch.no_grad():
        x = torch.from_numpy(seqs.astype(np.int64))
        logits, _ = model(x[:, :-1])
        hit = (logits.argmax(-1) == x[:, 1:]).float()
    return hit.mean(1).numpy()


def greedy(model, prefix, n_new: int):
    import torch

    idx = prefix
    with torch.no_grad():
        for _ in range(n_new):
            logits, _ = model(idx[:, -model.cfg.seq_len :])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx[:, prefix.shape[1] :]


def extraction_likelihood(model, seqs: np.ndarray, n: int, stride: int = 1) -> np.ndarray:
    """EL_n of every row of seqs (B, T): mean over prefix lengths t (1..T-n, every `stride`-th) of the n-gram
    overlap of the greedy continuation of x_<t (as long as the true suffix) with the true suffix."""
    import torch

    B, T = seqs.shape
    ts = list(range(1, T - n + 1, stride))
    if not ts:
        raise ValueError(f"sequences of {T} tokens are too short for EL_{n}")
    x = torch.from_numpy(seqs.astype(np.int64))
    total = np.zeros(B)
    for t in ts:
        gen = greedy(model, x[:, :t], T - t).numpy()
        total += [overlap(gen[b], seqs[b, t:], n) for b in range(B)]
    return total / len(ts)


def measure(model, seqs: np.ndarray, cfg: UnlearnConfig) -> dict[str, float]:
    was = model.training
    model.eval()
    out = {"ma": float(memorisation_accuracy(model, seqs).mean()),
           f"el{cfg.el_n}": float(extraction_likelihood(model, seqs, cfg.el_n, cfg.el_stride).mean())}
    model.train(was)
    return out


# --------------------------------------------------------------------------------------------------
# the sequences: forgotten documents' training tokens, never-seen val documents


def doc_windows(tokens: DatasetRef, doc_ids: list[str], split: str, length: int) -> tuple[np.ndarray, list[str]]:
    """Non-overlapping windows of `length` tokens over each document's range in the token shards (the last one
    aligned to the document's end); documents shorter than `length` give none. (windows, doc_id per window)."""
    meta = token_shards(tokens)
    side = tokens.read(["doc_id", "split", "shard", "token_start", "token_end"]).to_pylist()
    want = set(doc_ids)
    maps: dict[str, np.memmap] = {}
    out, owner = [], []
    for r in side:
        if r["split"] != split or r["doc_id"] not in want:
            continue
        path = next(p for p in getattr(meta, split) if Path(p).name == r["shard"])
        data = maps.setdefault(r["shard"], np.memmap(path, dtype=meta.dtype, mode="r"))
        s, e = r["token_start"], r["token_end"]
        starts = list(range(s, e - length + 1, length))
        if starts and starts[-1] + length < e:
            starts.append(e - length)
        for st in starts:
            out.append(np.asarray(data[st : st + length], dtype=np.int64))
            owner.append(r["doc_id"])
    return (np.stack(out) if out else np.zeros((0, length), np.int64)), owner


def never_seen(tokens: DatasetRef, count: int, length: int, seed: int) -> np.ndarray:
    """`count` windows of val documents (never trained on), one per document where there are enough, picked
    with a fixed seed."""
    val = [r["doc_id"] for r in tokens.read(["doc_id", "split", "token_start", "token_end"]).to_pylist()
           if r["split"] == "val" and r["token_end"] - r["token_start"] >= length]
    if not val:
        raise ValueError(f"{tokens.manifest_path}: no val document has {length} tokens to serve as never-seen text "
                         "(lower unlearn.sequence_tokens or raise tokenize.val_fraction)")
    rng = np.random.default_rng(seed)
    wins, owner = doc_windows(tokens, val, "val", length)
    first = [i for i, d in enumerate(owner) if owner.index(d) == i]  # the first window of each document
    rest = [i for i in range(len(owner)) if i not in set(first)]
    order = list(rng.permutation(first)) + list(rng.permutation(rest))
    return wins[order[:count]]


# --------------------------------------------------------------------------------------------------
# gradient ascent


def retain_windows(tokens: DatasetRef, forgotten: list[str], length: int, cfg: UnlearnConfig) -> np.ndarray:
    """At most `retain_pool` windows of the training documents that are not forgotten, drawn with `seed`."""
    keep = set(forgotten)
    kept = [r["doc_id"] for r in tokens.read(["doc_id", "split"]).to_pylist()
            if r["split"] == "train" and r["doc_id"] not in keep]
    wins, _ = doc_windows(tokens, kept, "train", length)
    if not len(wins):
        raise ValueError(f"{tokens.manifest_path}: unlearn.retain_weight > 0 needs training documents besides the "
                         f"forgotten ones with {length} tokens; there are none")
    rng = np.random.default_rng(cfg.seed)
    return wins[np.sort(rng.permutation(len(wins))[:cfg.retain_pool])]


def ascend(model, forget: np.ndarray, target: dict[str, float], cfg: UnlearnConfig, log=print,
           retain: np.ndarray | None = None) -> list[dict]:
    """Gradient ascent (maximise the LM loss) on `forget`, chunk after chunk, each until its MA and EL are at
    or below `target`; with `retain` and cfg.retain_weight > 0, gradient difference (descent on a batch of
    `retain` per step as well). Returns one record per chunk; raises UnlearningRefused when a chunk does not get
    there within max_epochs."""
    import torch

    torch.manual_seed(cfg.seed)
    if cfg.retain_weight > 0 and (retain is None or not len(retain)):
        raise ValueError("unlearn.retain_weight > 0 needs retain sequences")
    draw = np.random.default_rng([cfg.seed, 1])
    history = []
    el = f"el{cfg.el_n}"
    pace = _Pace(-(-len(forget) // cfg.chunk_size), log)
    log(f"[unlearn] {len(forget)} sequence(s) of {forget.shape[1] - 1} tokens in {pace.chunks} chunk(s) of "
        f"unlearn.chunk_size={cfg.chunk_size}, each until it is at the never-seen level or "
        f"unlearn.max_epochs={cfg.max_epochs} ascent steps; the worst case follows the first steps' pace")
    for c in range(0, len(forget), cfg.chunk_size):
        chunk = forget[c : c + cfg.chunk_size]
        x = torch.from_numpy(chunk.astype(np.int64))
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        steps, now = 0, measure(model, chunk, cfg)
        while now["ma"] > target["ma"] or now[el] > target[el]:
            if steps >= cfg.max_epochs:
                raise UnlearningRefused(
                    f"chunk {c // cfg.chunk_size}: MA {now['ma']:.3f} / EL_{cfg.el_n} {now[el]:.3f} still above the "
                    f"never-seen level {target['ma']:.3f} / {target[el]:.3f} after unlearn.max_epochs={cfg.max_epochs}"
                    " steps", {"chunk": c // cfg.chunk_size, **now})
            model.train()
            for _ in range(min(cfg.check_every, cfg.max_epochs - steps)):
                _, loss = model(x[:, :-1], x[:, 1:])
                opt.zero_grad(set_to_none=True)
                objective = -loss  # ascent: push the sequences' likelihood down
                if cfg.retain_weight > 0:  # and pull the kept text's back up
                    r = torch.from_numpy(retain[draw.choice(len(retain), min(cfg.retain_batch, len(retain)),
                                                            replace=False)])
                    _, keep_loss = model(r[:, :-1], r[:, 1:])
                    objective = objective + cfg.retain_weight * keep_loss
                objective.backward()
                opt.step()
                steps += 1
            model.eval()
            pace.step(c // cfg.chunk_size, steps, cfg.max_epochs)
            # MA is one forward pass: every check. EL_n costs a greedy continuation per prefix: only once MA says
            # the chunk may be done (until then the stale EL keeps the loop going, MA being above the level anyway)
            now = {"ma": float(memorisation_accuracy(model, chunk).mean()), el: now[el]}
            if now["ma"] <= target["ma"]:
                now = measure(model, chunk, cfg)
        history.append({"chunk": c // cfg.chunk_size, "sequences": len(chunk), "steps": steps, **now})
        pace.chunk_done()
        log(f"[unlearn] chunk {c // cfg.chunk_size}: {len(chunk)} sequence(s) forgotten in {steps} step(s), "
            f"MA {now['ma']:.3f}, EL_{cfg.el_n} {now[el]:.3f}")
    model.eval()
    return history


class _Pace:
    """A progress line at most every `every` seconds while chunks are unlearned (issue 44: 25 minutes went by
    without one): the chunk, its steps against `max_epochs`, and an ETA from the chunks done so far (none before
    the first is done: a chunk stops when its memorisation reaches the never-seen level, not at a known step)."""

    def __init__(self, chunks: int, log, every: float = 15.0):
        self.chunks, self.log, self.every = chunks, log, every
        self.t0 = self.last = time.time()
        self.done, self.worst_said = 0, False

    def step(self, chunk: int, steps: int, max_steps: int) -> None:
        now = time.time()
        if not self.worst_said and steps and not self.done:  # up front: how long it can take at most
            self.worst_said = True
            worst = (now - self.t0) / steps * max_steps * self.chunks
            self.log(f"[unlearn] at {(now - self.t0) / steps:.2f} s a step, the worst case (every chunk to "
                     f"max_epochs) is {worst / 60:.0f} min; lower unlearn.max_epochs or raise chunk_size to bound it")
        if now - self.last < self.every:
            return
        self.last = now
        eta = ""
        if self.done:
            eta = f", ETA {(now - self.t0) / self.done * (self.chunks - self.done):.0f} s at the pace of the chunks done"
        self.log(f"[unlearn] chunk {chunk + 1}/{self.chunks}: step {steps} (at most {max_steps}), "
                 f"{now - self.t0:.0f} s so far{eta}")

    def chunk_done(self) -> None:
        self.done += 1


def val_loss(model, tokens: DatasetRef, tokenizer, batches: int | None, batch_size: int | None = None
             ) -> dict[str, float]:
    """Loss and bits per byte on the token dataset's val shard (the evaluate stage's own scoring; `batch_size`
    defaults to the evaluate stage's)."""
    from lifecycle.tasks.eval.evaluate.stage import EvaluateConfig, _loss, token_byte_lengths

    meta = token_shards(tokens)
    maps = meta.memmap("val")
    data = np.concatenate(maps) if maps else np.zeros(0, dtype=meta.dtype)
    ecfg = EvaluateConfig(max_batches=batches, num_prompts=0)
    if batch_size is not None:
        ecfg = ecfg.model_copy(update={"batch_size": batch_size})
    r = _loss(model, data, token_byte_lengths(tokenizer), ecfg)
    return {"val_loss": r["val_loss"], "val_bpb": r["val_bpb"]}


def load_package(package: str | Path):
    """The packaged model (weights and config of a checkpoint or unlearn package), in eval mode."""
    from lifecycle.tasks.train.commit import load_model

    return load_model(package, check=False)


def unlearn(package: str | Path, tokens: DatasetRef, doc_ids: list[str], cfg: UnlearnConfig, log=print):
    """Measure, forget, measure: (model after, metrics). metrics holds MA/EL on the forgotten and never-seen
    sequences and val loss/bpb, each `_before` and `_after`, plus counts and wall time."""
    from tokenizers import Tokenizer

    t0 = time.time()
    model = load_package(package)
    tokenizer = Tokenizer.from_file(str(Path(package) / "tokenizer.json"))
    length = min(cfg.sequence_tokens, model.cfg.seq_len)
    forget, owners = doc_windows(tokens, doc_ids, "train", length)
    if not len(forget):
        raise ValueError(f"none of {doc_ids} has {length} training tokens in {tokens.manifest_path} "
                         "(was it trained on? lower unlearn.sequence_tokens for short documents)")
    seen_not = never_seen(tokens, max(cfg.never_seen, len(forget)), length, cfg.seed)
    el = f"el{cfg.el_n}"
    before_f, before_n = measure(model, forget, cfg), measure(model, seen_not, cfg)
    before_v = val_loss(model, tokens, tokenizer, cfg.val_batches)
    log(f"[unlearn] before: forgotten MA {before_f['ma']:.3f} EL_{cfg.el_n} {before_f[el]:.3f}; never-seen MA "
        f"{before_n['ma']:.3f} EL_{cfg.el_n} {before_n[el]:.3f}; val_loss {before_v['val_loss']:.4f}")
    metrics = {"forget_sequences": len(forget), "forget_documents": len(set(owners)),
               "never_seen_sequences": len(seen_not), "sequence_tokens": length,
               "forgotten_ma_before": before_f["ma"], f"forgotten_{el}_before": before_f[el],
               "never_seen_ma": before_n["ma"], f"never_seen_{el}": before_n[el],
               "val_loss_before": before_v["val_loss"], "val_bpb_before": before_v["val_bpb"]}
    retain = retain_windows(tokens, list(doc_ids), length, cfg) if cfg.retain_weight > 0 else None
    if retain is not None:
        metrics["retain_sequences"] = len(retain)
    try:
        history = ascend(model, forget, before_n, cfg, log, retain)
    except UnlearningRefused as e:
        e.metrics = {**metrics, **{f"refused_{k}": v for k, v in e.metrics.items()}}
        raise
    after_f = measure(model, forget, cfg)
    after_v = val_loss(model, tokens, tokenizer, cfg.val_batches)
    metrics.update({"forgotten_ma_after": after_f["ma"], f"forgotten_{el}_after": after_f[el],
                    "val_loss_after": after_v["val_loss"], "val_bpb_after": after_v["val_bpb"],
                    "val_loss_increase": after_v["val_loss"] / before_v["val_loss"] - 1,
                    "unlearn_steps": sum(h["steps"] for h in history), "unlearn_chunks": len(history),
                    "unlearn_wall_s": time.time() - t0})
    log(f"[unlearn] after: forgotten MA {after_f['ma']:.3f} EL_{cfg.el_n} {after_f[el]:.3f}; val_loss "
        f"{after_v['val_loss']:.4f} ({metrics['val_loss_increase']:+.2%})")
    if metrics["val_loss_increase"] > cfg.max_val_loss_increase:
        raise UnlearningRefused(
            f"validation loss rose {metrics['val_loss_increase']:.2%} ({before_v['val_loss']:.4f} -> "
            f"{after_v['val_loss']:.4f}), above unlearn.max_val_loss_increase={cfg.max_val_loss_increase:.2%}: "
            "the unlearned model is not registered", metrics)
    return model, metrics


def write_package(workdir: str | Path, champion: DatasetRef, model, extra_lineage: dict, config: dict) -> DatasetRef:
    """Commit the unlearned model as a package (the checkpoint stage's layout) whose parent is the champion's
    package; lineage.json is the champion's, plus `unlearning` (tombstones, metrics, champion version)."""
    from safetensors.torch import save_file

    src = champion.dir

    def build(writer: DatasetWriter) -> dict:
        save_file(model.export_state(), str(writer.path(WEIGHTS)))
        for name in (MODEL_CONFIG, "tokenizer.json"):
            shutil.copyfile(src / name, writer.path(name))
        files = [{"path": n, "sha256": sha256_file(writer.path(n)), "bytes": writer.path(n).stat().st_size}
                 for n in (WEIGHTS, MODEL_CONFIG)]
        old = json.loads((src / MARKER).read_text())
        marker = {"step": old.get("step"), "tag": "unlearned", "files": files,
                  "tokenizer_sha256": old.get("tokenizer_sha256"), "unlearned_from": str(champion.manifest_path)}
        writer.path(MARKER).write_text(json.dumps(marker, indent=2))
        lineage = json.loads((src / "lineage.json").read_text())
        lineage["checkpoint_marker_sha256"] = sha256_file(writer.path(MARKER))
        lineage["unlearning"] = extra_lineage
        writer.path("lineage.json").write_text(json.dumps(lineage, indent=2))
        for name in (WEIGHTS, MODEL_CONFIG, "tokenizer.json", MARKER, "lineage.json"):
            writer.add_file(name)
        return {"num_rows": 0, "extra": {"unlearned_from": champion.sha256}}

    return materialize(workdir, STAGE, config, code_version(__package__), build, parents=[champion])
