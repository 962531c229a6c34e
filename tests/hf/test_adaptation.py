"""adapt() as a declared protocol (hf/adaptation.py): mechanisms in order inside one rollback, a frozen probe value,
one adapted-state record per attention module, one key scheme for every registry, the probe's state scoped."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf  # noqa: E402
from piecewise_backend.hf import adaptation, attention_swaps, patching, position_swaps, state_swaps  # noqa: E402


def _snapshot(model: torch.nn.Module) -> dict:
    """Everything an install may change: each module's class, instance attributes, buffers, hooks, mode; the
    model's attention and experts implementations."""
    modules = {
        path: (type(m), {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"},
               dict(m._buffers), list(m._forward_pre_hooks), list(m._forward_hooks), m.training)
        for path, m in model.named_modules()
    }
    return {"modules": modules, "attn": model.config._attn_implementation,
            "experts": getattr(model.config, "_experts_implementation", None)}


class _Fails:
    name = "fails"

    def refusal_of(self, model, probed):
        return None

    def install(self, model, probed):
        raise RuntimeError("a late mechanism failed")


@pytest.mark.parametrize("arch", ["bloom", "mixtral", "bart", "qwen3_next", "diffllama"])
def test_a_late_failure_undoes_every_mechanism_and_the_model_is_as_it_was(arch, monkeypatch):
    """Attention and position swaps, experts, state kernels, call sites: all installed, then a last mechanism
    raises; the modules, forwards, buffers, hooks, attention implementation and attributes come back."""
    model = hf.tiny_random_model(arch)
    ids = torch.arange(3, 10)[None]
    with torch.no_grad():
        before_logits = model(input_ids=ids).logits
    model.train()  # adapt puts it in eval mode: undone too
    before = _snapshot(model)
    monkeypatch.setattr(adaptation, "AFTER_PROBE", (*adaptation.AFTER_PROBE, _Fails()))
    with pytest.raises(RuntimeError, match="a late mechanism failed"):
        hf.adapt(model)
    assert _snapshot(model) == before
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before_logits)
    monkeypatch.undo()
    adapted = hf.adapt(model)  # and it adapts as if never touched
    assert adapted.kv_shape is not None


def test_a_failed_readaptation_returns_the_model_to_its_first_adaptation(monkeypatch):
    model = hf.tiny_random_model("bloom")
    hf.adapt(model)
    first = _snapshot(model)
    monkeypatch.setattr(adaptation, "AFTER_PROBE", (*adaptation.AFTER_PROBE, _Fails()))
    with pytest.raises(RuntimeError):
        hf.adapt(model)
    assert _snapshot(model) == first


def test_the_probe_result_is_a_frozen_value():
    result = hf.probe(hf.tiny_random_model("llama"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.call_sites = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.layers[0].mask = "changed"
    assert isinstance(result.host_reads, tuple) and isinstance(result.sites, tuple)


def test_each_attention_module_holds_one_frozen_record():
    model = hf.tiny_random_model("llama")
    hf.adapt(model)
    attn = model.model.layers[1].self_attn
    state = attn.pb_adapted
    assert state == hf.AdaptedAttention(head_dim=16, kv_repeat=1, kv_layer=1)
    assert not [k for k in vars(attn) if k.startswith("pb_") and k != "pb_adapted"]  # no loose attributes
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.kv_layer = 0


def test_every_registry_is_keyed_by_the_class_key_and_state_swaps_answers_by_class_name():
    for registry in (attention_swaps.SWAPS, position_swaps.SWAPS, state_swaps.REGISTRY):
        assert all(key.startswith("transformers.models.") and isinstance(s, patching.Swap) for key, s in registry.items())
    bloom = attention_swaps.swappable(hf.tiny_random_model("bloom"))[0]
    assert patching.class_key(bloom) == "transformers.models.bloom.modeling_bloom.BloomAttention"
    assert set(state_swaps.SWAPS) == {"MiniMaxLightningAttention", "RecurrentGemmaRecurrentBlock", "ZayaCCAProjection"}
    assert state_swaps.SWAPS["MiniMaxLightningAttention"].states == {"linear": "lightning"}
    assert hf.mixers.SWAPS is state_swaps.SWAPS


def test_the_probe_leaves_torch_compiler_alone_and_transformers_sees_compiling_only_inside():
    from transformers.utils import import_utils

    seen = []
    original = torch.compiler.is_compiling
    model = hf.tiny_random_model("llama")
    model.model.layers[0].register_forward_pre_hook(
        lambda m, a: seen.append((torch.compiler.is_compiling(), import_utils.is_torchdynamo_compiling()))
    )
    hf.probe(model)
    assert seen and all(pair == (False, True) for pair in seen)  # torch: eager; transformers: Dynamo's branches
    assert torch.compiler.is_compiling is original and import_utils.is_torchdynamo_compiling() is False


def test_break_registrations_die_with_their_model():
    model = hf.tiny_random_model("jetmoe")
    adapted = hf.adapt(model)
    assert adapted.host_breaks
    plans = [weakref.ref(m.forward.module_break) for m in model.modules() if "pb_host_break" in vars(m)]
    assert plans and all(p() is not None for p in plans)
    del model, adapted
    gc.collect()
    assert all(p() is None for p in plans)


def test_a_class_of_the_same_name_from_another_module_takes_no_registered_swap():
    """The key is the class's module and qualified name: a copy of a registered class elsewhere (a remote-code
    model's module, say, whose forward may differ) matches nothing, while the documented by-name view answers."""
    from piecewise_backend.hf import mixers

    bloom = attention_swaps.swappable(hf.tiny_random_model("bloom"))[0]
    impostors = {}
    for name in ("BloomAttention", "MiniMaxLightningAttention"):
        impostors[name] = type(name, (torch.nn.Module,), {"__module__": "remote_code.modeling_copy"})()
    assert patching.class_key(impostors["BloomAttention"]) != patching.class_key(bloom)
    assert patching.lookup(attention_swaps.SWAPS, bloom) is not None
    assert patching.lookup(attention_swaps.SWAPS, impostors["BloomAttention"]) is None
    assert mixers.swapped(impostors["MiniMaxLightningAttention"]) is None
    assert "MiniMaxLightningAttention" in state_swaps.SWAPS
