"""Attention modules outside transformers' AttentionInterface (hf/attention_swaps.py): falcon, bloom, mpt,
gpt_neox_japanese, xglm and openai-gpt served (trocr and mvp in test_position_swaps.py) on the paged op like ``generate``, ALiBi included; the swap
undone where adapt refuses; the others refused naming why."""

from __future__ import annotations

import copy

import pytest
import torch
from pbtest.helpers import load_file

import piecewise_backend as pb
from piecewise_backend import hf
from piecewise_backend.hf import attention_swaps

pytest.importorskip("transformers")

CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 8])
#: (type, config fields, KV heads the cache must hold, ALiBi)
VARIANTS = {
    "bloom": ("bloom", {}, 4, True),
    "mpt": ("mpt", {}, 4, True),
    "falcon-rotary-multi-query": ("falcon", {}, 1, False),  # the default config: falcon-7b's layout
    "falcon-alibi": ("falcon", {"alibi": True, "multi_query": False}, 4, True),  # falcon-rw
    "falcon-new-decoder": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}, 2, False),  # falcon-40b/180b
    "gpt_neox_japanese": ("gpt_neox_japanese", {}, 4, False),
    "xglm": ("xglm", {}, 4, False),
    "openai-gpt": ("openai-gpt", {}, 4, False),
}
#: Its Conv1D projections ignore initializer_range (std 0.02): scaled up, so attention moves the tokens.
GAIN = {"openai-gpt": 8.0}


def serve(model: torch.nn.Module) -> tuple[hf.HFEngine, list[list[int]], list[int], list[list[int]], list[hf.StepInfo]]:
    engine = hf.HFEngine(model, CONFIG, max_num_reqs=2, max_model_len=32, block_size=4)
    engine.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 3, 11)]
    budgets = [8, 10, 6]  # request 2 joins while 0 and 1 decode, its prompt prefilled in two chunks (8 + 3)
    steps: list[hf.StepInfo] = []
    with pb.expect(captures=0):
        outputs = engine.generate(prompts, budgets, on_step=steps.append)
    return engine, prompts, budgets, outputs, steps


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_swapped_attention_serves_like_generate(variant):
    arch, fields, kv_heads, alibi = VARIANTS[variant]
    model = hf.tiny_random_model(arch, **fields)
    with torch.no_grad():
        for m in attention_swaps.swappable(model):
            for p in m.parameters():
                p.mul_(GAIN.get(variant, 1.0))
    reference = copy.deepcopy(model)
    engine, prompts, budgets, outputs, steps = serve(model)
    assert engine.cache.key_caches[0].shape[2] == kv_heads  # grouped K/V as the projections give them
    assert {s.mode for s in steps} >= {pb.CUDAGraphMode.PIECEWISE, pb.CUDAGraphMode.FULL}, steps
    assert load_file("examples/hf_generate.py").check(reference, prompts, outputs, budgets, eos=None) == []
    swapped = attention_swaps.swappable(model)
    assert len(swapped) == 2 and all(hasattr(m, attention_swaps.SLOPES_BUFFER) == alibi for m in swapped)
    if alibi:  # the bias matters in this tiny model: without it the engine's tokens change
        for m in swapped:
            getattr(m, attention_swaps.SLOPES_BUFFER).zero_()
        assert engine.generate(prompts, budgets) != outputs


def test_alibi_slopes_are_the_familys_own():
    """Read from each family's bias function, scaled as it scales the bias (falcon by 1/sqrt(head_dim))."""
    bloom = attention_swaps.swappable(hf.tiny_random_model("bloom"))[0]
    assert attention_swaps.bloom_slopes(bloom).tolist() == [0.25, 0.0625, 0.015625, 0.00390625]
    mpt = attention_swaps.swappable(hf.tiny_random_model("mpt"))[0]
    assert attention_swaps.mpt_slopes(mpt).tolist() == [0.25, 0.0625, 0.015625, 0.00390625]
    falcon = attention_swaps.swappable(hf.tiny_random_model("falcon", alibi=True))[0]
    assert attention_swaps.falcon_slopes(falcon).tolist() == [s / 4 for s in (0.25, 0.0625, 0.015625, 0.00390625)]
    assert attention_swaps.falcon_slopes(attention_swaps.swappable(hf.tiny_random_model("falcon"))[0]) is None


def test_a_refused_swapped_model_gets_its_own_attention_back(monkeypatch):
    """adapt swaps before its probe; a refusal after it leaves the model as it was."""
    model = hf.tiny_random_model("bloom")
    ids = torch.arange(3, 10)[None]
    with torch.no_grad():
        before = model(ids).logits
    monkeypatch.setattr(hf.paged_attention, "layout_refusal", lambda name, result, **kw: f"{name}: refused for the test")
    with pytest.raises(ValueError, match="BloomForCausalLM: refused for the test"):
        hf.adapt(model)
    assert all("forward" not in m.__dict__ and not hasattr(m, attention_swaps.SLOPES_BUFFER)
               for m in attention_swaps.swappable(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("arch, why", [
    # trocr's attention is swapped and its positions too (test_position_swaps.py): here without its swap
    ("trocr", r"ignores position_ids \(its positions come from the sequence length\)"),
    ("xlm", r"its attention is also non-causal"),  # its default config is a masked LM (causal=False)
    ("rwkv", r"keeps recurrent state between tokens in its own code \(RwkvSelfAttention\)"),
])
def test_attention_outside_the_interface_without_a_swap_is_refused_naming_why(arch, why, monkeypatch):
    if arch == "trocr":
        monkeypatch.delitem(attention_swaps.SWAPS, "transformers.models.trocr.modeling_trocr.TrOCRAttention")
    with pytest.raises(ValueError, match="does not route attention through transformers' AttentionInterface.*" + why):
        hf.adapt(hf.tiny_random_model(arch))
