"""The import picture of docs/architecture.md, checked on the source (ast; function-level imports included):

    lifecycle.cli > lifecycle.flows > lifecycle.config > lifecycle.lineage
        > lifecycle.tasks (stages > eval > train > data) > lifecycle.core

A module imports only from its own layer or from layers below it; only `lifecycle.lineage` imports MLflow; only
`lifecycle.flows` and the CLI (which starts Prefect's ephemeral server) import Prefect; the modules a training
rank loads import neither, even indirectly; and no two modules import each other, directly or in a circle.

The tree is one import name over four folders (pyproject.toml's `package-dir`), which import-linter's graph
builder does not follow (it walks one folder per top-level package), so the graph is built here from the same
`package-dir` table that setuptools installs from.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]

# top first; a module belongs to the layer of the longest prefix of its name listed here
LAYERS = ["lifecycle.launch", "lifecycle.cli", "lifecycle.console", "lifecycle.flows", "lifecycle.preflight", "lifecycle.config", "lifecycle.lineage", "lifecycle.tasks.stages",
          "lifecycle.tasks.clip", "lifecycle.tasks.eval", "lifecycle.tasks.train", "lifecycle.tasks.data", "lifecycle.core"]
# package __init__ modules above the layers (they must stay empty of project imports)
ROOTS = {"lifecycle", "lifecycle.tasks"}
# third-party top-level packages -> the layers (module prefixes) allowed to import them
FORBIDDEN_OUTSIDE = {
    "mlflow": ("lifecycle.lineage",),
    "prefect": ("lifecycle.flows",),
    "distributed": ("lifecycle.flows",),
}
# what a DeepSpeed rank imports (`deepspeed ... -m lifecycle.tasks.train.trainer`): never Prefect or MLflow
# (and the persist process each rank starts: `persist`; the memory tier's loader: `memtier`)
RANK_MODULES = [f"lifecycle.tasks.train.{m}" for m in ("trainer", "model", "loader", "commit", "arena", "persist",
                                                       "async_saver", "memtier")] + ["lifecycle.tasks.clip.trainer"]


def project_modules() -> dict[str, Path]:
    """Every module of the installed tree, by dotted name, from `package-dir`."""
    out: dict[str, Path] = {}
    for package, folder in PACKAGE_DIR.items():
        base = ROOT / folder
        for f in sorted(base.rglob("*.py")):
            rel = f.relative_to(base).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            name = ".".join((package, *rel))
            if name in out and out[name] != f:
                raise AssertionError(f"{name} is both {out[name]} and {f}")
            out[name] = f
    return out


MODULES = project_modules()


def imports_of(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement anywhere in the file. Project names are resolved to the
    most specific module (`from a.b import c` is a.b.c when that is a module); others keep their top-level name."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for a in node.names:
                sub = f"{module}.{a.name}"
                out.append((sub if sub in MODULES else module, node.lineno))
    resolved = []
    for mod, line in out:
        if mod.split(".")[0] == "lifecycle":
            while mod not in MODULES and "." in mod:  # `import lifecycle.x.y` of a non-module name: its module
                mod = mod.rsplit(".", 1)[0]
        resolved.append((mod, line))
    return list(dict.fromkeys(resolved))


GRAPH: dict[str, list[tuple[str, int]]] = {m: imports_of(m, p) for m, p in MODULES.items()}


def layer_of(module: str) -> int:
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    raise AssertionError(f"{module} ({MODULES[module]}) is in no layer of tests/test_layers.py: place it in LAYERS")


def where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def test_the_graph_is_real():
    """The checker sees the tree: every folder's modules, and imports that are known to exist (lazy ones too)."""
    assert {"lifecycle.cli", "lifecycle.core.dataset", "lifecycle.flows.pipeline", "lifecycle.lineage.tracking",
            "lifecycle.tasks.stages", "lifecycle.tasks.train.trainer", "lifecycle.tasks.data.dedup.stage"} <= set(MODULES)
    edges = {m: {i for i, _ in imps} for m, imps in GRAPH.items()}
    assert "lifecycle.core.dataset" in edges["lifecycle.tasks.data.filter.stage"]
    assert "lifecycle.flows.pipeline" in edges["lifecycle.cli"]  # a function-level import in cmd_run
    assert "mlflow" in edges["lifecycle.lineage.tracking"] and "prefect" in edges["lifecycle.flows.retry"]


def test_every_module_has_a_layer():
    for m in MODULES:
        if m not in ROOTS:
            layer_of(m)
    for m in ROOTS:
        assert not [i for i, _ in GRAPH[m] if i.startswith("lifecycle")], f"{MODULES[m]} must not import the project"


def test_layers_point_down():
    upward = []
    for m, imps in GRAPH.items():
        if m in ROOTS:
            continue
        for imported, line in imps:
            if imported in MODULES and imported not in ROOTS and layer_of(imported) < layer_of(m):
                upward.append(f"{where(m, line)}: {m} ({LAYERS[layer_of(m)]}) imports {imported} "
                              f"({LAYERS[layer_of(imported)]}, a higher layer)")
    assert upward == [], "imports that point up:\n" + "\n".join(upward)


@pytest.mark.parametrize("library", sorted(FORBIDDEN_OUTSIDE))
def test_only_its_layer_imports(library):
    allowed = FORBIDDEN_OUTSIDE[library]
    bad = [f"{where(m, line)}: {m} imports {imported}" for m, imps in GRAPH.items() for imported, line in imps
           if imported.split(".")[0] == library and not any(m == a or m.startswith(a + ".") for a in allowed)]
    assert bad == [], f"only {', '.join(allowed)} may import {library}:\n" + "\n".join(bad)


def reachable(start: str) -> dict[str, list[str]]:
    """Every project module `start` loads, directly or through others, with one import path to it."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        m = todo.pop()
        for imported, _ in GRAPH[m]:
            if imported in MODULES and imported not in paths:
                paths[imported] = paths[m] + [imported]
                todo.append(imported)
    return paths


@pytest.mark.parametrize("module", RANK_MODULES + ["lifecycle.flows.worker_preload"])
def test_a_training_rank_or_a_dask_worker_loads_neither_prefect_nor_mlflow(module):
    bad = [f"{' -> '.join(path)} imports {imported} ({where(m, line)})"
           for m, path in reachable(module).items() for imported, line in GRAPH[m]
           if imported.split(".")[0] in ("prefect", "mlflow")]
    assert bad == [], "\n".join(bad)


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in GRAPH[v]:
            if w not in MODULES or w == v:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles()
    detail = [" <-> ".join(c) + ": " + "; ".join(f"{where(m, line)} imports {i}" for m in c for i, line in GRAPH[m]
                                                  if i in c) for c in found]
    assert found == [], "import cycles (function-level imports count):\n" + "\n".join(detail)


def test_the_cycle_finder_finds_cycles(monkeypatch):
    # a planted back edge of dataset -> integrity (fs, which both import, would make the cycle three modules long)
    monkeypatch.setitem(GRAPH, "lifecycle.core.integrity",
                        [*GRAPH["lifecycle.core.integrity"], ("lifecycle.core.dataset", 1)])
    assert ["lifecycle.core.dataset", "lifecycle.core.integrity"] in [c for c in cycles() if len(c) == 2]


def test_every_package_folder_is_listed_in_pyproject():
    """setuptools installs only the packages listed: a folder with an __init__.py that is not listed would be
    importable from this checkout but missing from a wheel."""
    folders = {}
    for package, folder in PACKAGE_DIR.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            folders[".".join((package, *rel))] = str(init.parent.relative_to(ROOT))
    listed = set(SETUPTOOLS["packages"])
    missing = {name: folder for name, folder in folders.items() if name not in listed}
    assert missing == {}, f"package folders missing from [tool.setuptools] packages in pyproject.toml: {missing}"
    assert sorted(listed - set(folders)) == [], "listed in pyproject.toml but no such package folder"
    # the same tree is what the project imports from: one name for each file
    import importlib.util

    for name, folder in folders.items():
        spec = importlib.util.find_spec(name)
        assert spec is not None and Path(next(iter(spec.submodule_search_locations))) == ROOT / folder, name
