"""wrap_model stacks and validate_capture_coverage (design.md 4.5), on the simulated platform."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from pbtest.helpers import SIM, TwoBreakModel, make_model, run, segment_kinds, token_ids, torch_threads

M = pb.CUDAGraphMode
BD = pb.BatchDescriptor
FULL_MODES = (M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE)
SIZES = [1, 2, 4, 8]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def cfg(mode, **kw) -> pb.CompilationConfig:
    return SIM.replace(cudagraph_mode=mode, capture_sizes=SIZES, **kw)


def keys_for(mode, config=None) -> pb.CudagraphDispatcher:
    d = pb.CudagraphDispatcher(config or cfg(mode))
    d.initialize_keys(mode)
    return d


def stack(obj) -> list[tuple[str, M | None]]:
    """[(wrapper class name, runtime_mode), ...] from the outside in, ending at the innermost object."""
    out = []
    while isinstance(obj, (pb.CUDAGraphWrapper, pb.BreakableCUDAGraphWrapper)):
        out.append((type(obj).__name__, obj.runtime_mode))
        obj = obj.runnable
    return out


# ---------------------------------------------------------------- wrap_model stacks

EXPECTED_STACKS = {
    M.NONE: [],
    M.PIECEWISE: [("BreakableCUDAGraphWrapper", M.PIECEWISE)],
    M.FULL: [("CUDAGraphWrapper", M.FULL), ("BreakableCUDAGraphWrapper", M.PIECEWISE)],
    M.FULL_DECODE_ONLY: [("CUDAGraphWrapper", M.FULL), ("BreakableCUDAGraphWrapper", M.PIECEWISE)],
    M.FULL_AND_PIECEWISE: [("CUDAGraphWrapper", M.FULL), ("BreakableCUDAGraphWrapper", M.PIECEWISE)],
}

EXPECTED_DRAFTER_STACKS = {
    M.NONE: [],
    M.PIECEWISE: [("BreakableCUDAGraphWrapper", M.PIECEWISE)],
    M.FULL: [("BreakableCUDAGraphWrapper", M.PIECEWISE)],
    M.FULL_DECODE_ONLY: [("BreakableCUDAGraphWrapper", M.PIECEWISE)],
    M.FULL_AND_PIECEWISE: [("BreakableCUDAGraphWrapper", M.PIECEWISE)],
}

EXPECTED_NO_BREAKABLE_STACKS = {
    M.NONE: [],
    M.PIECEWISE: [],
    M.FULL: [("CUDAGraphWrapper", M.FULL)],
    M.FULL_DECODE_ONLY: [("CUDAGraphWrapper", M.FULL)],
    M.FULL_AND_PIECEWISE: [("CUDAGraphWrapper", M.FULL)],
}


@pytest.mark.parametrize("mode", list(M), ids=lambda m: m.name)
def test_wrap_model_stack(mode):
    model = TwoBreakModel()
    wrapped = pb.wrap_model(model, cfg(mode))
    assert stack(wrapped) == EXPECTED_STACKS[mode]
    if mode == M.NONE:
        assert wrapped is model
    else:
        assert wrapped.unwrap() is model
        assert pb.unwrap_model(wrapped) is model
        assert all(w.config.platform == "simulated" for w in _wrappers(wrapped))


@pytest.mark.parametrize("mode", list(M), ids=lambda m: m.name)
def test_wrap_model_drafter_never_has_full_wrapper(mode):
    model = TwoBreakModel()
    wrapped = pb.wrap_model(model, cfg(mode), drafter=True)
    assert stack(wrapped) == EXPECTED_DRAFTER_STACKS[mode]
    assert pb.unwrap_model(wrapped) is model


@pytest.mark.parametrize("mode", list(M), ids=lambda m: m.name)
def test_wrap_model_without_breakable(mode):
    model = TwoBreakModel()
    wrapped = pb.wrap_model(model, cfg(mode, use_breakable=False))
    assert stack(wrapped) == EXPECTED_NO_BREAKABLE_STACKS[mode]
    assert pb.unwrap_model(wrapped) is model
    if not EXPECTED_NO_BREAKABLE_STACKS[mode]:
        assert wrapped is model


@pytest.mark.skipif(torch.cuda.is_available(), reason="platform='auto' means CUDA here")
@pytest.mark.parametrize("mode", [M.PIECEWISE, M.FULL_AND_PIECEWISE, M.FULL])
def test_auto_platform_on_cpu_means_no_graphs_in_the_runner(mode):
    model = TwoBreakModel()
    config = pb.CompilationConfig(cudagraph_mode=mode, platform="auto")  # Inductor pieces: no simulator
    assert pb.effective_mode(config) is M.NONE
    runner = pb.GraphRunner(model, config, [pb.StaticInput("x", shape=(8,), dtype=torch.float32)])
    assert runner.mode is M.NONE and runner.model is model
    # wrap_model itself is structural: it stacks what the configured mode asks for
    assert isinstance(pb.wrap_model(model, config), pb.CUDAGraphWrapper if mode.has_full_cudagraphs() else pb.BreakableCUDAGraphWrapper)


@pytest.mark.skipif(torch.cuda.is_available(), reason="platform='auto' means CUDA here")
def test_auto_platform_on_cpu_with_eager_pieces_runs_the_simulator():
    model = TwoBreakModel()
    config = pb.CompilationConfig(cudagraph_mode=M.PIECEWISE, platform="auto", compile_pieces="eager", capture_sizes=[8])
    assert pb.effective_mode(config) is M.PIECEWISE
    runner = pb.GraphRunner(model, config, [pb.StaticInput("x", shape=(8,), dtype=torch.float32)])
    assert runner.mode is M.PIECEWISE and runner.downgrades == ()
    x = torch.randn(5, 8)
    with pb.expect(captures=1):
        out = runner.run(x=x)
    assert runner.last_mode is M.PIECEWISE and runner.model.captured_on.name == "simulated"
    torch.testing.assert_close(out, model(x))


def test_wrap_model_rejects_non_config():
    with pytest.raises(TypeError, match="CompilationConfig"):
        pb.wrap_model(TwoBreakModel(), {"cudagraph_mode": "FULL"})


def _wrappers(obj):
    while isinstance(obj, (pb.CUDAGraphWrapper, pb.BreakableCUDAGraphWrapper)):
        yield obj
        obj = obj.runnable


def test_full_to_full_and_piecewise_upgrade_still_has_a_capturer():
    model = TwoBreakModel()
    config = cfg(M.FULL)
    wrapped = pb.wrap_model(model, config)
    outer, inner = wrapped, wrapped.runnable
    d = pb.CudagraphDispatcher(config)
    d.initialize_keys(M.FULL)
    pb.validate_capture_coverage(wrapped, d)
    # upgrade: same wrapped model, the dispatcher now also emits PIECEWISE keys
    d.initialize_keys(M.FULL_AND_PIECEWISE)
    assert d.keys[M.PIECEWISE]
    pb.validate_capture_coverage(wrapped, d)

    x = torch.randn(3, 8)
    mode, desc = d.dispatch(3)
    assert (mode, desc) == (M.PIECEWISE, BD(4))
    xp = torch.zeros(4, 8)
    xp[:3] = x
    with torch.no_grad():
        ref = model(x)
        with pb.expect(captures=1, eager_PIECEWISE=1):
            out = run(wrapped, mode, desc, xp)
        assert_close(out[:3], ref)
        with pb.expect(captures=0, replays=1):
            out = run(wrapped, mode, desc, xp)
        assert_close(out[:3], ref)
    assert list(inner.entries) == [BD(4)] and outer.entries == {}
    assert segment_kinds(inner.entries[BD(4)]) == "G E G E G"


# ---------------------------------------------------------------- validate_capture_coverage


def test_coverage_fails_for_piecewise_key_with_only_full_wrapper():
    model = pb.CUDAGraphWrapper(TwoBreakModel(), M.FULL, config=SIM)
    for mode in (M.PIECEWISE, M.FULL_AND_PIECEWISE):
        with pytest.raises(ValueError, match=r"PIECEWISE.*BatchDescriptor\(num_tokens=8") as info:
            pb.validate_capture_coverage(model, keys_for(mode))
        assert "CUDAGraphWrapper(FULL)" in str(info.value)
    # FULL and FULL_DECODE_ONLY dispatch only FULL keys: covered
    pb.validate_capture_coverage(model, keys_for(M.FULL))
    pb.validate_capture_coverage(model, keys_for(M.FULL_DECODE_ONLY))


def test_coverage_fails_for_full_key_with_only_piecewise_wrapper():
    drafter = pb.wrap_model(TwoBreakModel(), cfg(M.FULL), drafter=True)
    with pytest.raises(ValueError, match=r"FULL.*BatchDescriptor"):
        pb.validate_capture_coverage(drafter, keys_for(M.FULL))
    pb.validate_capture_coverage(drafter, keys_for(M.PIECEWISE))


@pytest.mark.parametrize("mode", [M.PIECEWISE, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE], ids=lambda m: m.name)
def test_coverage_fails_for_bare_model(mode):
    with pytest.raises(ValueError, match="no wrappers"):
        pb.validate_capture_coverage(TwoBreakModel(), keys_for(mode))


def test_coverage_passes_for_bare_model_with_none_dispatcher():
    pb.validate_capture_coverage(TwoBreakModel(), keys_for(M.NONE))


@pytest.mark.parametrize("mode", list(M), ids=lambda m: m.name)
def test_coverage_passes_for_wrap_model(mode):
    pb.validate_capture_coverage(pb.wrap_model(TwoBreakModel(), cfg(mode)), keys_for(mode))


def test_coverage_use_breakable_false_needs_per_piece_backend():
    config = cfg(M.FULL_AND_PIECEWISE, use_breakable=False)
    model = make_model(2, "inplace")
    d = keys_for(M.FULL_AND_PIECEWISE, config)
    # an uncompiled model (or one compiled with a breakable backend) has no PIECEWISE capturer
    with pytest.raises(ValueError, match="PIECEWISE"):
        pb.validate_capture_coverage(pb.wrap_model(model, config), d)
    breakable_compiled = torch.compile(model, backend=pb.make_backend(cfg(M.FULL_AND_PIECEWISE)))
    with pytest.raises(ValueError, match="PIECEWISE"):
        pb.validate_capture_coverage(pb.wrap_model(breakable_compiled, config), d)

    compiled = torch.compile(model, backend=pb.make_backend(config))
    wrapped = pb.wrap_model(compiled, config)
    assert stack(wrapped) == [("CUDAGraphWrapper", M.FULL)]
    pb.validate_capture_coverage(wrapped, d)
    piecewise_only = pb.wrap_model(compiled, cfg(M.PIECEWISE, use_breakable=False))
    assert piecewise_only is compiled
    pb.validate_capture_coverage(piecewise_only, keys_for(M.PIECEWISE))

    # and the per-piece wrappers really capture: one entry per compiled piece (3 for 2 layers)
    ids = token_ids(8)
    with torch.no_grad():
        ref = model(ids)
        with pb.expect(captures=3, eager_PIECEWISE=1):
            out = run(wrapped, M.PIECEWISE, BD(8), ids)
        assert_close(out, ref)
        with pb.expect(captures=0, replays=3):
            out = run(wrapped, M.PIECEWISE, BD(8), ids)
        assert_close(out, ref)
        with pb.expect(captures=1, replays=1):
            out = run(wrapped, M.FULL, BD(8, 8, True), ids)
        assert_close(out, ref)


# ---------------------------------------------------------------- clear_graphs (issue 10.12)


def test_clear_graphs_reaches_per_piece_wrappers_inside_the_compiled_model():
    torch._dynamo.reset()
    config = cfg(M.PIECEWISE, use_breakable=False)
    model = make_model(2, "fresh")
    backend = pb.make_backend(config)
    compiled = torch.compile(model, backend=backend)
    static = token_ids(8)
    compiled(static)
    with pb.expect(captures=3):
        run(compiled, M.PIECEWISE, BD(8), static)
    assert len(backend.piece_wrappers) == 3 and all(w.entries for w in backend.piece_wrappers)
    pb.clear_graphs(compiled)
    assert all(w.entries == {} for w in backend.piece_wrappers)
    with pb.expect(captures=3):  # and they capture again
        assert_close(run(compiled, M.PIECEWISE, BD(8), static), model(static))
    torch._dynamo.reset()


def test_clear_graphs_clears_a_wrapper_stack():
    model = TwoBreakModel()
    w = pb.wrap_model(model, cfg(M.FULL_AND_PIECEWISE))
    x = torch.randn(8, 8)
    run(w, M.FULL, BD(8, 8, True), x)
    run(w, M.PIECEWISE, BD(8), x)
    assert w.entries and w.runnable.entries
    pb.clear_graphs(w)
    assert w.entries == {} and w.runnable.entries == {}


# ---------------------------------------------------------------- micro-batching (use_ubatching)


@pytest.mark.parametrize("mode", list(M), ids=lambda m: m.name)
def test_wrap_model_with_ubatching_installs_only_a_ubatch_wrapper(mode):
    model = TwoBreakModel()
    wrapped = pb.wrap_model(model, cfg(mode, use_ubatching=True))
    assert type(wrapped) is pb.UBatchWrapper and wrapped.runnable is model  # no breakable wrapper below it
    assert wrapped.runtime_mode == (M.FULL if mode.has_full_cudagraphs() else M.NONE)
    assert wrapped.unwrap() is model and pb.unwrap_model(wrapped) is model
    assert pb.unwrap_model(pb.CUDAGraphWrapper(wrapped, M.FULL, config=SIM)) is model  # unwrap() recurses through it
    drafter = pb.wrap_model(model, cfg(mode, use_ubatching=True), drafter=True)
    assert stack(drafter) == EXPECTED_DRAFTER_STACKS[mode]  # a drafter is never micro-batched


def test_coverage_with_ubatching():
    for mode in (M.FULL, M.FULL_DECODE_ONLY, M.NONE):
        pb.validate_capture_coverage(pb.wrap_model(TwoBreakModel(), cfg(mode, use_ubatching=True)), keys_for(mode))
    for mode in (M.PIECEWISE, M.FULL_AND_PIECEWISE):
        with pytest.raises(ValueError, match="use_ubatching.*UBatchWrapper") as info:
            pb.validate_capture_coverage(pb.wrap_model(TwoBreakModel(), cfg(mode, use_ubatching=True)), keys_for(mode))
        assert "FULL_DECODE_ONLY" in str(info.value) and "use_breakable=False" in str(info.value)


def test_clear_graphs_reaches_a_ubatch_wrapper():
    wrapped = pb.wrap_model(torch.nn.Linear(4, 4), cfg(M.FULL, use_ubatching=True))
    x = torch.randn(4, 4)
    pb.mark_persistent(x)
    with torch.no_grad(), pb.set_forward_context(M.FULL, BD(4)):
        wrapped(x)
    assert len(wrapped.entries) == 1
    pb.clear_graphs(wrapped)
    assert wrapped.entries == {} and wrapped._count() == 0
