"""Path confinement: every path a config or a command line names is resolved (symlinks followed, `..` folded)
and must lie inside the work dir or a declared root; anything else is refused with an error naming the path,
where it resolved to, and the allowed roots.

Rules (README "Security"):
- `collect.inputs`: each pattern's fixed part (the directories before the first glob character) must lie in
  `input_roots` or the work dir when `input_roots` is declared; whether declared or not, every file a pattern
  matches must resolve inside that fixed part, so neither a symlink nor a `..` after a glob leads elsewhere.
- `tokenize.tokenizer_file`: inside `input_roots` or the work dir when `input_roots` is declared.
- the audit commands (`lifecycle lineage ...`, `lifecycle sql`) read only inside `--workdir`, and
  `lifecycle export hf` reads inside `--workdir` or `--input-root` and writes inside `--workdir`.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Iterable

from lifecycle.core import fs

DEFAULT_CONFIG = "deploy/configs/demo.yaml"  # `lifecycle run`'s CONFIG when none is given


class PathEscape(ValueError):
    """A path that resolves outside the roots it is confined to."""


def resolve_within(path: str | Path, roots: Iterable[str | Path], what: str, error: type = PathEscape) -> Path:
    """`path` resolved (symlinks followed); raises `error` naming `what`, the path and the roots if it is outside."""
    resolved = Path(path).expanduser().resolve()
    allowed = [Path(r).expanduser().resolve() for r in roots]
    if not any(resolved == r or resolved.is_relative_to(r) for r in allowed):
        via = "" if str(resolved) == str(path) else f" resolves to {resolved}, which"
        raise error(f"{what}: {path}{via} is outside the allowed roots ({', '.join(map(str, allowed)) or 'none'})")
    return resolved


def pattern_root(pattern: str) -> Path:
    """The fixed directory a glob pattern (or `file://` URL) starts from: its parts before the first one with a
    glob character (for a plain file path, its directory)."""
    parts = Path(fs.local_path(pattern)).expanduser().parts
    fixed = []
    for part in parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    else:
        fixed = fixed[:-1]  # no glob at all: the file's own directory
    return Path(*fixed) if fixed else Path(".")


def confine_matches(pattern: str, matches: Iterable[str], error: type = PathEscape) -> None:
    """Every file a glob pattern matched must resolve inside the pattern's fixed directory."""
    root = pattern_root(pattern)
    for m in matches:
        resolve_within(fs.local_path(m), [root], f"collect.inputs pattern {pattern!r}", error)
