"""The stage registry: the one list of the pipeline's stages, in order, and how each runs.

Everything that needs the stage list (config, CLI `--until`, the flow, the lineage catalog, the charts) reads it
from here. A stage declares:

- `name`, which is also its dataset's folder under `<workdir>/datasets/` and its config section's name;
- `package`, the folder holding its code: its code version is that folder's sources plus the core and what they
  import (`lifecycle.core.code`), so nothing is listed by hand;
- `parents`, the stages whose outputs it takes, in call order;
- how it runs: `plan` (planned shards on the shard runner, then a commit), `run` (one task), or both (dedup:
  sharded signatures, then one task that decides over all of them; `run` gets the sharded dataset as `shards=`).

Entry points are "module:function" strings, imported when the stage runs, so that importing the registry costs
nothing (the lineage CLI reads it to order stages). How to add a stage: docs/architecture.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Literal


@dataclass(frozen=True)
class Stage:
    name: str
    package: str
    group: Literal["data", "train", "eval"]
    parents: tuple[str, ...] = ()
    plan: str | None = None
    """"module:function" planning the sharded part: fn(*parents, config, workdir, **kw) -> StagePlan | DatasetRef."""
    run: str | None = None
    """"module:function" of the single task: fn(*parents, config, workdir, **kw) -> DatasetRef | TrainResult."""
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

    def entry(self, which: Literal["plan", "run"]) -> Callable:
        spec = getattr(self, which)
        if spec is None:
            raise ValueError(f"stage {self.name} has no {which} entry point")
        module, _, fn = spec.partition(":")
        return getattr(importlib.import_module(module), fn)

    def __str__(self) -> str:
        return self.name


_D = "lifecycle.tasks.data"
COLLECT = Stage("collect", f"{_D}.collect", "data", plan=f"{_D}.collect.stage:plan_collect", documents=True)
FILTER = Stage("filter", f"{_D}.filter", "data", ("collect",), plan=f"{_D}.filter.stage:plan_filter",
               documents=True)
DEDUP = Stage("dedup", f"{_D}.dedup", "data", ("filter",), plan=f"{_D}.dedup.stage:plan_signatures",
              run=f"{_D}.dedup.stage:run_dedup", sharded_name="dedup-signatures", sharded_arg="signatures",
              documents=True)
SCRUB = Stage("scrub", f"{_D}.scrub", "data", ("dedup",), plan=f"{_D}.scrub.stage:plan_scrub", documents=True)
DECONTAMINATE = Stage("decontaminate", f"{_D}.decontaminate", "data", ("scrub",),
                      plan=f"{_D}.decontaminate.stage:plan_decontaminate", documents=True, optional=True)
QUALITY = Stage("quality", f"{_D}.quality", "data", ("decontaminate",), run=f"{_D}.quality.stage:run_quality",
                documents=True, optional=True)
# a data stage in the funnel whose code lives in the eval layer: it loads the champion model (train's code)
PERPLEXITY = Stage("perplexity", "lifecycle.tasks.eval.perplexity", "data", ("quality",),
                   run="lifecycle.tasks.eval.perplexity.stage:run_perplexity", documents=True, optional=True)
SELECT = Stage("select", f"{_D}.select", "data", ("perplexity",), plan=f"{_D}.select.stage:plan_select",
               documents=True, optional=True)
TOKENIZE = Stage("tokenize", f"{_D}.tokenize", "data", ("select",), run=f"{_D}.tokenize.stage:run_tokenize")
TRAIN = Stage("train", "lifecycle.tasks.train", "train", ("tokenize",), run="lifecycle.tasks.train.launch:run_train")
EVALUATE = Stage("evaluate", "lifecycle.tasks.eval.evaluate", "eval", ("train", "tokenize"),
                 run="lifecycle.tasks.eval.evaluate.stage:evaluate_stage")
CHECKPOINT = Stage("checkpoint", "lifecycle.tasks.eval.checkpoint", "eval", ("train", "tokenize"),
                   run="lifecycle.tasks.eval.checkpoint.stage:package_model", configured=False)

STAGES: tuple[Stage, ...] = (COLLECT, FILTER, DEDUP, SCRUB, DECONTAMINATE, QUALITY, PERPLEXITY, SELECT, TOKENIZE, TRAIN,
                              EVALUATE, CHECKPOINT)
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
