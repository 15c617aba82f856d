"""`lifecycle lineage step RUN_DIR STEP`: the documents one training step read.

A run directory's `config.json` holds the train config and the token dataset it read (`tokens`). The sampler
(lifecycle.tasks.train.sampler) is a pure function of (seed, data step, sequence index), so the windows of a
step are recomputed here (where they start: `train.batch.window_starts`, `anywhere` for a config.json that
predates it), not logged: every sequence of the global batch, with the rank and micro-batch that
read it under the run's layout, its shard and token range, and the documents of the token dataset's side table
that overlap it (with the tokens each contributed). Loss-spike rollbacks (metrics.jsonl `rollback` records)
shift which data step a training step reads, and are applied. Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from lifecycle.core.dataset import DatasetRef
from lifecycle.tasks.data.tokenize.stage import TokenShards
from lifecycle.tasks.train import sampler
from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.parallel.mesh import Grid


def skipped_before(run_dir: Path, step: int) -> list[int]:
    """Data steps thrown away by the rollbacks recorded before training step `step` (1-based, as logged)."""
    path = run_dir / "metrics.jsonl"
    out: set[int] = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            r = json.loads(line) if line.strip() else {}
            if r.get("kind") == "rollback" and r["step"] < step:
                out.update(r.get("skipped_data_steps", []))
    return sorted(out)


def step_documents(run_dir: str | Path, step: int, check=lambda path, what: Path(path)) -> dict:
    """The sequences logged training step `step` (1..max_steps) read, and their documents (see the module doc).
    `check(path, what)` vets each path read from config.json (the CLI refuses one outside the work dir)."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{run_dir} has no config.json: not a train run directory (<workdir>/train/<id>/)")
    launch = json.loads(cfg_path.read_text())
    cfg, tokens = TrainConfig.model_validate(launch["train"]), TokenShards.model_validate(launch["tokens"])
    if not 1 <= step <= cfg.max_steps:
        raise ValueError(f"step {step} is outside 1..{cfg.max_steps} (train.max_steps of {run_dir})")
    skipped = skipped_before(run_dir, step)
    dstep = sampler.data_step(step - 1, skipped)  # logged step N is the update computed at index N-1
    shards = [p for p in tokens.train if check(p, "token shard").stat().st_size]  # the sampler's k counts these
    data = [np.memmap(p, dtype=tokens.dtype, mode="r") for p in shards]
    T, B, accum, grid = cfg.model.seq_len, cfg.batch.micro_batch_size, cfg.batch.grad_accum, Grid.of(cfg)
    wins = sampler.step_windows(sampler.window_mode(launch["train"]), data, tokens.eot_id, T, cfg.seed, dstep, 0,
                                cfg.global_batch)
    ref = DatasetRef.from_dir(check(Path(tokens.tokenizer_path).parent, "token dataset"))
    side = ref.read(["doc_id", "source_id", "split", "shard", "token_start", "token_end"])
    side = side.filter(pc.equal(side.column("split"), "train"))
    by_shard: dict[str, list[dict]] = {}
    for r in side.to_pylist():
        by_shard.setdefault(r["shard"], []).append(r)
    sequences, docs = [], {}
    for j, (k, i) in enumerate(wins):
        name = Path(shards[k]).name
        end = i + T + 1  # inputs i..i+T-1 and targets i+1..i+T
        hit = [{"doc_id": r["doc_id"], "source_id": r["source_id"],
                "tokens": min(end, r["token_end"]) - max(i, r["token_start"])}
               for r in by_shard.get(name, []) if r["token_start"] < end and r["token_end"] > i]
        for h in hit:
            d = docs.setdefault(h["doc_id"], {"doc_id": h["doc_id"], "source_id": h["source_id"], "sequences": 0,
                                              "tokens": 0})
            d["sequences"] += 1
            d["tokens"] += h["tokens"]
        micro_all = j // B  # micro-batches in global order: dp rank, then its accumulation steps
        sequences.append({"sequence": j, "dp_rank": micro_all // accum, "micro": micro_all % accum,
                          "shard": name, "token_start": i, "token_end": end, "documents": hit})
    return {"run_dir": str(run_dir), "step": step, "data_step": dstep, "skipped_data_steps": skipped,
            "layout": str(grid), "global_batch": cfg.global_batch, "seq_len": T,
            "token_dataset": ref.sha256, "sequences": sequences,
            "documents": sorted(docs.values(), key=lambda d: (-d["tokens"], d["doc_id"]))}


def print_step(r: dict) -> None:
    print(f"step {r['step']} of {r['run_dir']} (data step {r['data_step']}; layout {r['layout']}; "
          f"{r['global_batch']} sequences of {r['seq_len']} tokens; token dataset {r['token_dataset'][:12]})")
    print(f"  {len(r['documents'])} documents:")
    for d in r["documents"][:40]:
        print(f"    {d['doc_id']}  {d['source_id']:<40} {d['tokens']:>7} tokens in {d['sequences']} sequence(s)")
    if len(r["documents"]) > 40:
        print(f"    ... {len(r['documents']) - 40} more (--json lists them all, and every sequence)")
