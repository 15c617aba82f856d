"""Reading small JSONL(.gz) files of objects (eval sets, code problems and samples) with errors that name the file
and line. Corpus files are read by collect's own streaming reader, which quarantines bad lines instead."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from lifecycle.core.errors import UsageError


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSONL or JSONL.gz file."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{no}: not a JSON line ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise UsageError(f"{path}:{no}: expected a JSON object, found {type(obj).__name__}")
            yield no, obj
