"""`<workdir>/latest/<stage>`: a relative symlink to the dataset (or, for train, the checkpoint run directory) of
the last completed run (for train: its final committed checkpoint), replaced atomically when a run completes. A stage folder may hold several fingerprint
directories (other configs, inputs or code versions); `latest` says which one the last completed run used.
`ls <workdir>/latest/`, `read_parquet('<workdir>/latest/scrub/*.parquet')` and `lifecycle sql` all read through it.
"""

from __future__ import annotations

import os
from pathlib import Path

LATEST = "latest"


def point_latest(workdir: str | Path, targets: dict[str, str | Path], only: bool = False) -> dict[str, Path]:
    """Point `latest/<name>` at each target directory (inside the work dir); returns {name: link}. `only`: remove
    the other links, so that `latest/` shows one run (a `--until scrub` run leaves no `latest/train` of an
    earlier run beside its own `latest/collect`)."""
    root = Path(workdir) / LATEST
    root.mkdir(exist_ok=True)
    if only:
        for old in root.iterdir():
            if old.is_symlink() and old.name not in targets:
                old.unlink()
    links = {}
    for name, target in targets.items():
        link = root / name
        tmp = root / f".{name}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(os.path.relpath(Path(target).resolve(), root.resolve()), tmp, target_is_directory=True)
        os.replace(tmp, link)  # atomic: a reader sees the old or the new dataset, never no link
        links[name] = link
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return links


def latest_targets(datasets: dict[str, str], checkpoint: str | None) -> dict[str, Path]:
    """{stage: directory} of a run summary: each dataset's directory (its manifest's folder), and for train the
    final committed checkpoint (`train/<run>/checkpoints/step_N`, which `lifecycle export hf` takes)."""
    out = {stage: Path(manifest).parent for stage, manifest in datasets.items()}
    if checkpoint:
        out["train"] = Path(checkpoint)
    return out
