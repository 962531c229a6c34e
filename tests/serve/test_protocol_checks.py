"""The model protocol, checked at the first steps: the output is the logits ``(T, vocab_size)`` (issue 46 items 5
and 13: wider logits, which sampled ids the engine itself refuses, a batch dimension, a tuple, token ids, a
drafter of another width are refused naming ``vocab_size=`` and what came back), and attention reads and
writes every layer of the ``KVLayout`` (item 7: a model keeping its own dense attention was served wrong)."""

from __future__ import annotations

import pytest
import torch

import piecewise_backend as pb
from pbtest.helpers import load_file
from piecewise_backend import serve

own = load_file("examples/own_model.py")
SIM = pb.CompilationConfig(cudagraph_mode="NONE", platform="simulated", compile_pieces="eager")


class Reshaped(torch.nn.Module):
    """examples/own_model.py's decoder with its logits changed by ``how``."""

    def __init__(self, how: str, seed: int = 0):
        super().__init__()
        self.inner, self.how = own.make_model(seed), how

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> object:
        logits = self.inner(input_ids, position_ids)
        if self.how == "wider":
            return torch.cat([logits, logits + 5.0], dim=-1)  # 2 x VOCAB columns: argmax lands past the vocabulary
        if self.how == "batched":
            return logits[None]
        if self.how == "tuple":
            return (logits,)
        if self.how == "ids":
            return logits.argmax(-1)
        return logits


def engine(model: torch.nn.Module, config: pb.CompilationConfig = SIM) -> serve.Engine:
    return serve.Engine(model, config, kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=2,
                        max_model_len=32, block_size=4)


@pytest.mark.parametrize("how, says", [
    ("wider", rf"tensor of shape \(3, {2 * own.VOCAB}\) .* \(T, vocab_size={own.VOCAB}\) = \(3, {own.VOCAB}\); "
              rf"vocab_size={own.VOCAB} must be the logits' width"),
    ("batched", r"shape \(1, 3, \d+\) .*drop the batch dimension"),
    ("tuple", r"returned tuple .*return the logits tensor alone"),
    ("ids", r"torch.int64 tensor of shape \(3,\) .*not token ids"),
])
def test_a_step_output_that_is_not_the_logits_is_refused_naming_vocab_size(how, says):
    with pytest.raises(ValueError, match=says):
        engine(Reshaped(how)).generate([[5, 7, 9]], 4)


def test_the_protocols_logits_pass_and_are_checked_once(monkeypatch):
    from piecewise_backend.serve import model_runner

    calls = []
    real = model_runner.check_logits
    monkeypatch.setattr(model_runner, "check_logits", lambda *a: calls.append(a) or real(*a))
    model = own.make_model()
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4], platform="simulated",
                                  compile_pieces="eager")
    e = engine(model, config)
    e.capture()
    assert e.generate([[5, 7, 9]], 6) == [own.reference(model, [5, 7, 9], 6)]
    assert len(calls) == 1  # the first step only: replays keep the protocol


def test_a_drafter_of_another_width_is_refused_naming_the_drafter():
    spec = serve.SpeculativeEngine(own.make_model(), Reshaped("wider", seed=1), SIM, num_speculative_tokens=2,
                                   target_layout=own.KV_LAYOUT, drafter_layout=own.KV_LAYOUT, vocab_size=own.VOCAB,
                                   max_num_reqs=2, max_model_len=32, block_size=4)
    with pytest.raises(ValueError, match=rf"the drafter returned .* \(T, vocab_size={own.VOCAB}\)"):
        spec.generate([[5, 7, 9]], 4)


class PartlyDense(torch.nn.Module):
    """examples/own_model.py's decoder whose layers ``dense`` keep their own dense attention (no cache)."""

    def __init__(self, dense: set[int]):
        super().__init__()
        self.inner, self.dense = own.make_model(), dense

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.inner.embed(input_ids)
        for i, block in enumerate(self.inner.blocks):
            x = block(x, position_ids, i in self.dense)
        return self.inner.head(self.inner.norm(x))


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_a_model_whose_attention_skips_cache_layers_is_refused_naming_them(mode):
    config = pb.CompilationConfig(cudagraph_mode=mode, capture_sizes=[1, 2, 4], platform="simulated",
                                  compile_pieces="eager")
    e = engine(PartlyDense({1}), config)
    if mode != "NONE":
        e.capture()  # the capture ran the model: its attention calls are known before any step
    with pytest.raises(ValueError, match=rf"never read or wrote KV cache layers \[1\] of its KVLayout\(num_layers={own.LAYERS}\)"):
        e.generate([[5, 7, 9], [3, 1, 4, 1]], 4)
    with pytest.raises(ValueError, match=r"layers \[0, 1\]"):
        engine(PartlyDense({0, 1})).generate([[5]], 2)


def test_a_first_full_replay_defers_the_layer_check_to_a_step_that_runs_attention():
    model = own.make_model()
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4], platform="simulated",
                                  compile_pieces="eager")
    e = engine(model, config)
    e.capture()
    assert e.generate([[5]], 3) == [own.reference(model, [5], 3)]  # a 1-token prompt: FULL replays only
