"""Imported once by the forkserver the local shard workers fork from (`flows.runner._Pool`), and by each worker of
a Dask cluster that is given it as `--preload`: the data stages' modules, about a second of imports that each
worker would otherwise pay when its first shard arrives. The workers start while the flow sets up its MLflow run,
so the imports overlap that instead of delaying the first shard. A worker imports neither Prefect nor MLflow."""

import lifecycle.core.shards  # noqa: F401
from lifecycle.tasks.data.collect import stage as _collect  # noqa: F401
from lifecycle.tasks.data.dedup import stage as _dedup  # noqa: F401
from lifecycle.tasks.data.filter import stage as _filter  # noqa: F401
from lifecycle.tasks.data.scrub import stage as _scrub  # noqa: F401
