"""Checks that a run can finish, made when it starts and before any stage computes: every file, package and server
the configured stages will need. A missing one is a `UsageError` naming the config field and what is wrong (one
line, exit 2), seconds after the command starts instead of minutes into the run. What a run will do differently
because of this machine (METEOR without WordNet) comes back as notes, printed before the first stage.

`lifecycle run` calls `preflight` after `check_patterns` on `collect.inputs` (lifecycle/cli.py); a flow run that reads its YAML when it
starts (`lifecycle serve`) calls it too (flows/pipeline.py). The registry's champion, which `train.init_from:
champion` and the perplexity step need, is looked up by the flow before collect, since it needs MLflow.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from lifecycle.core.errors import UsageError, one_line


@dataclass
class Preflight:
    """The config the run uses (with `auto` settings resolved for this machine) and notes for the user."""
    config: object
    notes: list[str] = field(default_factory=list)


def preflight(cfg, until: str | None = None) -> Preflight:
    """Check what the stages up to `until` need; return the config to run, with this machine's settings resolved.
    Raises UsageError naming the field."""
    from lifecycle.tasks.stages import BY_NAME, NAMES, enabled

    last = NAMES.index(until) if until else len(NAMES) - 1
    runs = {n for n in NAMES[:last + 1] if enabled(BY_NAME[n], cfg)}
    out = Preflight(cfg)
    if "decontaminate" in runs:
        _eval_sets(cfg.decontaminate.sets)
    if "quality" in runs:
        check_patterns("quality.reference_inputs", cfg.quality.reference_inputs)
    if "tokenize" in runs and cfg.tokenize.tokenizer_file is not None:
        _file("tokenize.tokenizer_file", cfg.tokenize.tokenizer_file)
    if "train" in runs and cfg.train.launch.hostfile is not None:
        _file("train.launch.hostfile", cfg.train.launch.hostfile)
    if "evaluate" in runs:
        out.config, note = _meteor(out.config)
        out.notes += [note] if note else []
        if cfg.evaluate.code.enabled and cfg.evaluate.code.problems is not None:
            _file("evaluate.code.problems", cfg.evaluate.code.problems)
    _tracking_server(cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"),
                     "tracking.tracking_uri" if cfg.tracking.tracking_uri else "MLFLOW_TRACKING_URI")
    return out


def _file(name: str, path: str) -> None:
    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"{name}: {p} {'is not a file' if p.exists() else 'does not exist'}")
    try:
        with open(p, "rb") as fh:
            fh.read(1)
    except OSError as e:
        raise UsageError(f"{name}: cannot read {p}: {(e.strerror or str(e)).lower()}") from e


def check_patterns(name: str, patterns: list[str]) -> None:
    """Every pattern of the list field `name` matches files of a known type, and every local one opens for
    reading; else a UsageError naming `name[i]` and the pattern or file (exit 2)."""
    from lifecycle.core.fs import is_url
    from lifecycle.tasks.data.collect.stage import InputError, match_inputs

    for i, pattern in enumerate(patterns):
        try:
            files = match_inputs([pattern])
            for f in files if not is_url(pattern) else ():
                with open(f, "rb") as fh:
                    fh.read(1)
        except InputError as e:  # no match, an escaping symlink, an unknown file type
            raise UsageError(f"{name}[{i}]: {str(e).removeprefix('collect.inputs: ')}") from e
        except OSError as e:
            raise UsageError(f"{name}[{i}]: cannot read {e.filename or pattern}: "
                             f"{(e.strerror or str(e)).lower()}") from e
        except Exception as e:  # fsspec: an unknown protocol, its package (s3fs) missing, an unreachable host
            if not is_url(pattern):
                raise
            raise UsageError(f"{name}[{i}]: cannot list {pattern!r}: {type(e).__name__}: "
                             f"{one_line(str(e))}") from e


def check_image_patterns(patterns: list[str]) -> None:
    """The image path's inputs: each pattern matches tar or Parquet files (image_collect.inputs[i] named)."""
    from lifecycle.tasks.data.images.collect.stage import resolve_image_inputs

    if not patterns:
        raise UsageError("image_collect.inputs: no patterns, and image_collect.enabled is true")
    try:
        resolve_image_inputs(patterns)
    except (ValueError, OSError) as e:
        raise UsageError(one_line(str(e))) from e


def _eval_sets(specs: list[str]) -> None:
    from lifecycle.tasks.data.decontaminate.sets import resolve_set

    for spec in specs:
        resolve_set(spec)  # a UsageError naming decontaminate.sets and the spec


def _meteor(cfg) -> tuple[object, str | None]:
    """evaluate.meteor_synonyms for this machine: `auto` resolved, `wordnet` refused where it is not installed."""
    from lifecycle.tasks.eval.evaluate import metrics_text

    setting, root = cfg.evaluate.meteor_synonyms, str(metrics_text.WORDNET_DIR)
    try:
        resolved = metrics_text.resolve_synonyms(setting, root)
    except metrics_text.WordNetMissing as e:
        raise UsageError(f"evaluate.meteor_synonyms: {e}") from None
    if resolved == setting:
        return cfg, None
    evaluate = cfg.evaluate.model_copy(update={"meteor_synonyms": resolved})
    note = None
    if resolved == "none":
        note = (f"METEOR without synonyms (gen_meteor_nosyn): no WordNet 3.0 in {root}; "
                "`sudo apt-get install wordnet-base` adds them (evaluate.meteor_synonyms: auto)")
    return cfg.model_copy(update={"evaluate": evaluate}), note


def _tracking_server(uri: str | None, name: str) -> None:
    """An http(s) tracking URI must accept a connection (a typo in the host or port fails here, not after
    training); its answer is MLflow's business."""
    if not uri or urlsplit(uri).scheme not in ("http", "https"):
        return
    parts = urlsplit(uri)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=5).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise UsageError(f"{name}: cannot connect to {parts.hostname}:{port}: {reason.lower()}") from e
