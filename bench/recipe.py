"""Issue 47's recipe, measured on the CPU: `python -m bench.recipe [--steps 40] [--seeds 3] [--models demo,larger]
[--arms base,muon@0.04,...] [--reference ARM]`.

Each arm is a real train stage (`run_train`: 2 DeepSpeed CPU ranks, ZeRO-2, the demo config's batch, warmup and
learning rates) on the demo's token dataset (`runs/demo/latest/tokenize` after `make demo`; `--tokens DIR` for
another; the synthetic corpus of tests/train/test_train.py when there is none), for `--steps` steps at each seed,
the same tokens and seeds in every arm. Measured: the validation loss (`eval_batches` 6: every validation window
of the demo's val shard once, over both ranks; each arm's model attends as it trains) at EVALS points of the run
(the curve) and at the last step, and the median tokens/s of the run's metrics records after step 10 (2 shared
cores: tokens/s moves with the machine's load, so compare arms run back to back). Arms, against `base` (the
defaults: AdamW, cosine, packed attention, fp32, scaled init with RMSNorm):

- `packed`: `train.model.attention: packed` and `train.batch.window_starts: anywhere` (the packing of before,
  whatever the defaults);
- `document`: `train.model.attention: document` (document-aware attention);
- `document_windows`: the same with `train.batch.window_starts: documents` (windows start at a document's first
  token, or a whole number of windows past it);
- `wsd`: `train.optimizer.schedule: wsd` (decay over the last 20 %, 1-sqrt);
- `wsd_anneal`: the same WSD run annealed from its middle: horizon 0.6·steps, the decay over its last 10 % of
  the steps (decay_fraction 1/6), so it is the `wsd` run up to step 0.5·steps; its loss is read at 0.6·steps;
- `bf16` and `bf16_states`: bf16 weights with fp32 optimizer states, then with bf16 states
  (`train.engine.optimizer_states: bf16`); their state bytes per parameter are bench.zero_states' figures;
- `muon`: `train.optimizer.name: muon` (Muon at muon_lr on the blocks' matrices, AdamW at the demo's lr on the
  rest), without gradient clipping (under ZeRO 1-3 DeepSpeed would clip Muon's update, not a gradient: refused);
- `tfixup`: T-Fixup (`train.model.init: tfixup`, `norm: none`) without warmup.
`ARM@LR` is ARM at peak learning rate LR (Muon's `muon_lr` for `muon`): `--arms base@0.0015,base,muon@0.04`
sweeps. The table compares every arm with `--reference` (default `base`): mean validation loss, and per seed the
tokens each arm took to reach the reference's final validation loss (linear between evaluations; `never` when it
did not), over the reference's tokens. `--table FILE` prints it again from a `--json` file.

Models: `demo` (deploy/configs/demo.yaml's) and `larger` (n_layer 6, n_embd 192, n_head 6: 2.6x the demo's
parameters with its embedding, 3.4x without). `--speed`: only `attention_speed` (the mask's cost in one process,
interleaved).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EVALS = 8  # validation points per run: the curve that `tokens_to` reads
MODELS = {"demo": {}, "larger": {"n_layer": 6, "n_embd": 192, "n_head": 6}}
ARMS = {
    "base": {},
    "packed": {"model": {"attention": "packed"}, "batch": {"window_starts": "anywhere"}},
    "document": {"model": {"attention": "document"}},
    "document_windows": {"model": {"attention": "document"}, "batch": {"window_starts": "documents"}},
    "wsd": {"optimizer": {"schedule": "wsd"}},
    "wsd_anneal": {"optimizer": {"schedule": "wsd", "decay_fraction": 1 / 6}},  # horizon set in config()
    "bf16": {"engine": {"precision": "bf16"}},
    "bf16_states": {"engine": {"precision": "bf16", "optimizer_states": "bf16"}},
    "muon": {"optimizer": {"name": "muon", "grad_clip": 0.0}},
    "tfixup": {"model": {"init": "tfixup", "norm": "none"}, "optimizer": {"warmup_steps": 0}},
}
LR_FIELD = {"muon": "muon_lr"}  # `ARM@LR` sets this optimizer field (`lr` for the others)


def arm_changes(arm: str) -> dict:
    """`arm`'s config changes; `ARM@LR` is ARM with its peak learning rate (Muon's `muon_lr`) set to LR."""
    name, _, lr = arm.partition("@")
    changes = {section: dict(fields) for section, fields in ARMS[name].items()}
    if lr:
        changes.setdefault("optimizer", {})[LR_FIELD.get(name, "lr")] = float(lr)
    return changes


def config(model: str, arm: str, seed: int, steps: int):
    """The demo's train config with `model`'s shape and `arm`'s changes, `steps` long (0.6·steps for the anneal)."""
    from lifecycle.tasks.train.config import TrainConfig

    demo = yaml.safe_load((ROOT / "deploy" / "configs" / "demo.yaml").read_text())["train"]
    data = {**demo, "seed": seed, "max_steps": steps,
            "checkpoint": {"every": steps, "keep_last": 1},
            "logging": {"every": 5, "eval_every": max(1, steps // EVALS), "eval_batches": 6},
            "launch": {"timeout_s": 1800}}
    data["optimizer"] = {**demo["optimizer"], "warmup_steps": max(1, steps // 10), "decay_steps": steps}
    data["model"] = {**demo["model"], **MODELS[model]}
    for section, fields in arm_changes(arm).items():
        data[section] = {**data.get(section, {}), **fields}
    if arm.startswith("wsd_anneal"):
        data["max_steps"] = data["optimizer"]["decay_steps"] = data["checkpoint"]["every"] = round(0.6 * steps)
    return TrainConfig.model_validate(data)


def load_tokens(path: str | None, tmp: str):
    from lifecycle.core import dataset as ds

    d = Path(path or ROOT / "runs" / "demo" / "latest" / "tokenize")
    if (d / "_manifest.json").exists():
        return ds.DatasetRef.from_dir(d.resolve()), str(d)
    from tests.train.test_train import make_tokens

    return make_tokens(tmp, 3000), "the synthetic corpus of tests/train/test_train.py (no demo tokens found)"


def run(tokens, model: str, arm: str, seed: int, steps: int, workdir: str) -> dict:
    from lifecycle.tasks.train.launch import run_train

    cfg = config(model, arm, seed, steps)
    r = run_train(tokens, cfg, workdir)
    recs = list(map(json.loads, open(r.metrics_path)))
    train = [x for x in recs if x["kind"] == "train" and x["step"] > 10]
    curve = [[x["step"], x["val_loss"]] for x in recs if x["kind"] == "eval"]
    if not curve or curve[-1][0] != cfg.max_steps:
        raise RuntimeError(f"{arm} seed {seed}: no validation loss at the last step {cfg.max_steps} in {r.metrics_path}")
    tokens_per_step = cfg.batch.num_ranks * cfg.batch.micro_batch_size * cfg.batch.grad_accum * cfg.model.seq_len
    out = {"model": model, "arm": arm, "seed": seed, "steps": cfg.max_steps, "params": r.model_params,
           "val_loss": curve[-1][1], "train_loss": r.final_loss, "curve": curve, "tokens_per_step": tokens_per_step,
           "tokens_per_s": statistics.median(x["tokens_per_s"] for x in train)}
    print(json.dumps(out), flush=True)
    return out


def attention_speed(tokens, reps: int = 30) -> dict:
    """Forward + backward time of the demo model on one micro-batch of real train windows (16 x 128, one thread),
    document-aware against packed attention, interleaved so that the machine's load hits both alike; the median
    of `reps` pairs. Shows what the mask costs without the run's launch, saves and evaluation around it."""
    import time

    import torch

    from lifecycle.tasks.data.tokenize.stage import token_shards
    from lifecycle.tasks.train.loader import get_batch
    from lifecycle.tasks.train.model import GPT

    torch.set_num_threads(1)
    cfg = config("demo", "document", 0, 40)
    meta = token_shards(tokens)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": meta.vocab_size})})
    model = GPT(cfg.model)
    x, y = get_batch(meta, cfg, 0, 0, 0)
    times: dict[str, list[float]] = {"document": [], "packed": []}
    for i in range(reps + 3):
        for mode, sep in (("document", meta.eot_id), ("packed", None)):
            model.doc_sep = sep
            t0 = time.perf_counter()
            model(x, y)[1].backward()
            if i >= 3:  # warm-up left out
                times[mode].append(time.perf_counter() - t0)
    boundaries = int((x[:, :-1] == meta.eot_id).sum())
    out = {mode: statistics.median(t) for mode, t in times.items()}
    print(f"attention speed, 16 x 128 windows with {boundaries} document boundaries: document "
          f"{out['document'] * 1e3:.1f} ms, packed {out['packed'] * 1e3:.1f} ms per forward+backward: "
          f"tokens/s ratio {out['packed'] / out['document']:.3f}", flush=True)
    return out


def tokens_to(curve: list, tokens_per_step: int, target: float) -> float | None:
    """Tokens at which the validation curve first reaches `target`, linear between evaluations; None if never."""
    prev = None
    for step, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return step * tokens_per_step
            frac = (prev[1] - target) / (prev[1] - loss)
            return (prev[0] + frac * (step - prev[0])) * tokens_per_step
        prev = (step, loss)
    return None


def relative_tokens(rows: list[dict], ref: str) -> dict[str, list]:
    """Per arm and seed: the tokens to reach `ref`'s final validation loss of the same model and seed, over the
    tokens `ref` took (None where the arm never reached it)."""
    refs = {(r["model"], r["seed"]): r for r in rows if r["arm"] == ref}
    out: dict[str, list] = {}
    for r in rows:
        base = refs.get((r["model"], r["seed"]))
        if base and r["arm"] != ref:
            t = tokens_to(r["curve"], r["tokens_per_step"], base["val_loss"])
            out.setdefault(f'{r["model"]} {r["arm"]}', []).append(
                None if t is None else t / (base["steps"] * base["tokens_per_step"]))
    return out


def table(rows: list[dict], ref: str = "base") -> None:
    print(f"\n{'model':7} {'arm':16} {'params':>9} {'val loss mean':>13} {'spread':>7} {'vs ' + ref:>10} "
          f"{'tokens/s':>9} {'tokens to ' + ref + ' (per seed)'}")
    rel = relative_tokens(rows, ref)
    for model in dict.fromkeys(r["model"] for r in rows):
        by: dict[str, list] = {}
        for r in rows:
            if r["model"] == model:
                by.setdefault(r["arm"], []).append(r)
        base_v = statistics.mean(r["val_loss"] for r in by[ref]) if ref in by else None
        for arm, rs in by.items():
            v, t = [r["val_loss"] for r in rs], [r["tokens_per_s"] for r in rs]
            rel_v = f"{statistics.mean(v) / base_v:10.3f}" if base_v else ""
            toks = " ".join("never" if x is None else f"{x:.2f}" for x in rel.get(f"{model} {arm}", []))
            print(f"{model:7} {arm:16} {rs[0]['params']:9,} {statistics.mean(v):13.4f} {max(v) - min(v):7.4f} "
                  f"{rel_v:>10} {statistics.mean(t):9,.0f} {toks}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first .. first + seeds - 1")
    ap.add_argument("--models", default="demo,larger")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--tokens", default=None, help="a tokenize dataset directory (default: the demo's)")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    ap.add_argument("--reference", default="base", help="the arm the table compares against (e.g. adamw@0.006)")
    ap.add_argument("--table", default=None, help="only print the table of a --json file written before")
    ap.add_argument("--speed", action="store_true", help="only the attention speed comparison (attention_speed)")
    a = ap.parse_args()
    if a.table:
        table(json.loads(Path(a.table).read_text()), a.reference)
        return
    if a.speed:
        with tempfile.TemporaryDirectory() as tmp:
            attention_speed(load_tokens(a.tokens, tmp)[0])
        return
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tokens, where = load_tokens(a.tokens, tmp)
        seeds = range(a.first_seed, a.first_seed + a.seeds)
        print(f"tokens: {where}; {a.steps} steps, seeds {seeds[0]}..{seeds[-1]}", flush=True)
        for model in a.models.split(","):
            for seed in seeds:
                for arm in a.arms.split(","):
                    try:
                        rows.append(run(tokens, model, arm, seed, a.steps, str(Path(tmp) / "work")))
                    except Exception as e:  # one arm's failure is a result too; the others still run
                        print(f"{model} {arm} seed {seed} failed: {e}", flush=True)
                    if a.json:
                        Path(a.json).write_text(json.dumps(rows, indent=1))
    table(rows, a.reference)


if __name__ == "__main__":
    main()
