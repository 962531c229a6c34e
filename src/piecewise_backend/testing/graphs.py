"""graph_code: stable, normalized FX code for expecttests (users' own tests and ours)."""

from __future__ import annotations

import re

import torch.fx as fx

_TAIL = re.compile(r";\s+[\w\s=]*=\s*None\s*$")
_SYMBOL = re.compile(r"\b([su])\d+\b")


def graph_code(gm: fx.GraphModule | fx.Graph) -> str:
    """FX code of ``gm`` without file paths, line numbers, liveness tails or hash-derived symbol names.

    Symbols (``s52``, ``u3``) are renamed ``s0, s1, ...`` in order of first appearance, so the
    text is stable across runs, checkouts and source edits.
    """
    code = gm.python_code("self").src if isinstance(gm, fx.Graph) else gm.code
    lines = []
    for line in code.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        lines.append(_TAIL.sub("", line.rstrip()).rstrip())
    text = "\n".join(lines)
    names: dict[str, str] = {}

    def rename(m: re.Match[str]) -> str:
        old = m.group(0)
        if old not in names:
            names[old] = f"{m.group(1)}{sum(1 for k in names if k[0] == m.group(1))}"
        return names[old]

    return _SYMBOL.sub(rename, text) + "\n"
