"""The piecewise_breakable backend (DESIGN 4.3): equals eager, compiles identical pieces once,
works from its entry point alone, dumps, logs and counts."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import piecewise_backend as pb
from pbtest.helpers import make_model, saved_splitting_ops, token_ids


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


def test_backend_honors_torch_compile_modes_and_refuses_options_naming_why():
    backend = pb.make_backend(eager_config(splitting_ops=["pb_test::double"]))
    x = torch.randn(3)

    def f(x):
        return torch.ops.pb_test.double(x) - 1

    def g(x):
        return torch.ops.pb_test.double(x) - 2

    def h(x):
        return torch.ops.pb_test.double(x) - 3

    with pytest.raises(Exception, match=r"options=\{'anything': 1\}\) is refused by piecewise_breakable: options are Inductor's"):
        torch.compile(f, backend=backend, options={"anything": 1})(x)
    torch.testing.assert_close(torch.compile(g, backend=backend, mode="max-autotune")(x), g(x))
    plain = torch.compile(h, backend=backend, mode="max-autotune-no-cudagraphs")
    with pb.expect(captures=0):  # a mode without CUDA graphs: every plain call runs eagerly
        for _ in range(3):
            torch.testing.assert_close(plain(x), h(x))
    with pytest.raises(Exception, match=r"mode=.fastest.\) is not a mode piecewise_breakable knows"):
        torch.compile(f, backend=backend, mode="fastest")(x)


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


def _break_after(x):
    h = torch.ops.pb_test.double(x.sin())
    h = h[h > 0]  # boolean-mask indexing: a data-dependent shape, so Dynamo breaks the graph here
    return h.cos().sum()


def _break_before(x):
    h = x.cos()
    h = h[h > 0]
    return torch.ops.pb_test.double(h).sum()


@pytest.mark.parametrize("fn, why", [
    (_break_before, r"Dynamo ended this graph at a graph break at .*test_backend.py:\d+ \(Dynamic shape operator"),
    (_break_after, r"this graph is torch_dynamo_resume_in__break_after_at_\d+: the rest of _break_after after a graph break"),
])
def test_graph_cut_by_a_graph_break_says_so_instead_of_blaming_registration(caplog, fn, why):
    """Where Dynamo split the model at a graph break, the graph without a splitting op is not a
    registration problem (the op is registered, and found in the other graph): the warning says why."""
    caplog.set_level(logging.WARNING, logger="piecewise_backend")
    backend = pb.make_backend(eager_config(platform="simulated", cudagraph_mode="PIECEWISE",
                                           splitting_ops=["pb_test::double"]))
    x = torch.randn(6, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.compile(fn, backend=backend)(x), fn(x))
    assert [s.found_ops for s in backend.splits].count(["pb_test::double"]) == 1 and len(backend.splits) == 2
    (warned,) = [r.getMessage() for r in caplog.records if "has no splitting op" in r.getMessage()]
    assert re.search(why, warned), warned
    assert "register the model's attention op" not in warned and "torch._dynamo.explain" in warned, warned
    assert [s.graph_break is not None for s in backend.splits] == [True, True]


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
def test_per_piece_scheme_on_cpu_with_auto_platform_wraps_nothing(monkeypatch):
    # platform='auto' without a GPU means no graphs: the classic scheme must not install
    # per-piece wrappers that would only cost a passthrough (or fail) on every call.
    import piecewise_backend.backend.compiler as backend_module

    monkeypatch.setattr(backend_module, "_compile_inductor", lambda gm: backend_module.direct_forward(gm))  # fast
    backend = pb.make_backend(pb.CompilationConfig(use_breakable=False))  # Inductor pieces: no simulator either
    model = make_model(2, "inplace")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        ids = token_ids(4)
        torch.testing.assert_close(compiled(ids), model(ids))
    split_gm = backend.splits[-1].split_gm
    runners = [split_gm.__dict__[p.name] for p in backend.splits[-1].pieces if not p.is_splitting]
    assert runners and not any(isinstance(r, pb.CUDAGraphWrapper) for r in runners)


def test_drop_removes_one_descriptor_of_every_per_piece_wrapper():
    config = pb.CompilationConfig(use_breakable=False, compile_pieces="eager", platform="simulated")
    backend = pb.make_backend(config)
    model = make_model(2, "inplace")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for n in (4, 8):
            with pb.set_forward_context(pb.CUDAGraphMode.PIECEWISE, pb.BatchDescriptor(n)):
                compiled(token_ids(n))
    assert backend.piece_wrappers and all(set(w.entries) == {pb.BatchDescriptor(4), pb.BatchDescriptor(8)}
                                          for w in backend.piece_wrappers)
    assert backend.drop(pb.CUDAGraphMode.PIECEWISE, pb.BatchDescriptor(4)) is True
    assert all(set(w.entries) == {pb.BatchDescriptor(8)} for w in backend.piece_wrappers)
    assert backend.drop(pb.CUDAGraphMode.PIECEWISE, pb.BatchDescriptor(4)) is False
    assert backend.drop(pb.CUDAGraphMode.FULL, pb.BatchDescriptor(8)) is False  # per-piece wrappers are PIECEWISE


# ---------------------------------------------------------------- what decides that two pieces share a compile


def _cond_sin(x):
    return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,)) + 1


def _cond_times_100(x):
    return torch.cond(x.sum() > 0, lambda t: t * 100, lambda t: t.cos(), (x,)) + 1


def test_pieces_differing_inside_a_cond_body_do_not_share_a_compile():
    # the repro, through the process-wide default backend and real Inductor compiles
    x = torch.ones(4)
    torch.testing.assert_close(torch.compile(_cond_sin, backend="piecewise_breakable")(x), _cond_sin(x))
    out = torch.compile(_cond_times_100, backend="piecewise_breakable")(x)
    torch.testing.assert_close(out, _cond_times_100(x))  # 101, not the first model's 1.84


def _scaler(k: float):
    def scale(t):
        return t * k

    return torch.compiler.allow_in_graph(scale)  # two closures, one __qualname__


_SCALE_2, _SCALE_3 = _scaler(2.0), _scaler(3.0)


def _wrap_body(op):
    from torch._higher_order_ops.wrap import wrap

    return lambda x: wrap(op, x) + 1


def _checkpointed(op):
    return lambda x: torch.utils.checkpoint.checkpoint(op, x, use_reentrant=False) + 1


PAIRS = {  # two functions whose graphs have the same structure and names but differ in code
    "cond body": (_cond_sin, _cond_times_100),
    "wrap body": (_wrap_body(torch.sin), _wrap_body(torch.cos)),
    "checkpoint body": (_checkpointed(torch.sin), _checkpointed(torch.cos)),
    "closure": (lambda x: _SCALE_2(x.sin()) + 1, lambda x: _SCALE_3(x.sin()) + 1),
}


@pytest.fixture
def fake_inductor(monkeypatch):
    """compile_pieces='inductor' with each piece's own Python as its "compiled" code: sharing a
    compile between different pieces shows as the first piece's result, without Inductor's cost."""
    import piecewise_backend.backend.compiler as backend_module

    monkeypatch.setattr(backend_module, "_compile_inductor", lambda gm: backend_module.direct_forward(gm))


@pytest.mark.parametrize("case", PAIRS, ids=list(PAIRS))
def test_different_code_behind_the_same_structure_compiles_apart(fake_inductor, case):
    first, second = PAIRS[case]
    x = torch.randn(4, requires_grad=case == "checkpoint body")
    backend = pb.make_backend(pb.CompilationConfig(compile_pieces="inductor", splitting_ops=[]))
    with torch.enable_grad() if case == "checkpoint body" else torch.no_grad():
        torch.testing.assert_close(torch.compile(first, backend=backend)(x), first(x))
        with pb.expect(compiles=1, compile_cache_hits=0):
            torch.testing.assert_close(torch.compile(second, backend=backend)(x), second(x))


@pytest.mark.parametrize("state", ["grad", "autocast", "default dtype"])
def test_compile_time_state_is_part_of_in_process_sharing(fake_inductor, state):
    # Dynamo traces again when these change (its global-state guard); the backend must compile again too
    def fn(x):
        return x.sin() * 2

    backend = pb.make_backend(pb.CompilationConfig(compile_pieces="inductor", splitting_ops=[]))
    x = torch.randn(4)
    with pb.expect(compiles=1):
        torch.compile(fn, backend=backend)(x)
    changed = {"grad": torch.enable_grad(), "autocast": torch.autocast("cpu", dtype=torch.bfloat16),
               "default dtype": _default_dtype(torch.float64)}[state]
    with changed, pb.expect(compiles=1, compile_cache_hits=0):
        torch.compile(fn, backend=backend)(x)
    with pb.expect(compiles=0, compile_cache_hits=1):  # back to the first state: the first compile serves
        torch.compile(lambda x: x.sin() * 2, backend=backend)(x)


class _default_dtype:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __enter__(self):
        self.saved = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.saved)
