"""Checkpoints that change layout: a run saved under one layout (ranks, ZeRO stage, micro-batch and gradient
accumulation; later tp/pp/sp) resumes under another with the same global batch.

The run fingerprint (`TrainConfig.run_key`, the run directory's name) still holds the layout, so a run that
never changes layout keeps the fingerprint and directory it had before. What the layout does not change is the
*trajectory key* (`trajectory_key`): the run key with the layout fields taken out and the global batch put in.
Two run directories with the same trajectory fingerprint (recorded in each one's config.json as `trajectory`)
hold the same trajectory computed under two layouts. `run_train` (lifecycle.tasks.train.launch) looks for such a
sibling before it launches (`find_resume`); when a sibling's newest committed checkpoint is newer than its own,
it converts that checkpoint into its own run directory (`convert`) and the ranks resume from the converted one.

Same global batch: when only the layout changed (ranks, ZeRO stage) and the micro-batch and grad_accum were
left as they were, grad_accum adjusts so that micro·accum·dp equals the sibling's global batch (`fit_batch`);
when no whole grad_accum does, the run is refused, naming the numbers. `train.resume_across_layouts: false`
turns all of this off (a layout change then starts a new run, as before).

What carries over, and how: the fp32 master weights and Adam moments go through DeepSpeed's universal checkpoint
(`deepspeed.checkpoint.ds_to_universal`, loaded with `load_universal_checkpoint`); the step, LR schedule position,
client_state (sampler position, RNG states) through the DeepSpeed model-states file it copies. The batches stay
the same because the sampler (lifecycle.tasks.train.trainer.get_batch) is keyed on (seed, step, sequence index in
the global batch): every split of the same global batch into dp × grad_accum × micro-batch draws the same
sequences, and the loss, a mean over equal-sized micro-batches and ranks, is the same mean.

A converter is a `Converter` in `CONVERTERS`: `reason(src, dst)` says why it cannot convert (None: it can) and
`convert(src_tag, dst_tag, src, dst)` writes, into the empty directory `dst_tag`, state that the trainer under
layout `dst` loads, and returns the marker fields that say how to load it (`format`). The first converter that
can, does. A tp=2 -> tp=1 or pp=2 -> pp=1 converter appends itself to `CONVERTERS` (docs/architecture.md).

Torch-free: the DeepSpeed converter runs in a child process.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.parallel.mesh import Layout

log = logging.getLogger(__name__)

LAYOUT_FIELDS = {"batch": ("num_ranks", "micro_batch_size", "grad_accum"),
                 "engine": ("zero_stage", "activation_checkpointing"), "moe": ("ep",)}
"""The fields of `TrainConfig` that are layout, not trajectory (plus the whole `parallel` section): what
`train.layout: auto` may choose, and the degrees of the rank grid."""


def layout_of(cfg: TrainConfig) -> dict:
    """The layout a config runs under, in a checkpoint marker's form (`Layout.as_dict`)."""
    return Layout.of(cfg).as_dict()


def describe(layout: dict) -> str:
    """`dp=2,zero=2,micro=8,accum=1` (`Layout.describe`, from a marker's dict)."""
    return Layout.from_dict(layout).describe()


def trajectory_key(cfg: TrainConfig) -> dict:
    """`run_key` without the layout fields: equal for runs that differ in layout only. The global batch is left
    out too (`batch_for_siblings` compares it, to fit grad_accum to it when only the layout changed)."""
    key = cfg.run_key()
    for section, names in LAYOUT_FIELDS.items():
        for name in names:
            key[section].pop(name)
    key.pop("parallel")
    return key


def with_layout(cfg: TrainConfig, **batch) -> TrainConfig:
    """`cfg` with batch fields replaced (validated again)."""
    data = cfg.model_dump()
    data["batch"] = {**data["batch"], **batch}
    return TrainConfig.model_validate(data)


def fit_batch(cfg: TrainConfig, global_batch: int) -> TrainConfig:
    """`cfg` with grad_accum set so that micro·accum·dp = `global_batch`; ValueError naming the numbers when no
    whole grad_accum gives it."""
    if cfg.global_batch == global_batch:
        return cfg
    per_accum = cfg.batch.micro_batch_size * cfg.dp  # (the ranks of a tp/pp/sp group share a micro-batch)
    if global_batch % per_accum:
        raise ValueError(
            f"the run was saved with a global batch of {global_batch} sequences; train.batch.micro_batch_size "
            f"{cfg.batch.micro_batch_size} x data-parallel degree {cfg.dp} (train.batch.num_ranks "
            f"{cfg.batch.num_ranks} / tp·pp·sp {cfg.parallel.model_parallel}) = {per_accum} does not divide it, so "
            f"no train.batch.grad_accum keeps it: choose a micro_batch_size and num_ranks whose product divides "
            f"{global_batch}, or set train.resume_across_layouts: false to start a new run")
    return with_layout(cfg, grad_accum=global_batch // per_accum)


# --------------------------------------------------------------------------------------------------
# finding the sibling run to resume from


@dataclass(frozen=True)
class Sibling:
    """A run directory of the same trajectory under another layout, with its newest valid commit."""

    run_dir: Path
    layout: dict
    tag_dir: Path
    global_batch: int

    @property
    def step(self) -> int:
        return ckpt.step_of(self.tag_dir)


def train_runs(workdir: Path, exclude: Path | None = None) -> Iterator[tuple[Path, dict]]:
    """(run dir, its config.json) of each train run under `<workdir>/train/` but `exclude`; unreadable ones are
    passed over."""
    for cfg_path in sorted((workdir / "train").glob("*/config.json")):
        if exclude is not None and cfg_path.parent.resolve() == exclude.resolve():
            continue
        try:
            yield cfg_path.parent, json.loads(cfg_path.read_text())
        except (OSError, ValueError):
            continue


def siblings(workdir: Path, trajectory: str, max_steps: int, exclude: Path | None = None) -> list[Sibling]:
    """Run directories under `<workdir>/train/` whose config.json has trajectory fingerprint `trajectory` (and
    batch fields), with a commit at most `max_steps` whose files have their sizes; newest commit first. Their
    hashes are not read here (seconds per GB, for every run of the trajectory at every launch): the one that is
    converted is verified then (`launch._resume_other_layout`)."""
    found = []
    for run_dir, launch in train_runs(workdir, exclude):
        if launch.get("trajectory") != trajectory:
            continue
        tag = ckpt.latest_valid(run_dir / "checkpoints", max_step=max_steps, hashes=False)
        if tag is None:
            continue
        train = TrainConfig.model_validate(launch["train"])
        found.append(Sibling(run_dir, layout_of(train), tag, train.global_batch))
    return sorted(found, key=lambda s: -s.step)


def batch_for_siblings(cfg: TrainConfig, found: list[Sibling]) -> TrainConfig:
    """The config to run: `cfg` itself when a sibling has its global batch (or none exists); when only the layout
    changed (dp, ZeRO stage, tp/pp/sp: micro-batch and grad_accum as the newest sibling's), grad_accum fitted to
    the newest sibling's global batch (`fit_batch`, which refuses when it cannot). A changed micro-batch or
    grad_accum with another global batch is another trajectory: `cfg` as given (a new run)."""
    if not found or any(s.global_batch == cfg.global_batch for s in found):
        return cfg
    newest = found[0]
    if (newest.layout["micro"], newest.layout["accum"]) != (cfg.batch.micro_batch_size, cfg.batch.grad_accum):
        return cfg
    return fit_batch(cfg, newest.global_batch)


# --------------------------------------------------------------------------------------------------
# converters


@dataclass(frozen=True)
class Converter:
    name: str
    reason: Callable[[dict, dict], str | None]
    """Why this converter cannot take a checkpoint of layout src to layout dst; None when it can."""
    convert: Callable[[Path, Path, dict, dict], dict]
    """(src tag dir, empty dst tag dir, src layout, dst layout) -> marker fields (`format`, ...)."""


def _universal_reason(src: dict, dst: dict) -> str | None:
    if any(layout.get(axis, 1) != 1 for layout in (src, dst) for axis in ("pp", "sp", "ep")) or dst.get("tp", 1) != 1:
        return ("pp/sp/ep above 1, or a tp destination, split parameters in ways this conversion does not (it "
                "merges ZeRO partitions, and tp slices by the tp layers' universal_checkpoint_info, into whole "
                "parameters): they need their own converter")
    if 0 in (src["zero"], dst["zero"]):
        return ("ZeRO stage 0 keeps a plain torch optimizer state, not ZeRO partitions: DeepSpeed's universal "
                "checkpoint converts ZeRO-1/2/3 checkpoints and loads into ZeRO-1/2/3 engines only")
    return None


def _universal_convert(src_tag: Path, dst_tag: Path, src: dict, dst: dict) -> dict:
    """DeepSpeed's `ds_to_universal` over the source tag (in a child process: it imports torch), then our
    consolidated weights and architecture beside it (evaluate and export read those)."""
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src_tag),
           "--output_folder", str(dst_tag), "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ds_to_universal of {src_tag} failed (exit {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    for name in (ckpt.WEIGHTS, ckpt.MODEL_CONFIG):  # evaluate and export read these; normalize_universal too
        shutil.copy2(src_tag / name, dst_tag / name)
    code = f"from lifecycle.tasks.train.layout import normalize_universal; normalize_universal({str(dst_tag)!r}, {ckpt.step_of(src_tag)})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"normalizing the universal checkpoint {dst_tag} failed (exit {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    # A universal load reads the model-states file (client_state, LR scheduler, step counters; the weights come
    # from zero/) by the name the *loading* engine saves under: `zero_pp_rank_0_mp_rank_00_model_states.pt` at
    # ZeRO-3, `mp_rank_00_model_states.pt` below it. ds_to_universal copies the source's, named for the source's
    # stage: across ZeRO-3 and ZeRO-1/2 the loader would not find it, so the file is copied under the other name.
    names = {3: "zero_pp_rank_0_mp_rank_00_model_states.pt", 0: "mp_rank_00_model_states.pt"}
    want, have = names[3 if dst["zero"] == 3 else 0], names[3 if src["zero"] == 3 else 0]
    if not (dst_tag / want).exists():
        shutil.copy2(dst_tag / have, dst_tag / want)
    os.remove(dst_tag.parent / "latest_universal")  # ds_to_universal's pointer; our marker is the commit
    return {"format": "universal"}


def normalize_universal(tag_dir: str, step: int) -> None:
    """Make `<tag_dir>/zero/optimizer_state.pt` readable by both of DeepSpeed's universal loaders (imports torch:
    run in a child process). ds_to_universal writes it in the layout of the *source's* stage, and each loader
    reads only its own: ZeRO-1/2 (`base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir`) asserts a
    top-level `ds_version` and zips `param_groups`, and takes Adam's step from each parameter's `step.pt`;
    ZeRO-3 (`stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`) reads
    `optimizer_state_dict.state[0].step` and `optimizer_state_dict.param_groups`. A ZeRO-3 source lacks the
    first two and the step files, and holds each state flat where the ZeRO-1/2 loader indexes it with the
    parameter's shape (from the consolidated model.safetensors); a ZeRO-1/2 source lacks the third. Each is added
    from what is there (the optimizer's own step count; the training step `step` only when neither has one)."""
    from pathlib import Path

    import deepspeed
    import torch

    zero = Path(tag_dir) / "zero"
    path = zero / "optimizer_state.pt"
    sd = torch.load(path, weights_only=False)
    inner = sd.get("optimizer_state_dict")
    groups = sd.get("param_groups") or inner["param_groups"]
    found = inner["state"][0]["step"] if inner and inner.get("state") else None
    if found is None:
        found = next((torch.load(f, weights_only=False) for f in sorted(zero.glob("*/step.pt"))), None)
    found = torch.as_tensor(float(step) if found is None else found, dtype=torch.float32)
    sd.setdefault("ds_version", deepspeed.__version__)
    sd["param_groups"] = groups
    if inner is None:
        sd["optimizer_state_dict"] = {"state": {0: {"step": found}}, "param_groups": groups}
    torch.save(sd, path)
    from safetensors import safe_open

    with safe_open(str(Path(tag_dir) / "model.safetensors"), "pt") as weights:
        shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    for folder in zero.iterdir():
        if not folder.is_dir():
            continue
        if not (folder / "step.pt").exists():
            torch.save(found.clone(), folder / "step.pt")
        # a ZeRO-3 source's states are bare flat tensors; the ZeRO-1/2 loader reads {"param": tensor of the
        # parameter's shape} (the ZeRO-3 loader reads either)
        for f in folder.glob("*.pt"):
            if f.name == "step.pt":
                continue
            state = torch.load(f, weights_only=False)
            if isinstance(state, torch.Tensor):
                state = {"param": state, "cat_dim": 0}
            elif state["param"].dim() != 1 or folder.name not in shapes:
                continue
            if folder.name in shapes:
                state["param"] = state["param"].view(shapes[folder.name])
            torch.save(state, f)


def _pipeline_reason(src: dict, dst: dict) -> str | None:
    if src.get("pp", 1) == 1:  # checked before the import: parallel.pp loads torch and DeepSpeed
        return "the source is not a pipeline checkpoint (pp=1)"
    from lifecycle.tasks.train.parallel import pp_convert

    return pp_convert.dense_reason(src, dst)


def _pipeline_convert(src_tag: Path, dst_tag: Path, src: dict, dst: dict) -> dict:
    from lifecycle.tasks.train.parallel import pp_convert

    return pp_convert.to_dense(src_tag, dst_tag, src, dst)


def _replicas_reason(src: dict, dst: dict) -> str | None:
    if src.get("pp", 1) == 1 or any(src.get(a, 1) != dst.get(a, 1) for a in ("pp", "tp", "sp", "ep")):
        return "changes the data-parallel degree of a pipeline (same pp, tp, sp, ep) only"
    if src["zero"] != 0 or dst["zero"] != 0:
        return ("copies ZeRO-0 pipeline state, which every data-parallel replica holds whole; ZeRO-1 partitions "
                "over dp would need repartitioning")
    return None


def _replicas_convert(src_tag: Path, dst_tag: Path, src: dict, dst: dict) -> dict:
    """A ZeRO-0 pipeline checkpoint under another data-parallel degree: DeepSpeed's files are per layer and per
    model-parallel rank (pp × tp), the same for any dp, so they are copied as they are; the sampler's layout
    fields and the RNG states of ranks the source had come from the client_state (resume.check_resume), and the
    new replicas start with fresh RNG states (no dropout under tp or pp consumes them)."""
    for f in sorted(src_tag.iterdir()):
        if f.is_file() and f.name != ckpt.MARKER:
            shutil.copy2(f, dst_tag / f.name)
    return {"format": "deepspeed"}


def _muon_reason(src: dict, dst: dict) -> str | None:
    from lifecycle.tasks.train import muon_convert

    return muon_convert.reason(src, dst)


def _muon_convert(src_tag: Path, dst_tag: Path, src: dict, dst: dict) -> dict:
    from lifecycle.tasks.train import muon_convert

    return muon_convert.convert(src_tag, dst_tag, src, dst)


CONVERTERS: list[Converter] = [Converter("deepspeed-universal", _universal_reason, _universal_convert),
                               Converter("pipeline-to-dense", _pipeline_reason, _pipeline_convert),
                               Converter("pipeline-replicas", _replicas_reason, _replicas_convert)]
"""Tried in order: DeepSpeed's universal checkpoint between ZeRO layouts, a pipeline checkpoint (tp inside its
stages or not, experts too) to a dense ZeRO-0 one (lifecycle.tasks.train.parallel.pp_convert.to_dense), and a ZeRO-0 pipeline to more
or fewer data-parallel replicas of it."""

MUON_CONVERTERS: list[Converter] = [Converter("muon", _muon_reason, _muon_convert),
                                    Converter("pipeline-replicas", _replicas_reason, _replicas_convert)]
"""The converters of a Muon run (`train.optimizer.name: muon`): the others carry Adam's moments only. Any Muon
layout to plain data parallelism at ZeRO 0-2 (lifecycle.tasks.train.muon_convert), and a ZeRO-0 pipeline's files,
copied whole."""


def convert(src: Sibling, dst_root: Path, dst_layout: dict, optimizer: str = "adamw") -> tuple[Path, dict]:
    """Convert `src`'s commit into `<dst_root>/step_<n>` for `dst_layout` and commit it there (marker last, with
    the layouts and where it came from); returns (tag dir, marker). ValueError, with every converter's reason,
    when none can. `optimizer`: the run's `train.optimizer.name` (Muon's state has converters of its own)."""
    for conv in converters(optimizer):
        if conv.reason(src.layout, dst_layout) is not None:
            continue
        dst_tag = dst_root / ckpt.tag_name(src.step)
        if dst_tag.exists():
            ckpt.remove(dst_tag)
        dst_tag.mkdir(parents=True)
        try:
            extra = conv.convert(src.tag_dir, dst_tag, src.layout, dst_layout)
            src_marker = ckpt.read_marker(src.tag_dir)
            keep = {k: v for k, v in src_marker.items() if k not in ("files", "step", "tag", "time", "layout")}
            marker = ckpt.commit(dst_tag, src.step, {
                **keep, **extra, "layout": src.layout, "converter": conv.name,
                "converted_from": str(src.tag_dir), "converted_for": dst_layout})
        except BaseException:
            ckpt.remove(dst_tag)
            raise
        return dst_tag, marker
    raise ValueError(f"no converter takes a{' Muon' if optimizer == 'muon' else ''} checkpoint of layout "
                     f"{describe(src.layout)} ({src.tag_dir}) to layout {describe(dst_layout)}: "
                     f"{refusal(src.layout, dst_layout, optimizer)} (set train.resume_across_layouts: false to "
                     "start a new run instead)")


def converters(optimizer: str) -> list[Converter]:
    """The converters for a run whose `train.optimizer.name` is `optimizer`, in the order they are tried."""
    return MUON_CONVERTERS if optimizer == "muon" else CONVERTERS


def refusal(src: dict, dst: dict, optimizer: str = "adamw") -> str | None:
    """Every converter's reason not to take layout `src` to `dst` ("name: reason; ..."), or None when one can."""
    reasons = []
    for conv in converters(optimizer):
        if (why := conv.reason(src, dst)) is None:
            return None
        reasons.append(f"{conv.name}: {why}")
    return "; ".join(reasons)
