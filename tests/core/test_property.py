"""Property: any sequence of steps through GraphRunner gives the eager model's outputs.

One runner per (mode, model kind), built and captured once per module and reused by every
hypothesis example; the compiled model is compiled once per kind and shared by its runners.
"""

from __future__ import annotations

import gc
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import piecewise_backend as pb
from pbtest.helpers import SIM, make_model, torch_threads

M = pb.CUDAGraphMode
SIZES = [1, 2, 4, 8]
MODES = [M.FULL_AND_PIECEWISE, M.FULL, M.PIECEWISE, M.FULL_DECODE_ONLY]
KINDS = ["compiled", "compile_free"]

# runtime mode a step should run under: (mode, uniform) -> mode for n <= max(SIZES); NONE above
EXPECTED_RUNTIME = {
    (M.FULL_AND_PIECEWISE, False): M.PIECEWISE,
    (M.FULL_AND_PIECEWISE, True): M.FULL,
    (M.FULL, False): M.FULL,
    (M.FULL, True): M.FULL,
    (M.PIECEWISE, False): M.PIECEWISE,
    (M.PIECEWISE, True): M.PIECEWISE,
    (M.FULL_DECODE_ONLY, False): M.NONE,
    (M.FULL_DECODE_ONLY, True): M.FULL,
}


class _Cache:
    backend: pb.PiecewiseBackend | None = None
    models: dict[str, tuple[torch.nn.Module, object]] = {}
    runners: dict[tuple[M, str], pb.GraphRunner] = {}


@pytest.fixture(scope="module")
def cache():
    c = _Cache()
    c.models, c.runners = {}, {}
    with torch_threads(1):
        yield c
    c.models.clear()
    c.runners.clear()


def get_model(cache: _Cache, kind: str):
    """(eager reference, the model handed to the runner); compiled at most once per kind."""
    if kind not in cache.models:
        if kind == "compiled":
            eager = make_model(2, "inplace")
            cache.backend = pb.make_backend(SIM)
            cache.models[kind] = (eager, torch.compile(eager, backend=cache.backend))
        else:
            eager = make_model(2, "break")
            cache.models[kind] = (eager, eager)
    return cache.models[kind]


def get_runner(cache: _Cache, mode: M, kind: str) -> pb.GraphRunner:
    key = (mode, kind)
    if key not in cache.runners:
        _, model = get_model(cache, kind)
        config = SIM.replace(cudagraph_mode=mode, capture_sizes=SIZES)
        runner = pb.GraphRunner(model, config, [pb.StaticInput("input_ids")])
        # capture() collects garbage once; with pytest, hypothesis and Dynamo loaded that alone
        # costs most of a second, eight times over. The gc contract is tested in test_runner.py.
        with torch.no_grad(), mock.patch.object(gc, "collect", lambda *a: 0):
            report = runner.capture(progress=False)
        assert report.graphs == sum(len(d) for _, d in runner.dispatcher.capture_descriptors())
        cache.runners[key] = runner
    return cache.runners[key]


steps = st.lists(st.tuples(st.integers(1, 10), st.booleans()), min_size=1, max_size=6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=steps, seed=st.integers(0, 2**16))
def test_runner_matches_eager(cache, mode, kind, steps, seed):
    runner = get_runner(cache, mode, kind)
    eager, _ = get_model(cache, kind)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, (n, uniform) in enumerate(steps):
            ids = torch.randint(0, 128, (n,), generator=g)
            before = pb.counters["captures"]
            out = runner.run(input_ids=ids, uniform_decode=uniform, num_reqs=n if uniform else None)
            expected_mode = EXPECTED_RUNTIME[(mode, uniform)] if n <= SIZES[-1] else M.NONE
            assert runner.last_mode is expected_mode, (i, n, uniform)
            assert pb.counters["captures"] == before, "every dispatched key was captured at startup"
            assert out.shape == (n, 128)
            assert_close(out, eager(ids), msg=lambda m: f"step {i} of {steps}: {m}")


def test_compiled_once_per_kind(cache):
    """Every runner of a kind shares one compiled model (built here if the property tests did not run)."""
    for mode in MODES:
        for kind in KINDS:
            get_runner(cache, mode, kind)
    for kind in KINDS:
        inner = {id(pb.unwrap_model(r.model)) for (_, k), r in cache.runners.items() if k == kind}
        assert inner == {id(cache.models[kind][1])}
    # Dynamo handed the backend a few graphs (static first call, then dynamic), not one per example
    assert 1 <= len(cache.backend.splits) <= 3, len(cache.backend.splits)
