"""Positional embeddings swapped to the step's position_ids (hf/position_swaps.py): the decoders of bart's
family, marian's sinusoids and trocr's fairseq table served like ``generate`` in PIECEWISE and FULL steps;
without the swap the tokens change; the swap undone where adapt refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from pbtest.helpers import load_file

import piecewise_backend as pb
from piecewise_backend import hf
from piecewise_backend.hf import position_swaps

pytest.importorskip("transformers")

CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 8])
#: (type, config fields): a learned table with bart's offset of 2, fixed sinusoids, trocr's fairseq
#: sinusoids (its attention swapped too), and bigbird_pegasus (causal through its own mask, is_causal=False)
VARIANTS = {
    "bart": ("bart", {}),
    "marian": ("marian", {}),
    "trocr-sinusoidal": ("trocr", {"use_learned_position_embeddings": False}),
    "bigbird_pegasus": ("bigbird_pegasus", {}),
}


def tiny(arch: str, **fields: object) -> torch.nn.Module:
    """A tiny model whose positions move its tokens: learned tables are initialized at std 0.02, too small
    to matter next to the token embeddings, so they are scaled up (sinusoids are already of size 1)."""
    model = hf.tiny_random_model(arch, **fields)
    with torch.no_grad():
        for m in position_swaps.swappable(model):
            if isinstance(m, torch.nn.Embedding) and m.weight.requires_grad:
                m.weight.mul_(50.0)
    return model


def serve(model: torch.nn.Module) -> tuple[list[list[int]], list[int], list[list[int]], list[hf.StepInfo]]:
    engine = hf.HFEngine(model, CONFIG, max_num_reqs=2, max_model_len=32, block_size=4)
    engine.capture()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (6, 3, 11)]
    budgets = [8, 10, 6]  # request 2 joins while 0 and 1 decode, its prompt prefilled in two chunks (8 + 3)
    steps: list[hf.StepInfo] = []
    outputs = engine.generate(prompts, budgets, on_step=steps.append)
    return prompts, budgets, outputs, steps


def check(reference: torch.nn.Module, prompts: list[list[int]], outputs: list[list[int]], budgets: list[int]) -> list[int]:
    return load_file("examples/hf_generate.py").check(reference, prompts, outputs, budgets, eos=None)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_swapped_positions_serve_like_generate(variant):
    arch, fields = VARIANTS[variant]
    model = tiny(arch, **fields)
    reference = copy.deepcopy(model)
    prompts, budgets, outputs, steps = serve(model)
    assert {s.mode for s in steps} >= {pb.CUDAGraphMode.PIECEWISE, pb.CUDAGraphMode.FULL}, steps
    assert check(reference, prompts, outputs, budgets) == []
    assert position_swaps.swappable(model) and all("forward" in m.__dict__ for m in position_swaps.swappable(model))


def test_without_the_swap_the_tokens_change_and_adapt_refuses(monkeypatch):
    """The control: the decoder's own positions (an arange over the tokens-first row) change the tokens."""
    model = tiny("bart")
    reference = copy.deepcopy(model)
    monkeypatch.setattr(position_swaps, "SWAPS", {})
    with pytest.raises(ValueError, match=r"BartForCausalLM ignores position_ids"):
        hf.adapt(copy.deepcopy(model))
    monkeypatch.setattr(hf.paged_attention, "layout_refusal", lambda name, result, **kw: None)  # served anyway: wrongly
    prompts, budgets, outputs, _ = serve(model)
    assert check(reference, prompts, outputs, budgets) != []


@pytest.mark.parametrize("arch, fields", [("marian", {}), ("trocr", {"use_learned_position_embeddings": False})])
def test_a_refused_model_gets_its_own_positions_back(monkeypatch, arch, fields):
    model = hf.tiny_random_model(arch, **fields)
    name = type(model).__name__
    ids = torch.arange(3, 10)[None]
    with torch.no_grad():
        before = model(ids).logits
    monkeypatch.setattr(hf.paged_attention, "layout_refusal", lambda name, result, **kw: f"{name}: refused for the test")
    with pytest.raises(ValueError, match=f"{name}: refused for the test"):
        hf.adapt(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(not {"forward", position_swaps.POSITIONS_ATTR} & m.__dict__.keys()
               and not hasattr(m, position_swaps.TABLE_BUFFER) for m in position_swaps.swappable(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)

