"""What DeepSpeed's ZeRO optimizers hold per rank, against the planner's formulas and DeepSpeed's estimators.

`python -m bench.zero_states --table` (about 15 s per layout on 2 idle cores). For ZeRO 0/1/2/3 in fp32 and bf16
it starts 2 CPU ranks (gloo) that build the project's model, torch AdamW and the DeepSpeed engine as the trainer
does (`engine.ds_config`, with reduce_bucket_size and allgather_bucket_size set to BUCKET elements, so that the
bucket is a term of its own below the model's size), and run 2 optimizer steps on random tokens.

What is measured: the bytes of every tensor storage the engine holds (each storage once), found by walking the
engine, its DeepSpeed optimizer, the torch optimizer's state and the model's parameters (their `.grad`, ZeRO-3's
`ds_tensor`), at the moments of MOMENTS in the last step: in backward (a backward pre-hook on the first block),
at its end (the engine's gradient reduction entered: every gradient made), stage 0's flattened all-reduce copy,
after backward, in the optimizer step (the torch optimizer's `step` entered, the fp32 gradients made) and after
it. Activations are not reachable from these roots and are not counted: this is the model states and
DeepSpeed's own buffers, by the attribute that holds them (`--table` prints them). Its peak over the moments is
compared with the planner's model states before this bench (`zero_memory.model_states`, the ZeRO paper's
accounting), with the planner's states and buffers now (`zero_memory.engine_bytes`), and, for bf16, with
DeepSpeed's `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs` (GPU side, no
offload, 2 GPUs; DeepSpeed has none for stages 0-1). ZeRO-3's gathered parameters (a separate term of
`planner.memory`) are in the measurement at the backward moments and not in `engine_bytes`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

MODEL = dict(vocab_size=4096, n_layer=4, n_embd=256, n_head=4, seq_len=64)
BUCKET = 200_000  # reduce_bucket_size and allgather_bucket_size (elements) of the measured runs
LAYOUTS = ([(zero, prec) for prec in ("fp32", "bf16") for zero in (0, 1, 2, 3)] + [(zero, "bf16-states") for zero in (1, 2, 3)]
           + [(zero, "fp32-muon") for zero in (0, 1, 2, 3)] + [(zero, "bf16-muon") for zero in (1, 2, 3)])
# bf16-states: bf16 weights with bf16 master weights, gradients and Adam moments (train.engine.optimizer_states);
# -muon: DeepSpeed's MuonWithAuxAdam as the trainer builds it (train.optimizer.name: muon) instead of torch AdamW
MOMENTS = ("in_backward", "end_of_backward", "in_reduce", "after_backward", "in_step", "after_step")
MiB = 2**20


OWNERS = ("ipg", "bucket", "grad", "flat", "fp32", "state")
"""Attribute names (substrings) walked first: a view (a parameter's `.grad` into the bucket, a parameter into the
flat buffer) is then counted under the buffer that owns its storage."""


def priority(key) -> int:
    name = key.lower() if isinstance(key, str) else ""
    return next((i for i, word in enumerate(OWNERS) if word in name), len(OWNERS))


def held(roots: list[tuple[str, object]]) -> dict[str, int]:
    """{label: bytes} of the distinct tensor storages reachable from `roots` (first label seen wins)."""
    import torch

    seen_obj, seen_storage, out = set(), set(), {}

    def tensor(label: str, t) -> None:
        if t.device.type == "meta":
            return
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if s.nbytes() and key not in seen_storage:
            seen_storage.add(key)
            out[label] = out.get(label, 0) + s.nbytes()

    def walk(label: str, o, depth: int) -> None:
        if id(o) in seen_obj or depth > 10:
            return
        seen_obj.add(id(o))
        if isinstance(o, torch.Tensor):
            tensor(label, o)
            for name in ("grad", "grad_accum", "ds_tensor"):
                sub = getattr(o, name, None) if name != "grad" or o.is_leaf else None
                if isinstance(sub, torch.Tensor):
                    walk(f"{label}.{name}", sub, depth + 1)
            return
        if isinstance(o, dict):
            items = o.items()
        elif isinstance(o, (list, tuple, set)):
            items = ((None, v) for v in o)
        elif type(o).__module__.split(".")[0] in ("deepspeed", "torch", "lifecycle") and hasattr(o, "__dict__"):
            items = vars(o).items()
        else:
            return
        for k, v in sorted(items, key=lambda kv: priority(kv[0])):
            # a label names the attribute, not list positions or parameter ids: one row per kind of buffer
            walk(label if not isinstance(k, str) or depth > 3 else f"{label}.{k}", v, depth + 1)

    for label, root in roots:
        walk(label, root, 0)
    return out


def instrument(engine, opt, first_block, snap) -> None:
    """Call `snap(moment, extra_roots)` at the moments of MOMENTS: a backward pre-hook on the first block (the last
    one backward reaches), the engine's gradient reduction entered (all gradients made), stage 0's flattened
    all-reduce copy made, the torch optimizer's step entered."""
    first_block.register_full_backward_pre_hook(lambda *_: snap("in_backward"))

    def before(fn, moment):
        def wrapped(*a, **kw):
            snap(moment)
            return fn(*a, **kw)
        return wrapped

    def after_bucket(fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            snap("in_reduce", [("engine.allreduce_bucket", out)])
            return out
        return wrapped

    engine.allreduce_gradients = before(engine.allreduce_gradients, "end_of_backward")
    engine.allreduce_bucket = after_bucket(engine.allreduce_bucket)
    opt.step = before(opt.step, "in_step")


def worker(index: int, steps: int = 2) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment) of LAYOUTS[index]: one JSON line with the
    largest snapshot of each moment of the last step (the first one made the optimizer's state)."""
    import deepspeed
    import torch

    from lifecycle.tasks.train.config import ModelConfig, TrainConfig
    from lifecycle.tasks.train.engine import ds_config, muon_optimizer, stub_muon
    from lifecycle.tasks.train.model import GPT

    zero, prec = LAYOUTS[index]
    muon = prec.endswith("-muon")
    torch.set_num_threads(1)
    if not muon:
        stub_muon()
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = TrainConfig(model=ModelConfig(**MODEL), batch={"micro_batch_size": 2, "grad_accum": 1, "num_ranks": 2},
                      engine={"zero_stage": zero, "precision": prec.split("-")[0],
                              "optimizer_states": "bf16" if prec == "bf16-states" else "fp32"},
                      optimizer={"name": "muon", "grad_clip": 0.0} if muon else {})
    ds = ds_config(cfg)
    ds["zero_optimization"].update(reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    n_params = model.num_params()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = (muon_optimizer(cfg, model) if muon else
           torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    roots = [("optimizer", engine.optimizer), ("torch_optimizer", opt), ("module", list(model.parameters())),
             ("engine", engine)]
    seen: dict[str, dict[str, int]] = {}

    def snap(moment: str, extra: list = ()) -> None:
        now = held([*extra, *roots])
        if sum(now.values()) >= sum(seen.get(moment, {}).values()):
            seen[moment] = now

    instrument(engine, opt, model.blocks[0], snap)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    for _ in range(steps):
        seen.clear()
        x = torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_len"] + 1), generator=g)
        _, loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        snap("after_backward")
        engine.step()
        snap("after_step")
    print(json.dumps({"zero": zero, "precision": prec, "rank": int(os.environ["RANK"]), "params": n_params,
                      "moments": {m: seen[m] for m in MOMENTS if m in seen},
                      "optimizer": type(engine.optimizer).__name__}), flush=True)
    # ZeRO-3's teardown at interpreter exit sometimes aborts ("terminate called without an active exception",
    # GUIDE.md), which would fail a layout already measured: leave without it
    os._exit(0)


def run_ranks(index: int) -> list[dict]:
    from bench.planner_memory import run_pair

    return run_pair("bench.zero_states", [str(index)], timeout=1800)


def deepspeed_estimate(zero: int, psi: int, largest: int, ranks: int = 2) -> int | None:
    """DeepSpeed's GPU-side estimate (no offload, one node of `ranks`), or None where it has none (stages 0-1)."""
    if zero < 2:
        return None
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger, made at its import, prints to stdout
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    if zero == 2:
        return estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=ranks, cpu_offload=False)[1]
    return estimate_zero3_model_states_mem_needs(psi, largest, num_gpus_per_node=ranks, cpu_offload=False,
                                                 cpu_offload_params=False)[1]


def predict(zero: int, prec: str, psi: int) -> dict:
    """The planner's model states before this bench (the ZeRO paper's, `model_states`) and now (`engine_bytes`:
    those plus DeepSpeed's buffers at backward's and the step's peak), for the measured model and buckets."""
    from lifecycle.tasks.train.config import ModelConfig
    from lifecycle.tasks.train.sizing import largest_tensor, muon_numels, muon_params
    from lifecycle.tasks.train.zero_memory import PRECISIONS, engine_bytes, model_states

    m = ModelConfig(**MODEL)
    largest, muon = largest_tensor(m), muon_params(m) if prec.endswith("-muon") else 0
    p = PRECISIONS[prec.removesuffix("-muon")]
    return {"old": sum(model_states(psi, zero, 2, p).values()),
            "new": engine_bytes(psi, zero, 2, p, largest, reduce_bucket=BUCKET, muon=muon,
                                muon_numels=muon_numels(m) if muon else []), "largest": largest}


def main(table: bool = False, only: list[int] | None = None) -> list[dict]:
    from lifecycle.tasks.train.supervise import prebuild_shm_op

    prebuild_shm_op("cpu", {**os.environ, "DS_ACCELERATOR": "cpu"})
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if table else (lambda text: None)
    say(f"model {MODEL}, 2 ranks, buckets {BUCKET:,} elements; MiB per rank (measured: peak over {MOMENTS} of "
        "the storages the engine holds)")
    say(f"{'zero':>4} {'prec':>4} {'measured':>9} {'old':>7} {'old/m':>6} {'new':>7} {'new/m':>6} {'ds_est':>7} "
        f"{'ds/m':>6}  peak at")
    rows = []
    for i, (zero, prec) in enumerate(LAYOUTS):
        if only is not None and i not in only:
            continue
        ranks = run_ranks(i)
        psi = ranks[0]["params"]
        per_rank = [{m: sum(v.values()) for m, v in r["moments"].items()} for r in ranks]
        measured = max(max(p.values()) for p in per_rank)
        at = max(per_rank[0], key=per_rank[0].get)
        pred = predict(zero, prec, psi)
        est = deepspeed_estimate(zero, psi, pred["largest"]) if prec == "bf16" else None
        row = {"zero": zero, "precision": prec, "params": psi, "measured_bytes": measured, "peak_at": at,
               "old_formula_bytes": pred["old"], "new_formula_bytes": pred["new"]["total"],
               "new_formula_parts": pred["new"], "deepspeed_estimate_bytes": est,
               "old_ratio": round(pred["old"] / measured, 4), "new_ratio": round(pred["new"]["total"] / measured, 4),
               "deepspeed_ratio": round(est / measured, 4) if est else None,
               "optimizer": ranks[0]["optimizer"], "moments": ranks[0]["moments"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        ds_txt = f"{est / MiB:>7.2f} {est / measured:>6.3f}" if est else f"{'-':>7} {'-':>6}"
        say(f"{zero:>4} {prec:>4} {measured / MiB:>9.2f} {pred['old'] / MiB:>7.2f} {pred['old'] / measured:>6.3f} "
            f"{pred['new']['total'] / MiB:>7.2f} {pred['new']['total'] / measured:>6.3f} {ds_txt}  {at}")
        for moment, parts in ranks[0]["moments"].items():
            say(f"      {moment:<15} " + ", ".join(f"{k} {v / MiB:.2f}" for k, v in sorted(parts.items())))
    print(json.dumps({"summary": True, "layouts": len(rows), "new_ratio_range": [min(r["new_ratio"] for r in rows),
                      max(r["new_ratio"] for r in rows)], "old_ratio_range": [min(r["old_ratio"] for r in rows),
                      max(r["old_ratio"] for r in rows)], "model": MODEL, "bucket": BUCKET,
                      "load_average": os.getloadavg()}), flush=True)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", type=int, metavar="LAYOUT", help="(internal) run as one rank")
    ap.add_argument("--only", help="comma-separated indices into LAYOUTS (default: all)")
    ap.add_argument("--table", action="store_true", help="also print a readable table on stderr")
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker)
    else:
        main(a.table, [int(i) for i in a.only.split(",")] if a.only else None)
