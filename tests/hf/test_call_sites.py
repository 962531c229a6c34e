"""Attention modules called more than once per forward: a KV cache slot per call site (hf/call_sites.py).

diffllama calls the interface twice per layer (its two value halves), dory runs its recurrent section twice,
hrm_text runs two stacks whose layers share indices in H/L cycles, zamba2 calls one shared attention block at
several depths: each call keeps its own K/V history.
"""

from __future__ import annotations

import pytest
import torch
from pbtest.helpers import load_file

import piecewise_backend as pb

pytest.importorskip("transformers")
from piecewise_backend import hf
from piecewise_backend.hf.call_sites import CallSites

CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 8])
BUDGETS = [5, 7, 4]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every engine compiles TokensFirst.forward: reset so no test runs past Dynamo's recompile limit."""
    torch._dynamo.reset()


def serve(model: torch.nn.Module, capture: bool = True, **kwargs) -> tuple[list[list[int]], list[list[int]], list, hf.HFEngine]:
    """Three requests that join and finish at different steps; prompts past dory's sliding window of 8."""
    engine = hf.HFEngine(model, CONFIG, max_num_reqs=3, max_model_len=32, block_size=4, **kwargs)
    if capture:
        engine.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 3)]
    steps: list[hf.StepInfo] = []
    outputs = engine.generate(prompts, BUDGETS, on_step=steps.append)
    return prompts, outputs, steps, engine


def check(reference: torch.nn.Module, prompts: list[list[int]], outputs: list[list[int]]) -> list[int]:
    return load_file("examples/hf_generate.py").check(reference, prompts, outputs, BUDGETS, eos=None)


# type -> attention call sites per forward of its tiny model (the KV cache holds one slot per call site)
SITES = {
    "diffllama": 4,  # 2 layers, 2 calls each
    "dory": 6,  # 1 input + 2 recurrent layers run twice + 1 output
    "hrm_text": 16,  # 2 layers per stack, H_cycles 2 x (L_cycles 3 + 1) stack runs
    "zamba2": 2,  # one shared attention block, called by each of the 2 hybrid layers
}


@pytest.mark.parametrize("arch", sorted(SITES))
def test_engine_serves_each_call_site_like_generate(arch):
    model = hf.tiny_random_model(arch)
    reference = hf.tiny_random_model(arch)
    prompts, outputs, steps, engine = serve(model)
    assert {s.mode for s in steps if s.uniform_decode} == {pb.CUDAGraphMode.FULL}, steps
    assert pb.CUDAGraphMode.PIECEWISE in {s.mode for s in steps if not s.uniform_decode}
    assert len(engine.cache.key_caches) == SITES[arch]
    assert check(reference, prompts, outputs) == []


def test_one_kv_per_module_would_change_the_tokens(monkeypatch):
    """The control: every call of a module sharing the slot of its first call (one K/V per module, as a
    per-layer cache would hold) would serve other tokens; the engine's first step now refuses it, naming the
    cache layers no attention reached (dory's and hrm_text's random loops stay too close to each other for a
    shared K/V to change more than a near-tie)."""
    next_site = CallSites.next

    def first_of_module(self, module):
        next_site(self, module)
        return next(i for i, m in enumerate(self.modules) if m is module)

    monkeypatch.setattr(CallSites, "next", first_of_module)
    model = hf.tiny_random_model("diffllama")
    with pytest.raises(ValueError, match=r"never read or wrote KV cache layers \[1, 3\] of its KVLayout\(num_layers=4\)"):
        serve(model)


def test_call_sites_with_chunked_prefill_preemption_and_lazy_capture():
    """Prompts prefilled 4 tokens a step, too few blocks for all requests (preempted, recomputed), graphs
    captured on first sight mid-serving: each call site's K/V stays its own."""
    model = hf.tiny_random_model("diffllama")
    reference = hf.tiny_random_model("diffllama")
    prompts, outputs, steps, _ = serve(model, capture=False, num_blocks=5, max_num_batched_tokens=4, lazy_capture=True)
    assert any(s.preempted for s in steps), steps
    assert max(s.num_tokens for s in steps) <= 4
    assert check(reference, prompts, outputs) == []


def test_call_sites_follow_the_probes_order_and_refuse_another():
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    sites = CallSites([a, b, a])
    sites.start()
    assert [sites.next(a), sites.next(b), sites.next(a)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="attention call 3 of this forward comes from Linear, but the probe saw no further call"):
        sites.next(a)
    sites.start()
    with pytest.raises(RuntimeError, match="attention call 0 .* an order that depends on its input"):
        sites.next(b)
    with pytest.raises(ValueError, match="at least one call"):
        CallSites([])


def test_call_sites_are_needed_only_where_a_layer_index_does_not_name_one_kv_history():
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    assert not CallSites.needed([(a, 0), (b, 1)])  # one call per layer: the per-layer cache
    assert CallSites.needed([(a, 0), (a, 0)])  # diffllama, dory: a module called twice
    assert CallSites.needed([(a, None), (b, 1)])  # zamba: a shared block without a layer index
    assert CallSites.needed([(a, -1), (b, 1)])  # zamba2's shared block
    assert CallSites.needed([(a, 0), (b, 0)])  # hrm_text: two stacks reuse layer indices


def test_a_probe_keys_the_layers_by_call_site_and_adapt_points_each_module_at_them():
    model = hf.tiny_random_model("diffllama")
    result = hf.probe(model)
    assert result.call_sites and len(result.layers) == len(result.sites) == 4
    assert [l.layer for l in result.sites] == [0, 0, 1, 1]
    adapted = hf.adapt(model)
    assert len(adapted.call_sites) == 4 and adapted.kv_shape[0] == 4
    assert all(layer.self_attn.pb_adapted.call_sites is adapted.call_sites for layer in model.model.layers)
    plain = hf.probe(hf.tiny_random_model("llama"))
    assert not plain.call_sites and plain.call_site_modules() is None and sorted(plain.layers) == [0, 1]


def test_dory_in_last_loop_mode_is_refused():
    """Its earlier loops would attend over the last loop's cache: not a K/V of their own call site."""
    with pytest.raises(ValueError, match=r"recurrent_kv_cache_mode='last_loop'.*one K/V per attention call site"):
        hf.adapt(hf.tiny_random_model("dory", recurrent_kv_cache_mode="last_loop"))


def test_inkling_is_refused_naming_what_its_layers_add():
    with pytest.raises(ValueError, match=r"\['hybrid_sliding'\] \(layer_types\): .*relative-position bias.*no per-score bias"):
        hf.adapt(hf.tiny_random_model("inkling_text"))


def test_micro_batched_decode_steps_keep_each_call_sites_slots():
    """use_ubatching runs pure-decode steps as two halves: the slots are constants of the traced graph, so the
    halves (which hand over at each attention op) never share the call-site counter."""
    model = hf.tiny_random_model("diffllama")
    reference = hf.tiny_random_model("diffllama")
    config = CONFIG.replace(use_ubatching=True, dbo_decode_token_threshold=2)
    engine = hf.HFEngine(model, config, max_num_reqs=3, max_model_len=32, block_size=4)
    engine.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 3)]
    split: list[bool] = []
    outputs = engine.generate(prompts, BUDGETS, on_step=lambda s: split.append(engine.runner.last_ubatched))
    assert sum(split) >= 2, split
    assert check(reference, prompts, outputs) == []
