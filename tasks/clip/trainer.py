"""A rank of the dual encoder's training (`python -m lifecycle.tasks.clip.trainer --config run.json`, one per
rank, started by lifecycle.tasks.clip.train.stage): DeepSpeed ZeRO over gloo (CPU) or nccl, the text trainer's
commit protocol (lifecycle.tasks.train.commit.save: a tag directory per checkpoint, COMMITTED.json written last),
resumed from the newest valid commit. No Prefect or MLflow here.

Exact resume: the weights and optimizer come from the checkpoint, the batches are a function of (seed, step,
rank, ranks) (lifecycle.tasks.clip.loader), the model has no dropout, so a resumed run takes the same steps.
Each step appends {step, loss, wait_s, step_s, stall, logit_scale} (rank means) to metrics.jsonl (rank 0)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # die with the supervisor, before the slow imports
    from lifecycle.core.procs import die_with_parent, watch_parent_run

    die_with_parent()
    watch_parent_run()

import torch
import torch.distributed as dist

from lifecycle.tasks.clip.config import ClipTrainConfig
from lifecycle.tasks.clip.backend import open_loader
from lifecycle.tasks.clip.loader import Pairs, split
from lifecycle.tasks.clip.model import CLIP
from lifecycle.tasks.train import commit
from lifecycle.tasks.train.engine import keep_mlflow_out, stub_muon


def ds_config(cfg: ClipTrainConfig, ranks: int) -> dict:
    return {"train_batch_size": cfg.micro_batch * ranks, "train_micro_batch_size_per_gpu": cfg.micro_batch,
            "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": cfg.zero_stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def schedule(cfg: ClipTrainConfig):
    """Linear warmup to lr, then cosine down to a tenth of it at the last step."""
    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return factor


def build(cfg: ClipTrainConfig, ranks: int):
    import deepspeed

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = CLIP(cfg.model)
    model.gather = cfg.negatives == "global" and ranks > 1
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(cfg))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config(cfg, ranks))
    return engine


def restore(engine, ckpt_root: Path) -> int:
    """The step of the newest valid commit, loaded into `engine` (0 when there is none)."""
    tag = commit.latest_valid(ckpt_root)
    if tag is None:
        return 0
    _, client = engine.load_checkpoint(str(ckpt_root), tag=tag.name)
    return int(client["step"])


def train(spec: dict) -> None:
    cfg = ClipTrainConfig.model_validate(spec["train"])
    root, run_dir = Path(spec["ckpt_root"]), Path(spec["run_dir"])
    keep_mlflow_out()
    import deepspeed

    stub_muon()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo" if cfg.accelerator == "cpu" else "nccl")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    engine = build(cfg, ranks)
    start = restore(engine, root)
    pairs = Pairs(spec["dataset"])
    device = next(engine.module.parameters()).device
    loader = open_loader(pairs, split(pairs.ids, cfg.holdout)[0], cfg, rank, ranks, cfg.steps,
                         device.index if device.type == "cuda" else None)
    metrics = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            images, tokens, wait = loader.next(step)
            loss = engine(images.to(device), tokens.to(device))
            engine.backward(loss)
            engine.step()
            means = torch.tensor([loss.item(), wait, time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(means)
            loss_m, wait_m, step_m = (means / ranks).tolist()
            if metrics is not None:
                metrics.write(json.dumps({"step": step + 1, "loss": loss_m, "wait_s": wait_m, "step_s": step_m,
                                          "stall": wait_m / step_m, "logit_scale": engine.module.logit_scale.item(),
                                          **loader.cache.stats()}) + "\n")
                metrics.flush()
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                commit.save(engine, root, step + 1, {"step": step + 1}, cfg.model, marker_extra={"loss": loss_m})
                if rank == 0:
                    commit.prune(root, cfg.keep_last)
    finally:
        loader.close()
        if metrics is not None:
            metrics.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the run's JSON spec, written by lifecycle.tasks.clip.train")
    args = p.parse_args(argv)
    train(json.loads(Path(args.config).read_text()))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
