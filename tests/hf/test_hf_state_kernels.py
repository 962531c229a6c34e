"""HF state layers with kernels of their own (kimi_linear's and bailing_hybrid's KDA, MiniMax's lightning attention, RecurrentGemma's
RG-LRU, ZAYA's CCA) served through HFEngine: tokens equal generate's, in every mode."""

from __future__ import annotations

import copy

import pytest
import torch
from pbtest.helpers import load_file, serve_requests

import piecewise_backend as pb
from piecewise_backend import state as st

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf

CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 8, 16])
#: type -> (its attention layers in the tiny model: what the KV cache holds, its state kinds per state layer)
FAMILIES = {
    "kimi_linear": (1, {0: ["conv", "recurrent"]}),
    # Ling's hybrid: Kimi delta attention too; unrouted, its rows mixed and the probe took it for ignoring positions
    "bailing_hybrid": (1, {0: ["conv", "recurrent"]}),
    "minimax": (1, {1: ["linear"]}),
    "recurrent_gemma": (1, {0: ["conv", "lru"], 1: ["conv", "lru"]}),
    "zaya": (2, {0: ["qk", "value"], 1: ["qk", "value"]}),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


def serve(model: torch.nn.Module, capture: bool = True, **engine_kwargs):
    return serve_requests(model, CONFIG, capture, **engine_kwargs)


def check(reference, prompts, outputs) -> list[int]:
    return load_file("examples/hf_generate.py").check(reference, prompts, outputs, [5, 7, 9], eos=None)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_engine_serves_the_family_like_generate_with_decode_states_inside_full_graphs(arch, monkeypatch):
    model = hf.tiny_random_model(arch)
    reference = copy.deepcopy(model)
    with monkeypatch.context() as m:  # the control: an engine that never commits (every step reads zeros) differs
        m.setattr(st.cache.StateCache, "commit", lambda self, requests: None)
        _, stateless, _, _ = serve(copy.deepcopy(reference), capture=False)
    torch._dynamo.reset()
    prompts, outputs, steps, engine = serve(model)
    assert stateless != outputs  # so the tiny model's state changes its tokens (tiny_random_model's state_gain)
    assert {s.mode for s in steps if s.uniform_decode} == {pb.CUDAGraphMode.FULL}, steps
    assert pb.CUDAGraphMode.PIECEWISE in {s.mode for s in steps if not s.uniform_decode}
    assert check(reference, prompts, outputs) == []
    attention, kinds = FAMILIES[arch]
    assert len(engine.cache.key_caches) == attention
    assert {(s.layer, s.kind) for s in engine.states.specs} == {(layer, k) for layer, ks in kinds.items() for k in ks}
    assert len(engine.backend.splits) == 1  # one Dynamo graph, split at its state and attention ops only
    assert engine.states.slots == {}


@pytest.mark.parametrize("arch", ["minimax", "recurrent_gemma"])  # RG-LRU restarts at position 0 only
def test_lazy_capture_chunked_prefill_and_preemption_keep_the_states_right(arch):
    """No capture at startup (each graph captured on first sight, its breaks run twice), prompts prefilled 4 tokens
    a step from their slot's state, and too few KV blocks: preempted requests recompute from a zeroed slot."""
    model = hf.tiny_random_model(arch)
    reference = copy.deepcopy(model)
    prompts, outputs, steps, _ = serve(model, capture=False, num_blocks=6, max_num_batched_tokens=4)
    assert any(s.preempted for s in steps), steps
    assert max(s.num_tokens for s in steps) <= 4
    assert {pb.CUDAGraphMode.FULL, pb.CUDAGraphMode.PIECEWISE} <= {s.mode for s in steps}
    assert check(reference, prompts, outputs) == []


def test_recurrent_gemma_without_attention_is_checked_against_a_full_recompute():
    """transformers 5.24's generate raises on a RecurrentGemma of recurrent layers only (its cache's get_seq_length
    needs an attention layer): the example's check then compares with greedy decoding by the model's own forward
    without a cache, and still fails a wrong engine (the control: states never committed)."""
    model = hf.tiny_random_model("recurrent_gemma", num_hidden_layers=2)
    assert model.config.layers_block_type == ["linear_attention"] * 2
    reference = copy.deepcopy(model)
    example = load_file("examples/hf_generate.py")
    with pytest.raises(ValueError, match="get_seq_length"):
        reference.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    prompts, outputs, _, engine = serve(model)
    assert len(engine.cache.key_caches) == 0
    assert example.check(reference, prompts, outputs, [5, 7, 9], eos=None) == []
    assert example.RECOMPUTED
    wrong = [out[:1] + [(t + 1) % 256 for t in out[1:]] for out in outputs]
    assert example.check(reference, prompts, wrong, [5, 7, 9], eos=None) == [0, 1, 2]
