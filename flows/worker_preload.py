"""Imported by each Dask worker of the data stages as it starts (Dask's `preload`; `flows.runner.ShardRunner`):
the data stages' modules, about a second of imports that the worker would otherwise pay when its first shard
arrives. The LocalCluster starts while the flow sets up its MLflow run, so the imports overlap that instead of
delaying the first shard. Shards are plain Dask futures: a worker imports neither Prefect nor MLflow."""

import lifecycle.core.shards  # noqa: F401
from lifecycle.tasks.data.collect import stage as _collect  # noqa: F401
from lifecycle.tasks.data.dedup import stage as _dedup  # noqa: F401
from lifecycle.tasks.data.filter import stage as _filter  # noqa: F401
from lifecycle.tasks.data.scrub import stage as _scrub  # noqa: F401
