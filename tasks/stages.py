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
TOKENIZE = Stage("tokenize", f"{_D}.tokenize", "data", ("scrub",), run=f"{_D}.tokenize.stage:run_tokenize")
TRAIN = Stage("train", "lifecycle.tasks.train", "train", ("tokenize",), run="lifecycle.tasks.train.launch:run_train")
EVALUATE = Stage("evaluate", "lifecycle.tasks.eval.evaluate", "eval", ("train", "tokenize"),
                 run="lifecycle.tasks.eval.evaluate.stage:evaluate_stage")
CHECKPOINT = Stage("checkpoint", "lifecycle.tasks.eval.checkpoint", "eval", ("train", "tokenize"),
                   run="lifecycle.tasks.eval.checkpoint.stage:package_model", configured=False)

STAGES: tuple[Stage, ...] = (COLLECT, FILTER, DEDUP, SCRUB, TOKENIZE, TRAIN, EVALUATE, CHECKPOINT)
NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
DOCUMENT_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.documents)
DATA_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.group == "data")
