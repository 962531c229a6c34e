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
