"""The CLIP loader's stall fraction per step, worker processes against DALI (issue 48):
`python -m bench.image_loader [--steps 60] [--rounds 2] [--device cpu|cuda] [--dataset DIR] [--json]`
(the last step of bench/gpu_figures.sh with `--device cuda`; without DALI it prints one JSON line saying so);
`--pixels`: how far apart the two backends' pixels are, per DALI interpolation (the stall run reports cubic's, on
its device: on a GPU that is nvJPEG's decode and DALI's GPU resize against Pillow).

One rank's training loop at the demo's shape (deploy/configs/clip-demo.yaml's clip_train: the default model at 64
px, 32 pairs a step, AdamW, one torch thread as each of the demo's 2 ranks has on this 2-core machine) fed by each
backend in turn: `loader: workers` (1 Pillow worker process, prefetch 2, the demo's) and `loader: dali` (1 DALI
thread, prefetch 2; its CPU operators, or nvJPEG and GPU operators with `--device cuda`). The stall is measured as
clip_train measures it: the seconds `next(step)` waited over the step's wall time, per step; the first step (which
starts the worker or builds the pipeline) is left out, as clip_train's summary leaves it out. The arms alternate,
`--rounds` times each, so that the machine's load drifts over both.

The data: `--dataset`, an image_preprocess dataset, or by default one built here (in a temporary work dir) from the
corpus's emoji tar shards (corpus/images/emoji-*.tar; the planted variants and damaged files left out) at the demo's resolution and vocabulary."""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def corpus_dataset(workdir: str) -> str:
    """An image_preprocess dataset (64 px, vocabulary 1,024, as the demo's) of the corpus's emoji tar pairs."""
    import pyarrow as pa

    from lifecycle.core.dataset import materialize
    from lifecycle.tasks.data.images.preprocess.stage import ImagePreprocessConfig, run_image_preprocess

    rows = []
    for path in sorted(glob.glob(str(ROOT / "corpus" / "images" / "emoji-*.tar"))):
        with tarfile.open(path) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
        texts = {n.rsplit(".", 1)[0]: d.decode() for n, d in members.items() if n.endswith(".txt")}
        for name, data in sorted(members.items()):
            key, ext = name.rsplit(".", 1)
            if ext in ("jpg", "png", "webp") and key in texts:
                rows.append({"image_id": key, "source_id": f"{path}:{key}", "caption": texts[key], "image": data})

    def build(w):
        w.write_table(pa.Table.from_pylist(rows))
        return {}

    parent = materialize(workdir, "image_scrub", {"bench": "image_loader"}, "bench", build)
    return str(run_image_preprocess(parent, ImagePreprocessConfig(resolution=64, vocab_size=1024), workdir).path)


def run_arm(dataset: str, loader: str, steps: int, device: str) -> list[tuple[float, float]]:
    """(stall fraction, step seconds) of each step 2..steps of one rank's loop fed by `loader`."""
    import torch

    from lifecycle.tasks.clip.config import ClipTrainConfig
    from lifecycle.tasks.clip.backend import open_loader
    from lifecycle.tasks.clip.loader import Pairs, split
    from lifecycle.tasks.clip.model import CLIP

    pairs = Pairs(dataset)
    manifest = json.loads((Path(dataset) / "_manifest.json").read_text())
    vocab = manifest["vocab_size"]
    cfg = ClipTrainConfig.model_validate({"loader": loader, "steps": steps, "accelerator": device,
                                          "model": {"image_size": 64, "vocab_size": vocab}})
    torch.manual_seed(0)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    model = CLIP(cfg.model).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    batches = open_loader(pairs, split(pairs.ids, cfg.holdout)[0], cfg, 0, 2, steps, 0 if device == "cuda" else None)
    stalls = []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            images, tokens, wait = batches.next(step)
            loss = model(images.to(dev), tokens.to(dev))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()  # the step is over when its loss is known (a CUDA step, too)
            took = time.perf_counter() - t0
            stalls.append((wait / took, took))
    finally:
        batches.close()
    return stalls[1:]


def pixels(dataset: str, steps: int, interps: list[str], device_id: int | None = None) -> dict:
    """Per DALI interpolation: mean and max absolute difference, in levels of 255, between the two backends'
    batches of rank 0's first `steps` steps (the demo's crop_scale), and the fraction of values more than 1 apart
    (DALI on the GPU `device_id`, nvJPEG, when given)."""
    import torch

    from lifecycle.tasks.clip.augment import STD
    from lifecycle.tasks.clip.config import ClipTrainConfig
    from lifecycle.tasks.clip.dali import DaliLoader
    from lifecycle.tasks.clip.loader import Loader, Pairs, split

    cfg = ClipTrainConfig.model_validate({"workers": 0, "model": {"image_size": 64}})
    train = split(Pairs(dataset).ids, cfg.holdout)[0]
    levels = torch.tensor(STD * 255).view(1, 3, 1, 1)
    ours = Loader(Pairs(dataset), train, cfg, 0, 2, steps)
    reference = [ours.next(s)[0] for s in range(steps)]
    ours.close()
    out = {}
    for interp in interps:
        dali = DaliLoader(Pairs(dataset), train, cfg, 0, 2, steps, device_id, interp=interp)
        diff = torch.cat([((dali.next(s)[0].cpu() - reference[s]) * levels).abs().flatten() for s in range(steps)])
        dali.close()
        out[interp] = {"mean": diff.mean().item(), "max": diff.max().item(), "over_1": (diff > 1.01).float().mean().item()}
    return out


def summarise(steps: list[tuple[float, float]]) -> dict:
    stalls = [s for s, _ in steps]
    q = statistics.quantiles(stalls, n=10, method="inclusive")
    return {"mean": statistics.fmean(stalls), "median": statistics.median(stalls), "p90": q[-1],
            "max": max(stalls), "steps": len(stalls), "step_s": statistics.fmean(t for _, t in steps)}


def stall(dataset: str, args: argparse.Namespace) -> dict:
    """Both arms, alternating `args.rounds` times; their per-step stall summaries and the ratio of the means."""
    per_step: dict[str, list[tuple[float, float]]] = {"workers": [], "dali": []}
    for _ in range(args.rounds):
        for arm in per_step:
            per_step[arm] += run_arm(dataset, arm, args.steps, args.device)
    out = {"bench": "image_loader", "device": args.device, "steps": args.steps, "rounds": args.rounds,
           **{arm: summarise(v) for arm, v in per_step.items()}}
    out["ratio_mean"] = out["dali"]["mean"] / out["workers"]["mean"]
    out["pixels_cubic"] = pixels(dataset, 8, ["INTERP_CUBIC"], 0 if args.device == "cuda" else None)["INTERP_CUBIC"]
    if args.json:
        print(json.dumps(out))
        return out
    print(f"stall fraction per step, {args.device}, {args.rounds} x {args.steps - 1} steps per arm")
    print("| loader | mean | median | p90 | max | s a step |\n|---|---|---|---|---|---|")
    for arm in per_step:
        s = out[arm]
        print(f"| {arm} | {s['mean']:.4f} | {s['median']:.4f} | {s['p90']:.4f} | {s['max']:.4f} | {s['step_s']:.3f} |")
    print(f"dali / workers, mean stall: {out['ratio_mean']:.2f}; pixels, DALI's cubic against Pillow's bicubic: "
          f"mean {out['pixels_cubic']['mean']:.3f}, max {out['pixels_cubic']['max']:.0f} levels of 255")
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="steps per arm (the first is left out)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each arm, alternating")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dataset", help="an image_preprocess dataset (default: built from corpus/images/emoji-*.tar)")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    p.add_argument("--pixels", action="store_true", help="instead: the two backends' pixel difference per DALI "
                   "interpolation (cubic, the one clip_train uses, linear, Lanczos-3, Gaussian)")
    args = p.parse_args(argv)
    from lifecycle.tasks.clip.config import dali_installed

    if not dali_installed():  # bench/gpu_figures.sh's last step goes on without it
        out = {"bench": "image_loader", "device": args.device, "skipped": "DALI not installed: no nvidia.dali "
               "(pip install -c constraints.txt -e '.[dali]'; bench/gpu_wheels.sh does not carry it)"}
        print(json.dumps(out))
        return out
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = args.dataset or corpus_dataset(tmp)
        if not args.pixels:
            return stall(dataset, args)
        diffs = pixels(dataset, 8, ["INTERP_CUBIC", "INTERP_LINEAR", "INTERP_LANCZOS3", "INTERP_GAUSSIAN"])
    print(json.dumps(diffs) if args.json else "\n".join(
        f"{k}: mean {v['mean']:.3f}, max {v['max']:.0f} levels of 255, {v['over_1']:.2%} of values > 1 apart"
        for k, v in diffs.items()))
    return diffs


if __name__ == "__main__":
    main()
