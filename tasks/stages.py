"""The stage registry: the one list of the pipeline's stages, in order, and how each runs.

Everything that needs the stage list (config, CLI `--until`, the flow, the lineage catalog, the charts) reads it
from here. A stage declares:

- `name`, which is also its dataset's folder under `<workdir>/datasets/` and its config section's name;
- `package`, the folder holding its code: its code version is that folder's sources plus the core and what they
  import (`lifecycle.core.code`), so nothing is listed by hand; its `stage.py` exports the stage's code as one
  object, `STAGE` (`lifecycle.core.shards.StageCode` or `PerFileStage`: `plan`, `run`, `shard`, `warm`);
- `parents`, the stages whose outputs it takes, in call order;
- how the flow runs it: `plan` (planned shards on the shard runner, then a commit), `run` (one task), or both
  (dedup: sharded signatures, then one task that decides over all of them; `run` gets the sharded dataset as
  `sharded_arg=`).

`entry` imports the stage's package only when the stage runs, so that importing the registry costs nothing (the
lineage CLI reads it to order stages). How to add a stage: docs/architecture.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Literal


@dataclass(frozen=True)
class Stage:
    name: str
    package: str
    group: Literal["data", "train", "eval", "image_model"]
    """`image_model`: the image path's train and evaluate, whose outputs are datasets (a model package, retrieval
    scores), logged as the data stages' are."""
    parents: tuple[str, ...] = ()
    plan: bool = False
    """Whether it has a sharded part, which the flow plans (`STAGE.plan(*parents, config, workdir, **kw)` ->
    StagePlan | DatasetRef), maps over the shard runner (`STAGE.shard`) and commits."""
    run: bool = False
    """Whether the flow runs `STAGE.run(*parents, config, workdir, **kw)` -> DatasetRef | TrainResult as one task
    (after the sharded part, if any). A sharded-only stage's `STAGE.run` is the whole stage in one process, for
    library use and tests."""
    sharded_name: str | None = None
    """Dataset name of the sharded part when the stage also has a `run` part (dedup: dedup-signatures)."""
    sharded_arg: str = "shards"
    """Keyword under which `run` receives the sharded part's dataset."""
    configured: bool = True
    """Whether `PipelineConfig` has a section of this name passed to the stage's functions."""
    documents: bool = False
    """Whether its rows are documents (doc_id, source_id, text): the lineage catalog indexes those."""
    optional: bool = False
    """Off unless its config turns it on (`enabled`); when off it does not run and its children read its parent."""

    def stage_code(self) -> Any:
        """The stage's code object (`STAGE` in `<package>/stage.py`), its package imported on first use."""
        return importlib.import_module(f"{self.package}.stage").STAGE

    def entry(self, which: Literal["plan", "run"]) -> Callable:
        """The callable the flow runs for the stage's sharded part (`plan`) or its single task (`run`)."""
        if not getattr(self, which):
            raise ValueError(f"stage {self.name} has no {which} entry point")
        fn = getattr(self.stage_code(), which)
        if fn is None:
            raise ValueError(f"stage {self.name}: {self.package}'s STAGE has no `{which}`, which the registry expects")
        return fn

    def __str__(self) -> str:
        return self.name


_D = "lifecycle.tasks.data"
COLLECT = Stage("collect", f"{_D}.collect", "data", plan=True, documents=True)
FILTER = Stage("filter", f"{_D}.filter", "data", ("collect",), plan=True, documents=True)
DEDUP = Stage("dedup", f"{_D}.dedup", "data", ("filter",), plan=True, run=True, sharded_name="dedup-signatures",
              sharded_arg="signatures", documents=True)
SCRUB = Stage("scrub", f"{_D}.scrub", "data", ("dedup",), plan=True, documents=True)
DECONTAMINATE = Stage("decontaminate", f"{_D}.decontaminate", "data", ("scrub",), plan=True, documents=True,
                      optional=True)
QUALITY = Stage("quality", f"{_D}.quality", "data", ("decontaminate",), run=True, documents=True, optional=True)
# a data stage in the funnel whose code lives in the eval layer: it loads the champion model (train's code)
PERPLEXITY = Stage("perplexity", "lifecycle.tasks.eval.perplexity", "data", ("quality",), run=True, documents=True,
                   optional=True)
SELECT = Stage("select", f"{_D}.select", "data", ("perplexity",), plan=True, documents=True, optional=True)
TOKENIZE = Stage("tokenize", f"{_D}.tokenize", "data", ("select",), run=True)
TRAIN = Stage("train", "lifecycle.tasks.train", "train", ("tokenize",), run=True)
EVALUATE = Stage("evaluate", "lifecycle.tasks.eval.evaluate", "eval", ("train", "tokenize"), run=True)
CHECKPOINT = Stage("checkpoint", "lifecycle.tasks.eval.checkpoint", "eval", ("train", "tokenize"), run=True,
                   configured=False)

# the image-text path (image_collect.enabled): the flow runs these instead of the text stages
_I = f"{_D}.images"
IMAGE_COLLECT = Stage("image_collect", f"{_I}.collect", "data", plan=True)
IMAGE_FILTER = Stage("image_filter", f"{_I}.filter", "data", ("image_collect",), plan=True)
IMAGE_DEDUP = Stage("image_dedup", f"{_I}.dedup", "data", ("image_filter",), run=True)
IMAGE_SCRUB = Stage("image_scrub", f"{_I}.scrub", "data", ("image_dedup",), plan=True)
IMAGE_PREPROCESS = Stage("image_preprocess", f"{_I}.preprocess", "data", ("image_scrub",), run=True)
CLIP_TRAIN = Stage("clip_train", "lifecycle.tasks.clip.train", "image_model", ("image_preprocess",), run=True)
CLIP_EVALUATE = Stage("clip_evaluate", "lifecycle.tasks.clip.evaluate", "image_model", ("clip_train", "image_preprocess"),
                      run=True)

STAGES: tuple[Stage, ...] = (COLLECT, FILTER, DEDUP, SCRUB, DECONTAMINATE, QUALITY, PERPLEXITY, SELECT, TOKENIZE, TRAIN,
                              EVALUATE, CHECKPOINT, IMAGE_COLLECT, IMAGE_FILTER, IMAGE_DEDUP, IMAGE_SCRUB,
                              IMAGE_PREPROCESS, CLIP_TRAIN, CLIP_EVALUATE)
NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
DOCUMENT_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.documents)
DATA_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.group == "data")


def enabled(stage: Stage, cfg) -> bool:
    """Whether `stage` runs under the pipeline config `cfg` (an optional stage only when its section says so;
    select runs with either scorer, quality or perplexity, whose scores it reads)."""
    if not stage.optional:
        return True
    sections = ("quality", "perplexity") if stage.name == "select" else (stage.name,)
    return any(getattr(getattr(cfg, s), "enabled", False) for s in sections)


def input_of(name: str, ran) -> str | None:
    """The stage whose output `name` reads: its registered parent, or, for a parent that did not run (an optional
    stage turned off), that parent's own input, and so on up."""
    parent = BY_NAME[name].parents[0] if BY_NAME[name].parents else None
    while parent is not None and parent not in ran and BY_NAME[parent].optional:
        parent = BY_NAME[parent].parents[0]
    return parent
