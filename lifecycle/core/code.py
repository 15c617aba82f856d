"""Code versions: the part of a dataset's fingerprint that says which code made it.

A stage's code version is a sha256 over the sources of its own folder (every `.py` file under it), the core
(`lifecycle.core`), and every other module of this project that those sources import, followed transitively.
The imports are read from the source (`ast`), function-level ones included, so nothing is listed by hand: an
edit to a stage's folder changes that stage's version and, through the fingerprints that chain on it, every
stage after it; an edit to another stage's folder changes nothing before that stage.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from pathlib import Path

PROJECT = "lifecycle"
CORE = "lifecycle.core"


def _origin(module: str) -> Path | None:
    """Source file of a module of this project, or None if `module` names no module (e.g. a class imported
    with `from a.b import C`). Resolved on the file system, importing no module, only packages' folders."""
    parts = module.split(".")
    folder = _folder(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        if (folder / part / "__init__.py").exists():
            folder = folder / part
        elif (folder / f"{part}.py").exists():
            return folder / f"{part}.py"
        else:  # a package installed from another folder (package-dir), or not a module at all
            try:
                folder = _folder(".".join(parts[:i]))
            except ValueError:
                return None
    return folder / "__init__.py"


def _folder(package: str) -> Path:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{package} is not a package of this project")
    return Path(next(iter(spec.submodule_search_locations)))


def _imported(path: Path) -> set[str]:
    """Project modules a source file imports (absolute imports; `from a.b import c` counts a.b.c if it is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == PROJECT)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != PROJECT:
                continue
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def source_files(package: str) -> dict[str, Path]:
    """The files whose bytes make `package`'s code version, by a name that does not depend on where the
    project is installed: `<package>/<relative path>` for the folders, the module name for imported modules."""
    files: dict[str, Path] = {}
    for pkg in (package, CORE):
        folder = _folder(pkg)
        files.update({f"{pkg}/{f.relative_to(folder)}": f for f in folder.rglob("*.py")})
    seen = set(files.values())
    todo = sorted(seen)
    while todo:
        for module in sorted(_imported(todo.pop())):
            origin = _origin(module)
            if origin is not None and origin not in seen:
                seen.add(origin)
                files[module] = origin
                todo.append(origin)
    return dict(sorted(files.items()))


def code_version(package: str) -> str:
    """sha256 (16 hex chars) over the sources of `package` and what they import (see the module docstring)."""
    h = hashlib.sha256()
    for name, f in source_files(package).items():
        h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]
