"""The stage registry (tasks/stages.py): cheap to import, and every stage's package exports the code it promises."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lifecycle.core.shards import by_name
from lifecycle.tasks.stages import STAGES, Stage


def test_importing_the_registry_imports_no_stage_code():
    """The lineage CLI reads the registry to order stages: that must not import pyarrow or any stage package."""
    code = ("import sys, lifecycle.tasks.stages as s; assert len(s.STAGES) > 10; "
            "print(sorted(m for m in sys.modules if m.startswith(('pyarrow', 'lifecycle.tasks.', 'pydantic'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['lifecycle.tasks.stages']"


@pytest.mark.parametrize("stage", STAGES, ids=[s.name for s in STAGES])
def test_each_stage_exports_what_the_registry_says(stage):
    """`plan` and `run` resolve to the stage object's callables; a sharded stage's shard and warm-up are
    module-level functions, which shard workers import by name."""
    code = stage.stage_code()
    assert callable(code.run)  # every stage runs whole in one process (library use, tests)
    assert (code.plan is not None) == stage.plan and (code.shard is not None) == stage.plan
    for which in ("plan", "run"):
        if getattr(stage, which):
            assert stage.entry(which) == getattr(code, which)
        else:
            with pytest.raises(ValueError, match=f"no {which} entry point"):
                stage.entry(which)
    for fn in (code.shard, code.warm):
        if fn is not None:
            by_name(fn)


def test_a_registry_promise_the_package_does_not_keep_is_named():
    promised = Stage("scrub", "lifecycle.tasks.data.tokenize", "data", run=True, plan=True)
    with pytest.raises(ValueError, match="lifecycle.tasks.data.tokenize's STAGE has no `plan`"):
        promised.entry("plan")
