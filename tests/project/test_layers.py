"""The package's layers (docs/design.md): every import points down or sideways, none climbs, no circle.

Read from the source, TYPE_CHECKING and function-local imports included: a picture drawn from the
imports alone cannot tell that ``config -> platforms`` climbs, this map can.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "piecewise_backend"
PACKAGE = "piecewise_backend"

# Bottom up; a module may import only from its own layer or below.
LAYERS = ("core", "platforms", "capture", "backend", "ubatch", "runner", "blocks", "serve", "hf")
CORE = {"modes", "context", "config", "ops", "observability", "weak", "shapes", "inputs", "validation", "version"}
BLOCKS = {"attention", "kv", "state"}  # what a model is built from: attention, the KV and state caches
# The package's faces and documented re-export paths sit on top: they may name anything; so do the
# fixtures of ``testing`` (toy models, tiny HF models, graph_code) and the CLI. ``hf``'s face serves
# ``testing.hf_models.tiny_random_model`` (its documented path) through ``hf.fixture_aliases``, its lazy aliases.
TOP = {"", "__main__", "inspect_cli", "toy_llama", "moe", "parallel", "spec", "hf", "hf.fixture_aliases"}
TOP_PACKAGES = {"testing"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def layer_of(module: str) -> int:
    head = module.split(".")[0]
    if module in TOP or head in TOP_PACKAGES:
        return len(LAYERS)
    if module in CORE:
        return LAYERS.index("core")
    if head in BLOCKS:
        return LAYERS.index("blocks")
    if head in LAYERS:
        return LAYERS.index(head)
    raise AssertionError(f"module piecewise_backend.{module} has no layer: add it to tests/project/test_layers.py")


def imports_of(module: str) -> set[str]:
    """Modules of the package that ``module`` imports, anywhere in its body."""
    path = MODULES[module]
    return imports_in(path.read_text(), module, is_package=path.name == "__init__.py")


def imports_in(source: str, module: str, *, is_package: bool) -> set[str]:
    here = module.split(".") if module else []
    base = here if is_package else here[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[: len(base) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                targets = [PACKAGE + "".join("." + p for p in parts)]
            else:
                targets = [node.module or ""]
            names = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            rel = target[len(PACKAGE) + 1:]
            subs = [f"{rel}.{n}" if rel else n for n in names]
            modules = [s for s in subs if s in MODULES]
            found.update(modules if modules else [rel])
    found.discard(module)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES), ids=lambda m: m or "__init__")
def test_no_import_climbs(module):
    climbs = [t for t in sorted(GRAPH[module]) if layer_of(t) > layer_of(module)]
    where = LAYERS[layer_of(module)] if layer_of(module) < len(LAYERS) else "top"
    assert not climbs, f"piecewise_backend.{module} ({where}) imports from a higher layer: {climbs}"


def test_no_import_circle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("path", sorted(p for p in SRC.rglob("__init__.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_init_files_only_re_export(path):
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    defined = [n for n in body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(n)[:60] for n in defined if not _is_all(n)] == [], f"{path} defines more than __all__"
    exported = [ast.literal_eval(n.value) for n in defined if _is_all(n)]
    assert exported, f"{path} has no __all__"
    imported = {a.asname or a.name for n in body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    if "__getattr__" in imported:  # a module __getattr__ (PEP 562) imported from elsewhere serves lazy aliases too
        imported.discard("__getattr__")
        assert imported <= set(exported[0]), f"{path}: imported but not in __all__: {imported - set(exported[0])}"
        return
    assert set(exported[0]) == imported, f"{path}: __all__ and the imports differ: {set(exported[0]) ^ imported}"


def _is_all(node: ast.AST) -> bool:
    return isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]


def test_no_family_prefix_in_a_folder():
    # A family of modules is a package named after its concept, not a prefix (``ubatch_*``).
    for folder in {p.parent for p in SRC.rglob("*.py")}:
        stems = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("__"))
        prefixes = {}
        for stem in stems:
            if "_" in stem:
                prefixes.setdefault(stem.split("_")[0], []).append(stem)
        shared = {k: v for k, v in prefixes.items() if len(v) > 1 or (k in stems and v)}
        assert not shared, f"{folder.relative_to(SRC.parent)}: modules share a family prefix: {shared}"


def test_a_type_only_climb_is_seen():
    # What closed last round's 8-file circle: capture/memory.py typing GraphRunner under TYPE_CHECKING.
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..runner.graph_runner import GraphRunner\n"
    found = imports_in(source, "capture.memory", is_package=False)
    assert found == {"runner.graph_runner"}
    assert layer_of("runner.graph_runner") > layer_of("capture.memory")
    assert imports_in("from . import checks\n", "platforms.simulated.platform", is_package=False) == {
        "platforms.simulated.checks"
    }
