"""Every ```python block in README.md and docs/*.md runs, in order, one namespace per file."""

from __future__ import annotations

import inspect
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_code_blocks_run(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block runs; an attention backend a block registers is gone after the test (the engines' valid
    backends, which other tests in the process name, stay the library's own)."""
    from piecewise_backend.attention import backends

    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))
    module = types.ModuleType(f"doc_{path.stem}")  # importable, as a user's module is (Dynamo imports a class's module)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for i, block in enumerate(BLOCK.findall(path.read_text())):
        exec(compile(block, f"{path.name}[block {i}]", "exec"), namespace)


SHELL = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("path", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_doc_commands_run(path: Path) -> None:
    """The `python ...` lines of docs' bash blocks run with this interpreter and exit 0."""
    for block in SHELL.findall(path.read_text()):
        for line in block.splitlines():
            if line.startswith("python "):
                argv = [sys.executable, *shlex.split(line)[1:]]
                proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
                assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if line.startswith("python3 -m venv"))
    assert command in readme


# --- docs/api.md against the code ---------------------------------------------------------

SPAN = re.compile(r"`([^`]+)`")
SECTION_MODULES = {
    "piecewise_backend.kv.op": "kv.op", "piecewise_backend.kv": "kv", "piecewise_backend.hf.mixers": "hf.mixers",
    "piecewise_backend.hf.state_swaps": "hf.state_swaps",
    "piecewise_backend.serve": "serve",
    "piecewise_backend.hf": "hf",
    "piecewise_backend.spec": "spec",
    "piecewise_backend.state.metadata": "state.metadata", "piecewise_backend.state.cache": "state.cache",
    "piecewise_backend.state.conv": "state.conv", "piecewise_backend.state.delta": "state.delta",
    "piecewise_backend.state": "state",
    "piecewise_backend.parallel": "parallel",
    "piecewise_backend.attention.cuda": "attention.cuda", "piecewise_backend.attention.kernels": "attention.kernels",
    "piecewise_backend.attention": "attention",
}


def _api_rows() -> list[tuple[str, str]]:
    """(section, code span) for every code span that opens a row of a table in docs/api.md."""
    section, rows = "", []
    for line in (ROOT / "docs" / "api.md").read_text().splitlines():
        if line.startswith("#"):
            section = line
        elif line.startswith("| `"):
            first = line.split(" | ")[0][2:]
            rows += [(section, span) for span in SPAN.findall(first)]
    return rows


def _split_params(text: str) -> list[str]:
    parts, depth, cur, quote = [], 0, "", None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return [p for p in [*parts, cur.strip()] if p]


def _documented(params: list[str]) -> list[tuple[str, str, bool]]:
    """(name, kind, has default) of each parameter as written in the docs."""
    out, kw_only = [], False
    for p in params:
        if p == "*":
            kw_only = True
        elif p.startswith("**"):
            out.append((p[2:], "VAR_KEYWORD", False))
        elif p.startswith("*"):
            out.append((p[1:], "VAR_POSITIONAL", False))
            kw_only = True
        else:
            name = p.split("=")[0].strip()
            out.append((name, "KEYWORD_ONLY" if kw_only else "POSITIONAL_OR_KEYWORD", "=" in p))
    return out


def _actual(obj: object) -> list[tuple[str, str, bool]]:
    sig = inspect.signature(obj)
    return [
        (p.name, p.kind.name, p.default is not inspect.Parameter.empty)
        for p in sig.parameters.values()
        if p.name != "self"
    ]


def test_api_reference_matches_the_code() -> None:
    """Every name in docs/api.md's tables exists, and every documented signature is the code's
    (parameter names, order, keyword-only markers, which have defaults, literal default values)."""
    import ast
    import dataclasses
    import importlib
    import types

    import piecewise_backend as pb

    wrong = []
    for section, span in _api_rows():
        if span.startswith(("torch.", ".")) or "..." in span:
            continue
        name, _, params = span.partition("(")
        if "## Configuration" in section:
            fields = {f.name for f in dataclasses.fields(pb.CompilationConfig)}
            wrong += [f"{span}: not a CompilationConfig field" for n in name.split(", ") if n not in fields]
            continue
        module = next((m for full, m in SECTION_MODULES.items() if full in section), None)
        obj: object = importlib.import_module(f"piecewise_backend.{module}") if module else pb
        try:
            for part in name.split("."):
                if isinstance(obj, types.ModuleType) and not hasattr(obj, part):
                    obj = importlib.import_module(f"{obj.__name__}.{part}")  # a submodule not imported yet
                else:
                    obj = getattr(obj, part)
        except (AttributeError, ImportError):
            wrong.append(f"{span}: no such name ({section})")
            continue
        if not params:
            continue
        params = params[:-1] if params.endswith(")") else params
        doc = _documented(_split_params(params))
        if doc != _actual(obj):
            wrong.append(f"{span}: the code's signature is {inspect.signature(obj)}")
            continue
        for p in _split_params(params):
            key, eq, default = p.partition("=")
            if not eq or key.startswith("*"):
                continue
            try:
                value = ast.literal_eval(default)
            except ValueError:
                continue  # a name (FULL, torch.long): documented by name, not checked
            if inspect.signature(obj).parameters[key.strip()].default != value:
                wrong.append(f"{span}: default of {key} is {inspect.signature(obj).parameters[key.strip()].default!r}")
    assert not wrong, "\n".join(wrong)


def test_api_reference_lists_every_public_name() -> None:
    import importlib
    import types

    import piecewise_backend as pb

    text = (ROOT / "docs" / "api.md").read_text()
    public = [n for n in vars(pb) if not n.startswith("_") and not isinstance(getattr(pb, n), types.ModuleType)]
    for name in SECTION_MODULES:  # functions and classes the engine-level modules define
        module = importlib.import_module(name)
        defined = [n for n, v in vars(module).items() if getattr(v, "__module__", None) == name]
        public += [f"{name}: {n}" for n in defined if not n.startswith("_") and inspect.isroutine(getattr(module, n))]
        public += [f"{name}: {n}" for n in defined if not n.startswith("_") and inspect.isclass(getattr(module, n))]
    missing = [n for n in public if f"`{n.split(': ')[-1]}" not in text]
    assert not missing, f"docs/api.md does not list {missing}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_links_resolve(path: Path) -> None:
    """Relative links ``[..](file.md#anchor)`` name an existing file and one of its headings."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if "://" in target:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = [line.lstrip("#") for line in dest.read_text().splitlines() if line.startswith("#")]
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{path.name}: broken links {broken}"


PATH_REF = re.compile(r"(?<![\w/.-])((?:src/piecewise_backend|tests|scripts|benchmarks|examples)/[\w/]+\.(?:py|sh))")
MODULE_REF = re.compile(r"\bpiecewise_backend((?:\.[a-z_]+)+)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_paths_and_modules_exist(path: Path) -> None:
    """Files and modules the docs name exist where they say (they follow every move)."""
    import importlib

    text = path.read_text()
    missing = sorted({ref for ref in PATH_REF.findall(text) if not (ROOT / ref).exists()})
    assert not missing, f"{path.name} names files that do not exist: {missing}"
    for dotted in sorted(set(MODULE_REF.findall(text))):
        parts = dotted.strip(".").split(".")
        obj = importlib.import_module("piecewise_backend")
        for i, part in enumerate(parts):
            if not hasattr(obj, part):
                try:
                    obj = importlib.import_module("piecewise_backend." + ".".join(parts[: i + 1]))
                    continue
                except ImportError:
                    pytest.fail(f"{path.name} names piecewise_backend{dotted}, which does not exist")
            obj = getattr(obj, part)


def test_architecture_map_names_every_package_and_module() -> None:
    """docs/architecture.md's layer table names every package of src (``name/``) and every module: a
    top-level one as ``name.py``, one in a package by its name in that package's row."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ")]
    src = ROOT / "src" / "piecewise_backend"
    missing = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel.parent == Path("."):
            if not any(f"`{path.name}`" in row for row in rows):
                missing.append(rel.as_posix())
            continue
        package = rel.parts[0]
        row = next((r for r in rows if f"`{package}/`" in r), None)
        if row is None:
            missing.append(f"{package}/")
        elif path.name != "__init__.py" and not re.search(rf"\b{path.stem}\b", row):
            missing.append(rel.as_posix())
    assert not missing, f"docs/architecture.md's layer table does not name {sorted(set(missing))}"
