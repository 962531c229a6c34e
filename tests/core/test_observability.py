"""What a user can see: TORCH_LOGS for the package logger, TORCH_TRACE artifacts, public counters."""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from pbtest.helpers import SIM, make_model, run, token_ids

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import torch
    print("imported torch", flush=True)
    import logging
    import piecewise_backend as pb
    from piecewise_backend.toy_llama import make_model

    print("level", logging.getLogger("piecewise_backend").getEffectiveLevel())
    model = make_model()
    compiled = torch.compile(model, backend=pb.make_backend(pb.CompilationConfig(compile_pieces="eager")))
    with torch.no_grad():
        ids = torch.randint(0, 128, (8,))
        torch.testing.assert_close(compiled(ids), model(ids))
    print("graphs", pb.counters["graphs"])
    """
)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One subprocess compiling the toy model with TORCH_LOGS=+piecewise_backend and TORCH_TRACE set."""
    trace_dir = tmp_path_factory.mktemp("trace")
    env = dict(os.environ, TORCH_LOGS="+piecewise_backend", TORCH_TRACE=str(trace_dir))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    return proc, trace_dir


def test_torch_logs_accepts_package_name(logged_run):
    # torch 2.13 accepts a module qualified name in TORCH_LOGS (an unknown artifact name would
    # make `import torch` itself fail): importing torch alone must survive the setting.
    proc, _ = logged_run
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "imported torch"
    assert f"level {logging.DEBUG}" in proc.stdout.splitlines()
    assert "graphs 1" in proc.stdout.splitlines()


def test_torch_logs_shows_debug_messages(logged_run):
    proc, _ = logged_run
    assert "split into 5 pieces: submod_0:compiled, submod_1:split, submod_2:compiled" in proc.stderr
    # unconfigured registry ops that did not appear are logged at DEBUG only
    assert "splitting op 'pb_toy::attention_fresh' did not appear in graph 0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_torch_trace_holds_split_artifacts(logged_run):
    proc, trace_dir = logged_run
    assert proc.returncode == 0, proc.stderr
    logs = list(trace_dir.iterdir())
    assert logs, "TORCH_TRACE wrote no file"
    text = "".join(f.read_text() for f in logs)
    assert '"name": "piecewise_split_graph_0"' in text
    for i in range(5):
        assert f'"name": "piecewise_graph_0_submod_{i}"' in text
    assert "torch.ops.pb_toy.attention" in text  # the splitting pieces' code is the payload


def test_package_logger_is_quiet_by_default():
    # A fresh process without TORCH_LOGS, so the answer does not depend on this run's environment.
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_TRACE")}
    code = "import logging, piecewise_backend; print(logging.getLogger('piecewise_backend').isEnabledFor(logging.DEBUG))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# --- counters -------------------------------------------------------------------------------


def test_counters_are_public():
    for key in ("graphs", "pieces", "splitting_pieces", "compiled_pieces", "compiles", "captures", "replays",
                "breaks", "eager_NONE", "eager_PIECEWISE", "eager_FULL"):
        assert key in pb.COUNTER_KEYS
    assert isinstance(pb.counters, collections.Counter)
    pb.counters["replays"] += 3
    pb.reset_counters()
    assert pb.counters["replays"] == 0 and not pb.counters


def test_expect_rejects_unknown_counter_names():
    with pytest.raises(ValueError, match=r"unknown counter\(s\) \['replay'\]; valid: graphs, pieces"):
        with pb.expect(replay=1):
            pass


def test_expect_reports_every_wrong_counter():
    with pytest.raises(AssertionError) as exc:
        with pb.expect(graphs=1, captures=0, replays=2):
            pb.counters["graphs"] += 1
            pb.counters["captures"] += 1
    msg = str(exc.value)
    assert "captures: changed by 1, expected 0" in msg
    assert "replays: changed by 0, expected 2" in msg
    assert "graphs" not in msg


@pytest.fixture(scope="module")
def toy():
    model = make_model(num_layers=2)
    backend = pb.make_backend(SIM)
    return model, torch.compile(model, backend=backend)


def test_compile_counters(toy):
    model, compiled = toy
    ids = token_ids(8)
    with torch.no_grad():
        with pb.expect(graphs=1, pieces=5, splitting_pieces=2, compiled_pieces=3, compiles=0, captures=0, replays=0):
            out = compiled(ids)
        assert_close(out, model(ids))
        with pb.expect(graphs=0, pieces=0, compiled_pieces=0):  # cached: the backend is not called again
            compiled(token_ids(8, seed=1))


def test_capture_and_replay_counters(toy):
    model, compiled = toy
    wrapper = pb.BreakableCUDAGraphWrapper(compiled, config=SIM)
    desc = pb.BatchDescriptor(8)
    static = token_ids(8)
    with torch.no_grad():
        with pb.expect(captures=1, replays=1, breaks=2, eager_NONE=0):
            run(wrapper, pb.CUDAGraphMode.PIECEWISE, desc, static)
        static.copy_(token_ids(8, seed=5))
        with pb.expect(captures=0, replays=1, breaks=0):
            out = run(wrapper, pb.CUDAGraphMode.PIECEWISE, desc, static)
        assert_close(out, model(static))
        with pb.expect(captures=1, replays=1, breaks=2):  # a new descriptor is a new capture
            run(wrapper, pb.CUDAGraphMode.PIECEWISE, pb.BatchDescriptor(8, num_reqs=2), static)
    assert len(wrapper.entries) == 2


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_eager_fallback_counters():
    x = torch.arange(4.0)
    full = pb.CUDAGraphWrapper(_double, pb.CUDAGraphMode.FULL, config=SIM)
    piecewise = pb.BreakableCUDAGraphWrapper(_double, pb.CUDAGraphMode.PIECEWISE, config=SIM)
    desc = pb.BatchDescriptor(4)
    with pb.expect(eager_NONE=2, captures=0, replays=0):
        assert_close(full(x), x * 2)  # no forward context
        assert_close(run(piecewise, pb.CUDAGraphMode.NONE, desc, x), x * 2)
    with pb.expect(eager_PIECEWISE=1, eager_NONE=0, captures=0):
        assert_close(run(full, pb.CUDAGraphMode.PIECEWISE, desc, x), x * 2)
    with pb.expect(eager_FULL=1, eager_NONE=0, captures=0):
        assert_close(run(piecewise, pb.CUDAGraphMode.FULL, desc, x), x * 2)
    assert not full.entries and not piecewise.entries
    with pb.expect(captures=1, replays=1, eager_FULL=0):  # the matching mode does capture
        assert_close(run(full, pb.CUDAGraphMode.FULL, desc, x), x * 2)
