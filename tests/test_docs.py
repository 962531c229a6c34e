"""Every ```python block in README.md and docs/*.md runs, in order, one namespace per file."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_code_blocks_run(path: Path) -> None:
    namespace: dict = {"__name__": f"doc_{path.stem}"}
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
