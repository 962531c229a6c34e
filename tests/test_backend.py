"""The piecewise_breakable backend (DESIGN 4.3): equals eager, compiles identical pieces once,
works from its entry point alone, dumps, logs and counts."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import piecewise_backend as pb
from tests.helpers import make_model, saved_splitting_ops, token_ids


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # the toy model is tiny: intra-op thread hand-offs on a small shared machine cost more than they save
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def eager_config(**kw) -> pb.CompilationConfig:
    return pb.CompilationConfig(compile_pieces="eager", **kw)


def kinds(split: pb.SplitGraph) -> str:
    return "".join("S" if p.is_splitting else "C" for p in split.pieces)


def with_double(x):
    return torch.ops.pb_test.double(x.sin()) + 1


# ---------------------------------------------------------------- the toy model equals eager

CASES = [("inplace", "eager"), ("fresh", "eager"), ("inplace", "inductor"), ("fresh", "inductor")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{c}" for a, c in CASES])
def compiled_toy(request):
    """One compiled 2-layer toy model per (attention, compile_pieces), shared by the token counts."""
    attention, pieces = request.param
    torch._dynamo.reset()  # ToyLlama.forward is one code object for every case: keep under recompile_limit
    model = make_model(2, attention)
    backend = pb.make_backend(pb.CompilationConfig(compile_pieces=pieces))
    return model, torch.compile(model, backend=backend), backend


@pytest.mark.parametrize("tokens", [1, 2, 9])
def test_toy_model_matches_eager(compiled_toy, tokens):
    model, compiled, backend = compiled_toy
    ids = token_ids(tokens, seed=tokens)
    torch.testing.assert_close(compiled(ids), model(ids))
    # the backend really split this model: 2 attention layers -> 5 pieces, 3 compiled
    assert backend.splits and all(kinds(s) == "CSCSC" for s in backend.splits)
    for s in backend.splits:
        for p in s.pieces:
            runner = s.split_gm.__dict__[p.name]
            assert isinstance(runner, pb.BreakPoint) is p.is_splitting


def test_toy_model_repeated_calls_do_not_recompile(compiled_toy):
    model, compiled, backend = compiled_toy
    compiled(token_ids(5))  # make sure the dynamic graph exists
    with pb.expect(graphs=0, compiles=0):
        for n in (3, 9, 4):
            ids = token_ids(n, seed=n)
            torch.testing.assert_close(compiled(ids), model(ids))


def test_identical_layers_compile_once():
    model = make_model(4, "inplace")
    backend = pb.make_backend(pb.CompilationConfig(compile_pieces="inductor"))
    compiled = torch.compile(model, backend=backend)
    ids = token_ids(6)
    # first piece, middle piece x3 (layers 0-1, 1-2, 2-3: same code, weights as inputs), last piece
    with pb.expect(graphs=1, pieces=9, splitting_pieces=4, compiled_pieces=5, compiles=3, compile_cache_hits=2):
        out = compiled(ids)
    torch.testing.assert_close(out, model(ids))  # different weights per layer: reuse is not aliasing
    ids = token_ids(11, seed=1)
    torch.testing.assert_close(compiled(ids), model(ids))


# ---------------------------------------------------------------- counters and pieces


def test_eager_pieces_count_without_compiling():
    backend = pb.make_backend(eager_config(splitting_ops=["pb_test::double"]))
    x = torch.randn(5)
    with pb.expect(graphs=1, pieces=3, splitting_pieces=1, compiled_pieces=2, compiles=0, compile_cache_hits=0):
        out = torch.compile(with_double, backend=backend)(x)
    torch.testing.assert_close(out, with_double(x))
    (split,) = backend.splits
    assert kinds(split) == "CSC"
    assert isinstance(split.split_gm.__dict__["submod_1"], pb.BreakPoint)


def test_empty_splitting_ops_means_no_split():
    backend = pb.make_backend(eager_config(splitting_ops=[]))
    x = torch.randn(5)
    with pb.expect(graphs=1, pieces=1, splitting_pieces=0, compiled_pieces=1):
        out = torch.compile(with_double, backend=backend)(x)
    torch.testing.assert_close(out, with_double(x))


def test_default_splitting_ops_are_the_registry_at_compile_time():
    backend = pb.make_backend(eager_config())  # created before the op is registered
    x = torch.randn(5)

    def first(x):
        return torch.ops.pb_test.double(x.cos()) * 2

    def second(x):
        return torch.ops.pb_test.double(x.cos()) * 3

    with saved_splitting_ops():
        pb.register_splitting_op("pb_test::double")
        with pb.expect(pieces=3, splitting_pieces=1):
            torch.testing.assert_close(torch.compile(first, backend=backend)(x), first(x))
    with pb.expect(pieces=1, splitting_pieces=0):  # registry restored: no longer a splitting op
        torch.testing.assert_close(torch.compile(second, backend=backend)(x), second(x))


def test_backend_accepts_mode_and_options_keywords():
    backend = pb.make_backend(eager_config(splitting_ops=["pb_test::double"]))
    x = torch.randn(3)

    def f(x):
        return torch.ops.pb_test.double(x) - 1

    def g(x):
        return torch.ops.pb_test.double(x) - 2

    torch.testing.assert_close(torch.compile(f, backend=backend, options={"anything": 1})(x), f(x))
    torch.testing.assert_close(torch.compile(g, backend=backend, mode="max-autotune")(x), g(x))
    assert [kinds(s) for s in backend.splits] == ["SC", "SC"]


def test_make_backend_rejects_non_config():
    with pytest.raises(TypeError, match="CompilationConfig"):
        pb.make_backend({"compile_pieces": "eager"})
    assert isinstance(pb.make_backend(), pb.PiecewiseBackend)
    assert pb.make_backend().config == pb.CompilationConfig()


# ---------------------------------------------------------------- debug dump, logging


def test_debug_dump_dir_writes_split_and_every_piece(tmp_path):
    dump = tmp_path / "dump"
    backend = pb.make_backend(eager_config(splitting_ops=["pb_test::double"], debug_dump_dir=dump))

    def fn(x):
        y = torch.ops.pb_test.double(x.sin())
        return torch.ops.pb_test.double(y.cos()) + 1

    x = torch.randn(4)
    torch.testing.assert_close(torch.compile(fn, backend=backend)(x), fn(x))
    (split,) = backend.splits
    files = sorted(dump.rglob("*.py"))
    by_name = {f.name: f.read_text() for f in files}
    assert "split.py" in by_name
    for p in split.pieces:
        (match,) = [n for n in by_name if n == f"{p.name}.py" or n.startswith(f"{p.name}_")]  # one file per piece
        code = "\n".join(line for line in by_name[match].splitlines() if not line.strip().startswith("#"))
        assert ("torch.ops.pb_test.double(" in code) is p.is_splitting, (match, code)
    assert len(files) == 1 + len(split.pieces)
    assert all(p.name in by_name["split.py"] for p in split.pieces)
    assert "sin" in by_name[next(n for n in by_name if n.startswith("submod_0"))]


def test_configured_op_that_never_appears_is_logged_once(caplog):
    caplog.set_level(logging.DEBUG, logger="piecewise_backend")
    backend = pb.make_backend(eager_config(splitting_ops=["pb_test::double_into"]))

    def f(x):
        return x.cos() + 1

    def g(x):
        return x.tan() * 2

    x = torch.randn(3)
    with pb.expect(graphs=2, pieces=2, splitting_pieces=0):
        torch.compile(f, backend=backend)(x)
        torch.compile(g, backend=backend)(x)
    records = [r for r in caplog.records if r.name == "piecewise_backend" and "pb_test::double_into" in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno >= logging.WARNING


def test_op_that_appears_is_not_reported_missing(caplog):
    caplog.set_level(logging.DEBUG, logger="piecewise_backend")
    backend = pb.make_backend(eager_config(splitting_ops=["pb_test::double"]))
    torch.compile(with_double, backend=backend)(torch.randn(3))
    assert not [r for r in caplog.records if "did not appear" in r.getMessage()]


def test_graph_without_splitting_op_warns_when_piecewise_graphs_are_on(caplog):
    caplog.set_level(logging.DEBUG, logger="piecewise_backend")
    piecewise = pb.make_backend(eager_config(platform="simulated", cudagraph_mode="PIECEWISE"))
    torch.compile(lambda x: x.cos() + 1, backend=piecewise)(torch.randn(3))
    torch.compile(lambda x: x.sin() + 1, backend=piecewise)(torch.randn(3))
    warned = [r for r in caplog.records if r.name == "piecewise_backend" and "has no splitting op" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING  # once per backend, not per graph
    assert "scaled_dot_product_attention" in warned[0].getMessage()  # names the registered ops
    caplog.clear()
    no_graphs = pb.make_backend(eager_config(platform="simulated", cudagraph_mode="NONE"))
    torch.compile(lambda x: x.tan() + 1, backend=no_graphs)(torch.randn(3))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ---------------------------------------------------------------- entry point


ENTRY_TEST = "test_entry_point_works_without_importing_the_package"
ENTRY_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    assert "piecewise_backend" not in sys.modules
    f = torch.compile(lambda x: x.sin() + 1, backend="piecewise_breakable")
    print(f(torch.ones(2)).tolist())
    print("piecewise_backend" in sys.modules)
    print(sys.modules["piecewise_backend"].counters["graphs"])
    """
)


@pytest.fixture(scope="module", autouse=True)
def entry_point_process(request, tmp_path_factory):
    """Start the entry-point subprocess (~10 s of imports and a cold Inductor compile) when the
    module starts, so it overlaps the other tests; the entry-point test collects it."""
    if not any(item.name == ENTRY_TEST for item in request.session.items):
        yield None
        return
    proc = subprocess.Popen(
        [sys.executable, "-c", ENTRY_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path_factory.mktemp("entry_point"),
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_entry_point_works_without_importing_the_package(entry_point_process):
    stdout, stderr = entry_point_process.communicate(timeout=300)
    assert entry_point_process.returncode == 0, stderr[-3000:]
    values, imported, graphs = stdout.strip().splitlines()[-3:]
    assert eval(values) == pytest.approx([1.8414709848, 1.8414709848])
    assert imported == "True"  # loaded through the entry point, by torch
    assert int(graphs) == 1  # and the backend really compiled the graph


def test_register_is_idempotent_next_to_the_entry_point():
    from torch._dynamo.backends.registry import lookup_backend

    pb.register()
    pb.register()
    assert lookup_backend("piecewise_breakable") is pb.piecewise_breakable


@pytest.mark.skipif(torch.cuda.is_available(), reason="platform='auto' means CUDA here")
def test_per_piece_scheme_on_cpu_with_auto_platform_wraps_nothing():
    # platform='auto' without a GPU means no graphs: the classic scheme must not install
    # per-piece wrappers that would only cost a passthrough (or fail) on every call.
    backend = pb.make_backend(pb.CompilationConfig(use_breakable=False, compile_pieces="eager"))
    model = make_model(2, "inplace")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        ids = token_ids(4)
        torch.testing.assert_close(compiled(ids), model(ids))
    split_gm = backend.splits[-1].split_gm
    runners = [split_gm.__dict__[p.name] for p in backend.splits[-1].pieces if not p.is_splitting]
    assert runners and not any(isinstance(r, pb.CUDAGraphWrapper) for r in runners)
