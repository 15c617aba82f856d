"""Pipeline parallelism's rules (lifecycle.tasks.train.parallel.pp)."""

from __future__ import annotations


def check(cfg) -> None:
    par = cfg.parallel
    if cfg.engine.zero_stage >= 2:
        raise ValueError(f"train.parallel.pp={par.pp} with train.engine.zero_stage={cfg.engine.zero_stage}: "
                         "DeepSpeed's pipeline engine runs ZeRO-0 and ZeRO-1 only (ZeRO-2/3 partition the "
                         "gradients it reduces per stage); set train.engine.zero_stage to 0 or 1")
    if cfg.engine.compile is True:
        raise ValueError(f"train.engine.compile=true with train.parallel.pp={par.pp}: DeepSpeed's pipeline engine "
                         "runs its stages itself; set train.engine.compile to auto or false")
    if par.pp > cfg.model.n_layer:
        raise ValueError(f"train.parallel.pp={par.pp} > train.model.n_layer={cfg.model.n_layer}: every "
                         "pipeline stage needs at least one block")
