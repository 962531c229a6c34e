"""Plain torch.compile calls capture and replay on their own (issue 45 point 1, first part; standalone_capture=True)."""

from __future__ import annotations

import copy

import torch

import piecewise_backend as pb

CFG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", standalone_capture=True)


class Loop(torch.nn.Module):
    """gpt-fast style: a KV buffer written in place each call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(16, 8))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.cache.index_copy_(0, pos, h)
        return h + self.cache.sum(0)


def test_a_plain_compiled_loop_replays_graphs_equal_to_eager_step_by_step():
    model, ref = Loop().eval(), Loop().eval()
    compiled = torch.compile(model, backend=pb.make_backend(CFG))
    outs = []
    with torch.no_grad(), pb.expect(captures=1):
        for i in range(5):
            x, pos = torch.randn(1, 8), torch.tensor([i])
            outs.append(compiled(x, pos))
            torch.testing.assert_close(outs[-1], ref(x, pos))
            torch.testing.assert_close(model.cache, ref.cache)  # the in-place write landed where the caller sees it
    assert not torch.equal(outs[2], outs[3])  # a held output does not change under the next replay


def test_standalone_capture_off_by_config_and_the_backend_survives_deepcopy():
    model = Loop().eval()
    compiled = torch.compile(model, backend=pb.make_backend(CFG.replace(standalone_capture=False)))
    with torch.no_grad(), pb.expect(captures=0):
        for i in range(3):
            compiled(torch.randn(1, 8), torch.tensor([i]))
    backend = pb.make_backend(CFG)
    copied = copy.deepcopy(backend)
    assert copied is not backend and copied.config == backend.config and copied.splits == []


def _calls(compiled, inputs, n: int = 4):
    with torch.no_grad():
        return [compiled(*inputs) for _ in range(n)]


def test_a_host_read_in_a_splitting_op_falls_back_to_breakable_and_one_outside_to_eager(caplog):
    """FULL refuses the op's host read, the breakable capture runs it between segments (replays equal
    eager); the same op not registered as a splitting op makes both fail: eager, said once with the reason."""
    from pbtest.helpers import HostReading, saved_splitting_ops

    ids = torch.tensor([1, 5, 7])
    with saved_splitting_ops():
        pb.register_splitting_op("pb_test::host_scale")
        model = HostReading().eval()
        backend = pb.make_backend(CFG)
        compiled = torch.compile(model, backend=backend)
        with pb.expect(captures=1), torch.no_grad():
            outs = _calls(compiled, (ids,))
        (graph,) = backend.standalone
        assert graph.captured() == {pb.CUDAGraphMode.PIECEWISE: 1}
        for out in outs:
            torch.testing.assert_close(out, model(ids))
    with saved_splitting_ops():  # the op is no splitting op now: neither capture can leave its host read out
        outside = HostReading().eval()
        torch._dynamo.reset()
        compiled = torch.compile(outside, backend=pb.make_backend(CFG))
        with caplog.at_level("WARNING", logger="piecewise_backend"), pb.expect(captures=0, replays=0):
            outs = _calls(compiled, (ids,), 5)
    said = [r.getMessage() for r in caplog.records if "capturing failed" in r.getMessage()]
    assert len(said) == 1 and "FULL:" in said[0] and "PIECEWISE:" in said[0], said
    for out in outs:
        torch.testing.assert_close(out, outside(ids))


def test_a_static_input_that_moves_is_a_new_signature_never_read_stale():
    """The KV buffer replaced by another (same shape): captured anew, the new buffer is written."""
    model, ref = Loop().eval(), Loop().eval()
    compiled = torch.compile(model, backend=pb.make_backend(CFG))
    x = torch.randn(1, 8)
    with torch.no_grad():
        for i in range(3):
            compiled(x, torch.tensor([i]))
            ref(x, torch.tensor([i]))
        model.cache = torch.zeros(16, 8)
        ref.cache = torch.zeros(16, 8)
        torch._dynamo.mark_static_address(model.cache)
        with pb.expect(captures=1):
            for i in range(3):
                torch.testing.assert_close(compiled(x, torch.tensor([i])), ref(x, torch.tensor([i])))
        torch.testing.assert_close(model.cache, ref.cache)


def test_unsafe_calls_run_eagerly_and_say_why(caplog):
    """Inputs requiring grad under grad mode; dropout in training mode; platform 'auto' on a CPU (with
    Inductor pieces: eager pieces there run on the simulator)."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    compiled = torch.compile(lambda t: lin(t) * 2, backend=pb.make_backend(CFG))
    with caplog.at_level("WARNING", logger="piecewise_backend"), pb.expect(captures=0):
        for _ in range(3):
            compiled(x).sum().backward()  # autograd still works: eager
        drop = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).train()
        dropped = torch.compile(drop, backend=pb.make_backend(CFG))
        with torch.no_grad():
            _calls(dropped, (torch.randn(2, 4),), 3)
        if not torch.cuda.is_available():
            auto = torch.compile(torch.nn.Linear(4, 4), backend=pb.make_backend(pb.CompilationConfig()))  # Inductor pieces
            with torch.no_grad():
                _calls(auto, (torch.randn(2, 4),), 3)
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "inputs require grad under grad mode" in said and "draws random numbers (dropout)" in said, said
    assert torch.cuda.is_available() or "no CUDA device and platform='auto'" in said, said
    assert lin.weight.grad is not None


def test_a_new_signature_every_call_is_said_once_naming_the_input_and_stays_bounded(caplog):
    """A Python int that changes every call (a dynamic size): said once, what changed named; the
    signatures kept are bounded."""
    from piecewise_backend.backend.standalone import RUNAWAY, SIGNATURES_PER_GRAPH

    cfg = CFG.replace(standalone_max_graphs=2)
    backend = pb.make_backend(cfg)
    compiled = torch.compile(lambda t: t * 2 + 1, backend=backend, dynamic=True)
    with caplog.at_level("WARNING", logger="piecewise_backend"), torch.no_grad(), pb.expect(captures=0):
        for n in range(2, 21):  # from 2: Dynamo specializes a size of 1
            torch.testing.assert_close(compiled(torch.ones(n)), torch.ones(n) * 3)
    said = [r.getMessage() for r in caplog.records if "new input signature" in r.getMessage()]
    assert len(said) == 1 and f"({RUNAWAY} so far, none seen twice)" in said[0] and "went from" in said[0], said
    (graph,) = backend.standalone
    assert len(graph.signatures) == SIGNATURES_PER_GRAPH * 2


def test_dynamos_last_compile_of_a_frame_is_said(caplog):
    """Past torch._dynamo.config.recompile_limit calls run uncompiled: the backend says so at the last compile."""

    def f(t, k):
        return t * k

    compiled = torch.compile(f, backend=pb.make_backend(CFG))
    with caplog.at_level("WARNING", logger="piecewise_backend"), torch._dynamo.config.patch(
            automatic_dynamic_shapes=False, recompile_limit=3):
        for k in range(1, 6):
            assert torch.equal(compiled(torch.ones(2), k), torch.ones(2) * k)
    said = [r.getMessage() for r in caplog.records if "recompile_limit=3" in r.getMessage()]
    assert len(said) == 1 and "run uncompiled, without CUDA graphs" in said[0], said


def test_a_second_thread_runs_eagerly_while_one_replays_never_raises():
    """Two threads call one compiled loop; each call equals eager (the one holding the graph replays, the
    other runs the graph eagerly), none raises."""
    import threading

    lin = torch.nn.Linear(8, 8).eval()
    compiled = torch.compile(lambda t: lin(t).relu() * 2, backend=pb.make_backend(CFG))
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = lin(x).relu() * 2
        errors: list[BaseException] = []

        def work():
            try:
                with torch.no_grad():
                    for _ in range(20):
                        torch.testing.assert_close(compiled(x), expected)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(2)]
        replays = pb.counters["replays"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert pb.counters["replays"] > replays
