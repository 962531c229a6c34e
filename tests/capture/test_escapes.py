"""Escaped break outputs (issue 46 item 4): a break that keeps a tensor it made without returning it is
refused at capture, naming the break, on the simulated platform always and on CUDA with ``debug_checks``
(the CUDA double); a break that returns what later code reads, or writes into a tensor made before it,
is captured and replays eager's values."""

from __future__ import annotations

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend.capture.escapes import EscapedOutputError
from piecewise_backend.platforms import base as platforms_base
from pbtest import cuda_double

M = pb.CUDAGraphMode
SIM = pb.CompilationConfig(platform="simulated", compile_pieces="eager")


class Stashing(torch.nn.Module):
    """``square`` keeps its result on the module and returns None; the code after it reads the stash."""

    def __init__(self, returns: bool = False):
        super().__init__()
        self.returns, self.kept = returns, None

    def square(self, y: torch.Tensor) -> torch.Tensor | None:
        self.kept = y * y
        return self.kept if self.returns else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        out = pb.eager_break(self.square)(y)
        return (out if self.returns else self.kept) + 0


def run(wrapper: pb.BreakableCUDAGraphWrapper, x: torch.Tensor) -> torch.Tensor:
    with pb.set_forward_context(M.PIECEWISE, pb.BatchDescriptor(x.shape[0])):
        return wrapper(x)


X = torch.tensor([1.0, 3.0, 5.0])


def test_eager_reads_the_stash():
    assert Stashing()(X).tolist() == [4.0, 16.0, 36.0]


def test_a_break_keeping_its_result_is_refused_at_capture_naming_it():
    wrapper = pb.BreakableCUDAGraphWrapper(Stashing(), config=SIM)
    with pytest.raises(EscapedOutputError, match=r"break '.*Stashing.square' made a tensor of shape \(3,\)"):
        run(wrapper, X.clone())  # the old capture replayed NaN here, where eager gives 4/16/36
    assert wrapper.entries == {}  # nothing half-built
    wrapper.runnable.returns = True  # returning what later code reads is the fix
    assert run(wrapper, X.clone()).tolist() == [4.0, 16.0, 36.0]
    assert run(wrapper, torch.tensor([0.0, 1.0, 2.0])).tolist() == [1.0, 4.0, 9.0]  # a replay


def test_breakable_graph_refuses_an_escaped_output():
    keep: list[torch.Tensor] = []

    @pb.eager_break
    def stash(x: torch.Tensor) -> None:
        keep[:] = [x * 2]

    src, dst = torch.ones(4), torch.empty(4)
    with pytest.raises(EscapedOutputError, match="break '.*stash' .* escaped output"):
        with pb.breakable_graph(pb.BreakableGraph(platform="simulated")):
            stash(src)
            dst.copy_(keep[0])


def test_temporaries_and_writes_into_earlier_tensors_are_not_escapes():
    out = torch.empty(4)

    @pb.eager_break
    def write(x: torch.Tensor) -> None:
        tmp = x * 3  # dies in the break
        out.copy_(tmp + 1)  # out existed before: an idempotent write

    src, dst = torch.empty(4), torch.empty(4)
    g = pb.BreakableGraph(platform="simulated")
    with pb.breakable_graph(g):
        write(src)
        dst.copy_(out * 2)
    src.copy_(torch.arange(4.0))
    g.replay()
    assert dst.tolist() == [(3 * v + 1) * 2 for v in range(4)]


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: True])  # no gc.collect per capture
    with cuda_double.installed() as double:
        yield double


@pytest.mark.parametrize("debug_checks", [True, False])
def test_cuda_looks_for_escapes_with_debug_checks(fake, debug_checks):
    cuda = pb.CompilationConfig(platform="cuda", compile_pieces="eager", debug_checks=debug_checks, num_warmups=1)
    wrapper = pb.BreakableCUDAGraphWrapper(Stashing(), config=cuda)
    if debug_checks:
        with pytest.raises(EscapedOutputError, match="escaped output"):
            run(wrapper, X.clone())
        assert wrapper.entries == {}
    else:  # a per-op Python check of every capture: only when asked for on CUDA
        run(wrapper, X.clone())
        assert len(wrapper.entries) == 1
