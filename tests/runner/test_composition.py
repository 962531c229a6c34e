"""The composition matrix (scripts/compat_matrix.py) and docs/compatibility.md: a sample of its cells.

The whole matrix (every engine x cudagraph_mode x use_ubatching x use_breakable x CPU attention
backend) runs in the script; here a sample covering every engine and every value of every axis
runs again and must say what the committed page says.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("compat_matrix", ROOT / "scripts" / "compat_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


matrix = _load_script()
Cell = matrix.Cell
PAGE = matrix.parse((ROOT / "docs" / "compatibility.md").read_text())

SAMPLE = [
    Cell("runner", "FULL_AND_PIECEWISE", False, True, "bounded"),  # works
    Cell("runner", "FULL", True, False, "reference"),  # downgraded: micro-batched prompt steps run eagerly
    Cell("runner", "PIECEWISE", True, True, "reference"),  # downgraded: PIECEWISE -> NONE
    Cell("runner", "NONE", False, False, "bounded"),
    Cell("hf", "FULL_DECODE_ONLY", True, True, "bounded"),  # micro-batched FULL decode graphs
    Cell("hf", "PIECEWISE", False, False, "reference"),  # per-piece graphs
    Cell("spec", "FULL_AND_PIECEWISE", True, False, "bounded"),
    Cell("spec", "FULL", False, True, "reference"),  # both caches on the reference backend
    Cell("serve", "FULL_AND_PIECEWISE", False, True, "bounded"),  # your own model: chunks, preemption
    Cell("serve", "FULL", True, False, "reference"),
    Cell("serve-prefix", "FULL_AND_PIECEWISE", True, True, "bounded"),  # shared prompt blocks reused, micro-batched
    Cell("spec-lazy", "FULL_AND_PIECEWISE", False, True, "bounded"),  # served before and after capture_idle
    Cell("spec-sample", "FULL_AND_PIECEWISE", False, True, "bounded"),  # greedy and seeded requests together
    Cell("spec-state", "FULL", True, False, "reference"),  # state layers: PIECEWISE verify, said why
    Cell("compile", "PIECEWISE", False, True, "bounded"),  # plain torch.compile: generate captures by itself
    Cell("serve-none", "FULL_AND_PIECEWISE", False, True, "bounded"),  # no Dynamo: breaks at run time
    Cell("runner-none", "FULL", True, True, "reference"),  # no Dynamo, micro-batched
    Cell("hf-none", "PIECEWISE", False, False, "bounded"),  # refused: no pieces without Dynamo
]


def test_the_page_lists_every_cell_and_no_bug():
    cells = matrix.all_cells()
    assert len(cells) == len(matrix.ENGINES) * 5 * 2 * 2 * len(matrix.BACKENDS) >= 120
    assert set(PAGE) == set(cells), "docs/compatibility.md is stale: run python scripts/compat_matrix.py"
    assert {outcome for outcome, _, _ in PAGE.values()} <= set(matrix.OUTCOMES)
    bugs = {c: v for c, v in PAGE.items() if v[0] in ("wrong", "crash")}
    assert not bugs
    for cell, (outcome, _, why) in PAGE.items():
        assert (outcome in ("works",)) == (why == ""), (cell, outcome, why)  # every other outcome says why


def test_engine_md_says_what_composes_as_the_matrix_found_it():
    page = (ROOT / "docs" / "engine.md").read_text()
    table = matrix.composes(PAGE)
    assert table in page, "docs/engine.md's 'What composes' is stale: run python scripts/compat_matrix.py --composes"
    assert "| `HFEngine`: online requests | 20 works |" in table  # 5 modes x 2 use_breakable x 2 CPU backends
    edited = page.replace("| 20 works |", "| 19 works, 1 wrong |", 1)
    assert matrix.write_composes(edited, table) == page  # regenerating restores it


def test_the_sample_covers_every_engine_and_every_value_of_every_axis():
    for axis, values in (("engine", matrix.ENGINES), ("mode", matrix.MODES), ("ubatching", (False, True)),
                         ("breakable", (False, True)), ("backend", matrix.BACKENDS)):
        assert {getattr(c, axis) for c in SAMPLE} == set(values), axis


@pytest.mark.parametrize("cell", SAMPLE, ids=lambda c: "-".join((c.engine, *c.key())))
def test_a_sampled_cell_says_what_the_page_says(cell):
    if cell.engine != "runner":
        pytest.importorskip("transformers")
    result = matrix.run_cell(cell)
    assert result.outcome not in ("wrong", "crash"), result
    assert PAGE[cell] == (result.outcome, result.ran, matrix._cell_text(result.why))


def test_render_and_parse_round_trip():
    results = [matrix.Result(SAMPLE[0], "works", "", "FULL 2"),
               matrix.Result(SAMPLE[1], "downgraded", "use_ubatching: a | b", "NONE 1; 1 split")]
    parsed = matrix.parse(matrix.render(results))
    assert parsed == {SAMPLE[0]: ("works", "FULL 2", ""), SAMPLE[1]: ("downgraded", "NONE 1; 1 split", "use_ubatching: a \\| b")}
