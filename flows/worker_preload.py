"""Imported once by the forkserver the local shard workers fork from (`flows/pools.py` `LocalPool`), and by each
worker of a Dask cluster that is given it as `--preload`: the data stages' modules, imports that each worker would
otherwise pay when its first shard arrives. The workers start while the flow sets up its MLflow run, so the imports
overlap that instead of delaying the first shard. A worker imports neither Prefect nor MLflow."""

import lifecycle.core.shards  # noqa: F401
from lifecycle.tasks.data.collect import stage as _collect  # noqa: F401
from lifecycle.tasks.data.dedup import stage as _dedup  # noqa: F401
from lifecycle.tasks.data.filter import stage as _filter  # noqa: F401
from lifecycle.tasks.data.scrub import stage as _scrub  # noqa: F401

# the workers forked from here share these imports' pages: keep their collections off them (freeze_heap's docstring)
lifecycle.core.shards.freeze_heap()


def worker_started(flow_pid: int, flow_started: int | None, interval: float = 1.0) -> None:
    """`ProcessPoolExecutor`'s initializer in each local shard worker: end this worker once the flow process that
    owns the pool is gone (SIGKILLed, say). Nothing else would: a worker waits on its call queue, whose write end
    it holds itself, and it holds the forkserver's "alive" pipe, so the forkserver (and multiprocessing's resource
    tracker) wait on it in turn: after a SIGKILL of `lifecycle run` all four lived on until killed by hand (found by
    `bench.chaos`). The shard a worker runs is a forked child that dies with it (PR_SET_PDEATHSIG)."""
    import os
    import signal
    import threading
    import time

    from lifecycle.core.procs import die_with_parent, same_process

    die_with_parent()  # the forkserver gone: this worker too

    def watch() -> None:
        while same_process(flow_pid, flow_started):
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lifecycle-flow-watch", daemon=True).start()
