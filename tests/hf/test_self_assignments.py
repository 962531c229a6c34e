"""Buffers a forward assigns back to themselves: dropped while Dynamo traces, so the model stays one graph."""

from __future__ import annotations

import copy

import pytest
import torch
from pbtest.helpers import load_file

import piecewise_backend as pb

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf  # noqa: E402
from piecewise_backend.hf.self_assignments import drop_self_assignments, recording_self_assignments, self_assigned  # noqa: E402


class Rebinds(torch.nn.Module):
    """``self.table = self.table.to(x.dtype)`` (a no-op here) and, with ``grow``, a real re-assignment."""

    def __init__(self, grow: bool = False):
        super().__init__()
        self.table = torch.nn.Buffer(torch.arange(4.0), persistent=False)  # as ctrl's: Dynamo sees an nn.Buffer
        self.count = torch.nn.Buffer(torch.zeros(()), persistent=False)
        self.grow = grow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.table = self.table.to(device=x.device, dtype=x.dtype)
        if self.grow:
            self.count = self.count + 1
        return x * self.table


def test_a_recording_tells_a_self_assignment_from_a_new_tensor():
    module = Rebinds(grow=True)
    with recording_self_assignments() as seen:
        module(torch.ones(4))
    assert [(m is module, name) for m, name in self_assigned(seen)] == [(True, "table")]  # count got a new tensor
    assert not torch.nn.modules.module._global_buffer_registration_hooks  # the hook is gone


def test_dropped_self_assignments_compile_as_one_graph_and_keep_eager_assignments():
    module = Rebinds()
    with pytest.raises(torch._dynamo.exc.Unsupported):  # Dynamo cannot trace Module.__setattr__ of an nn.Buffer
        torch.compile(module, backend="eager", fullgraph=True)(torch.ones(4))
    torch._dynamo.reset()
    drop_self_assignments([(module, "table")])
    assert type(module).__name__ == "Rebinds" and isinstance(module, Rebinds)
    out = torch.compile(module, backend="eager", fullgraph=True)(torch.ones(4))
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    module(torch.ones(4, dtype=torch.float64))  # eager: the assignment is kept
    assert module.table.dtype == torch.float64


def test_ctrl_is_one_dynamo_graph_and_served_like_generate():
    """ctrl's forward re-assigns its positional-encoding buffer: before, Dynamo cut it into 9 graphs
    (graph breaks at Module.__setattr__, recompiled), two of them without a splitting op."""
    torch._dynamo.reset()
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 8])
    model = hf.tiny_random_model("ctrl")
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, config, max_num_reqs=2, max_model_len=32, block_size=4)
    engine.capture()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    outputs = engine.generate(prompts, [3, 4])
    assert len(engine.backend.splits) == 1 and engine.backend.splits[0].graph_break is None
    assert type(model.transformer).__name__ == "CTRLModel"
    example = load_file("examples/hf_generate.py")
    assert example.check(reference, prompts, outputs, [3, 4], eos=None) == []
