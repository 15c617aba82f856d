"""Imported by each Dask worker of the data stages as it starts (Dask's `preload`; `flows.runner.ShardRunner`):
Prefect's task engine and the data stages' modules, about 2 s of imports that the worker would otherwise pay
when its first shard arrives. The LocalCluster starts while the flow sets up its MLflow run, so the imports
overlap that instead of delaying the first shard."""

import prefect.task_engine  # noqa: F401
import prefect_dask  # noqa: F401

import lifecycle.core.shards  # noqa: F401
import lifecycle.flows.runner  # noqa: F401
from lifecycle.tasks.data.collect import stage as _collect  # noqa: F401
from lifecycle.tasks.data.dedup import stage as _dedup  # noqa: F401
from lifecycle.tasks.data.filter import stage as _filter  # noqa: F401
from lifecycle.tasks.data.scrub import stage as _scrub  # noqa: F401
