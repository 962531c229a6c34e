"""HF models with state layers (gated delta nets, short convolutions, Mamba2, Mamba1) and chunked attention through HFEngine."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from pbtest.helpers import load_file, serve_requests

import piecewise_backend as pb
from piecewise_backend import state as st

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf  # noqa: E402
from piecewise_backend.spec import SpecEngine  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every engine here compiles the same code objects (TokensFirst.forward, ...): past Dynamo's recompile_limit
    a model would run uncompiled, unsplit, which the state ops refuse. Reset between tests."""
    torch._dynamo.reset()


def model_type(arch: str) -> str:
    """``arch``, or a skip where the installed transformers has no such type (lfm3 is new in 5.24; 5.17 lacks it)."""
    if arch not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model type {arch!r}")
    return arch


CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 8, 16])


def _example():
    return load_file("examples/hf_generate.py")


def serve(model: torch.nn.Module, capture: bool = True, **engine_kwargs):
    return serve_requests(model, CONFIG, capture, **engine_kwargs)


# type -> attention layers of its tiny model (the KV cache holds those only)
SERVED = {"qwen3_next": 1, "olmo_hybrid": 1, "lfm3": 2, "llama4_text": 2, "nemotron_h": 1, "falcon_h1": 2, "mamba2": 0,
          "mamba": 0, "jamba": 1, "lfm2_moe": 1}


@pytest.mark.parametrize("arch", sorted(SERVED))
def test_engine_serves_state_layers_and_chunked_attention_like_generate(arch):
    model = hf.tiny_random_model(model_type(arch))
    reference = copy.deepcopy(model)
    prompts, outputs, steps, engine = serve(model)
    modes = {s.mode for s in steps if s.uniform_decode}
    assert modes == {pb.CUDAGraphMode.FULL}, steps  # pure decode steps replay FULL graphs, state updates inside
    assert pb.CUDAGraphMode.PIECEWISE in {s.mode for s in steps if not s.uniform_decode}
    assert _example().check(reference, prompts, outputs, [5, 7, 9], eos=None) == []
    assert len(engine.cache.key_caches) == SERVED[arch]  # the KV cache holds attention layers only
    assert len(engine.backend.splits) == 1  # one Dynamo graph, split at its state and attention ops only
    assert (engine.states is None) == (arch == "llama4_text")
    if engine.states is not None:
        assert engine.states.slots == {}  # every finished request gave its slot back


def test_a_capture_on_first_sight_mid_serving_keeps_the_states_right():
    """No capture() at startup: each descriptor is captured on the step that first needs it, its breaks run
    on garbage at capture and again at replay; the states must advance once, from the right values."""
    model = hf.tiny_random_model("qwen3_5_text")
    reference = copy.deepcopy(model)
    prompts, outputs, steps, _ = serve(model, capture=False)
    assert {pb.CUDAGraphMode.FULL, pb.CUDAGraphMode.PIECEWISE} <= {s.mode for s in steps}
    assert _example().check(reference, prompts, outputs, [5, 7, 9], eos=None) == []


def test_tokens_depend_on_the_state_so_the_check_can_fail(monkeypatch):
    """The control: an engine that never commits (every step reads a new request's zeros) differs from
    generate, so the tiny models' state layers matter (tiny_random_model's state_gain)."""
    monkeypatch.setattr(st.cache.StateCache, "commit", lambda self, requests: None)
    model = hf.tiny_random_model("lfm2")
    reference = copy.deepcopy(model)
    prompts, outputs, _, _ = serve(model)
    assert _example().check(reference, prompts, outputs, [5, 7, 9], eos=None) != []


@pytest.mark.parametrize("arch, kinds", [
    ("qwen3_next", {"linear_attention", "full_attention"}),
    ("lfm2", {"conv", "full_attention"}),  # its default config is all attention; LFM2 checkpoints are not
    ("lfm3", {"conv", "full_attention", "sliding_attention"}),
    ("llama4_text", {"chunked_attention", "full_attention"}),
    ("gemma3_text", {"sliding_attention", "full_attention"}),
    ("granitemoehybrid", {"linear_attention", "full_attention"}),  # its default is all Mamba2
    ("bamba", {"linear_attention", "full_attention"}),
    ("jamba", {"linear_attention", "full_attention"}),  # its first attention layer is its fifth by default
])
def test_tiny_models_keep_a_layer_of_every_type(arch, kinds):
    assert set(hf.tiny_random_model(model_type(arch)).config.get_text_config().layer_types) == kinds
    assert set(hf.tiny_random_model(arch, num_hidden_layers=1).config.get_text_config().layer_types) < kinds  # sizes win


def test_tiny_lfm2_moe_keeps_a_convolution_an_attention_and_an_experts_layer():
    """Its default config has no layer_types (its model indexes them) and two dense layers first."""
    model = hf.tiny_random_model("lfm2_moe")
    assert model.config.layer_types == ["conv", "full_attention"]
    assert [hasattr(layer.feed_forward, "experts") for layer in model.model.layers] == [False, True]


def test_zamba_keeps_two_hybrid_layers_and_is_refused_for_its_multi_head_mamba():
    """Their default layer lists keep the full depth (no shrunk config validated); two hybrid layers keep the
    shared attention block of their checkpoints (one module, a K/V per call site: tests/hf/test_call_sites.py).
    zamba's Mamba mixer calls its scan once per Mamba head, which the state cache does not hold."""
    for arch in ("zamba", "zamba2"):
        assert hf.tiny_random_model(arch).config.layers_block_type == ["linear_attention", "hybrid"] * 2
    with pytest.raises(ValueError, match=r"ZambaMambaMixer \(layer 0\) calls its ssm kernel more than once per forward"):
        hf.adapt(hf.tiny_random_model("zamba"))


def test_a_causal_lm_over_audio_codebooks_is_built_from_its_decoder_and_refused():
    """transformers maps musicgen to its decoder's causal LM (several text configs: a text encoder and a decoder);
    tiny_random_model builds it from the decoder sub-config, and adapt() refuses it: a row of tokens per codebook."""
    model = hf.tiny_random_model("musicgen")
    assert type(model).__name__ == "MusicgenForCausalLM" and model.config.num_codebooks == 4
    with pytest.raises(ValueError, match=r"MusicgenForCausalLM fails on a plain token-id forward"):
        hf.adapt(model)


def test_adapt_routes_each_state_layer_to_the_ops_by_what_it_calls():
    model = hf.tiny_random_model("qwen3_next")
    adapted = hf.adapt(model)
    text = model.config.get_text_config()
    conv = 2 * text.linear_num_key_heads * text.linear_key_head_dim + text.linear_num_value_heads * text.linear_value_head_dim
    assert [(s.layer, s.kind, s.shape) for s in adapted.state_specs] == [
        (0, "conv", (conv, text.linear_conv_kernel_dim - 1)),
        (0, "recurrent", (text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim)),
    ]
    assert adapted.kv_shape[0] == 1  # one attention layer (layer 1), at cache index 0
    assert model.model.layers[1].self_attn.pb_adapted.kv_layer == 0
    assert "forward" in vars(model.model.layers[0].linear_attn)  # its own code, its kernels bound to the ops
    assert "forward" not in vars(copy.deepcopy(hf.tiny_random_model("qwen3_next")).model.layers[0].linear_attn)


def test_llama4_chunked_layers_and_its_temperature_bound():
    model = hf.tiny_random_model("llama4_text")
    hf.adapt(model)
    assert [layer.self_attn.pb_adapted.chunk_size for layer in model.model.layers] == [8, 0]
    model = hf.tiny_random_model("llama4_text")
    model.config.floor_scale = 20
    with pytest.raises(ValueError, match=r"tunes attention temperature from row indices \(floor_scale=20\)"):
        hf.HFEngine(model, CONFIG, max_model_len=32)


def nudged_drafter(model: torch.nn.Module) -> torch.nn.Module:
    """A drafter that differs from ``model``: its weights plus noise, so some drafts are rejected."""
    drafter = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.2 * p.std())
    return drafter


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h", "mamba2"])  # gated delta net, Mamba2 hybrid, pure Mamba
def test_spec_engine_decodes_state_layer_models_like_generate(arch):
    """A rejected draft leaves the states as if it never ran: tokens equal the target's greedy generate,
    with a drafter that differs from the target (state layers in both)."""
    target = hf.tiny_random_model(model_type(arch))
    reference = copy.deepcopy(target)
    engine = SpecEngine(target, nudged_drafter(target), CONFIG, num_speculative_tokens=2, max_num_reqs=3,
                        max_model_len=40, block_size=4)
    assert engine.target.states is not None and engine.drafter.states is not None
    engine.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 3)]
    outputs = engine.generate(prompts, [5, 7, 9])
    assert _example().check(reference, prompts, outputs, [5, 7, 9], eos=None) == []
    assert 0 < engine.stats.accepted < engine.stats.proposed, engine.stats  # rejections rolled back
    assert engine.target.states.slots == {} and engine.drafter.states.slots == {}


def test_a_model_without_attention_is_served():
    """lfm2 of conv layers only: no KV layers at all, and FULL decode graphs of the state ops alone. (transformers'
    generate cannot run it: its cache needs an attention layer; the reference is its greedy forward.)"""
    model = hf.tiny_random_model("lfm2", num_hidden_layers=2, layer_types=["conv", "conv"])
    reference = copy.deepcopy(model)
    prompts, outputs, steps, engine = serve(model)
    assert engine.cache.key_caches == [] and engine.cache.memory_bytes == 0
    assert pb.CUDAGraphMode.FULL in {s.mode for s in steps}
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            ids = list(prompt)
            for token in out:
                assert reference(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax().item() == token
                ids.append(token)


def test_a_tiny_model_that_would_lose_a_refused_layer_type_is_not_built():
    """qwen4_exp without its QSA indexer sizes (tiny_random_model sets them) cannot build its indexed-attention layers:
    without them the model would be served for a reason its checkpoints (their QSA indexer: refused) do not have."""
    qsa = dict.fromkeys(("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"))
    with pytest.raises(ValueError, match=r"cannot build 'qwen4_exp' with a layer of every type .* loses \['(\w+)'\]") as e:
        hf.tiny_random_model(model_type("qwen4_exp"), **qsa)
    lost = re.search(r"loses \['(\w+)'\]", str(e.value)).group(1)  # 'indexed_attention' in 5.24, 'qwen_sparse_attention' in 5.17
    assert lost not in hf.adapter.SERVED_LAYER_TYPES


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY"])
def test_every_graph_mode_serves_state_layers(mode):
    """(FULL_AND_PIECEWISE: the tests above.) FULL resolves to FULL_AND_PIECEWISE: FULL graphs hold one token per
    request only; FULL_DECODE_ONLY runs mixed steps eagerly."""
    model = hf.tiny_random_model("qwen3_next")
    reference = copy.deepcopy(model)
    config = CONFIG.replace(cudagraph_mode=mode)
    engine = hf.HFEngine(model, config, max_num_reqs=3, max_model_len=32, block_size=4)
    engine.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 3)]
    steps: list[hf.StepInfo] = []
    outputs = engine.generate(prompts, [5, 7, 9], on_step=steps.append)
    want = {"NONE": {"NONE"}, "PIECEWISE": {"PIECEWISE"}, "FULL": {"FULL", "PIECEWISE"}, "FULL_DECODE_ONLY": {"FULL", "NONE"}}
    assert {s.mode.name for s in steps} == want[mode]
    assert _example().check(reference, prompts, outputs, [5, 7, 9], eos=None) == []


def test_chunked_prefill_and_preemption_keep_the_states_right():
    """Prompts prefilled 4 tokens a step continue from their slot's state; with too few KV blocks for all,
    the newest requests are preempted, their slots freed, and recomputed from a zeroed slot later."""
    model = hf.tiny_random_model("qwen3_next")
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, CONFIG, max_num_reqs=3, max_model_len=32, block_size=4, num_blocks=6,
                         max_num_batched_tokens=4)
    engine.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 3)]
    steps: list[hf.StepInfo] = []
    outputs = engine.generate(prompts, [5, 7, 9], on_step=steps.append)
    assert any(s.preempted for s in steps), steps
    assert max(s.num_tokens for s in steps) <= 4
    assert _example().check(reference, prompts, outputs, [5, 7, 9], eos=None) == []
    assert engine.states.slots == {}


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_micro_batched_decode_steps_keep_each_halfs_slots(mode):
    """use_ubatching splits pure-decode steps of >= 2 requests in two halves: each half's tokens carry their own
    requests' state rows (absolute rows, not rebased), so no half reads or writes the other's states."""
    model = hf.tiny_random_model("qwen3_next")
    reference = copy.deepcopy(model)
    config = CONFIG.replace(cudagraph_mode=mode, use_ubatching=True, dbo_decode_token_threshold=2)
    engine = hf.HFEngine(model, config, max_num_reqs=3, max_model_len=32, block_size=4)
    engine.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 3)]
    split: list[bool] = []
    outputs = engine.generate(prompts, [5, 7, 9], on_step=lambda s: split.append(engine.runner.last_ubatched))
    assert sum(split) >= 3, split  # several steps ran as two micro-batches
    assert _example().check(reference, prompts, outputs, [5, 7, 9], eos=None) == []
    assert engine.states.slots == {}


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h", "mamba", "lfm2", "llama4_text"])
def test_state_layers_on_cuda(arch, capsys):
    """The twins on CPU: test_engine_serves_state_layers_and_chunked_attention_like_generate (and the mode and
    micro-batching tests). On a GPU the state ops run inside real FULL graphs (gathered and scattered by slot, no
    host read) and at real breaks between PIECEWISE segments; eager pieces keep it to one process."""
    assert _example().main(["--arch", model_type(arch), "--check", "--compile-pieces", "eager"]) == 0
    out = capsys.readouterr().out
    assert "platform: cuda" in out and "check: 5/5 requests match model.generate" in out
    decode = re.findall(r"^step +\d+:.* decode -> (\w+)$", out, re.M)
    assert decode and set(decode) == {"FULL"}, out


def test_state_layers_with_the_reference_attention_backend():
    """The state ops do not depend on the attention backend (the default 'auto' is 'bounded', tested above); a
    hybrid under 'reference' serves like generate too, its attention layers on that backend."""
    model = hf.tiny_random_model("qwen3_next")
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, CONFIG, max_num_reqs=3, max_model_len=32, block_size=4, attention_backend="reference")
    assert engine.attention_backend == "reference"
    engine.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 3)]
    steps: list[hf.StepInfo] = []
    outputs = engine.generate(prompts, [5, 7, 9], on_step=steps.append)
    assert {s.mode for s in steps if s.uniform_decode} == {pb.CUDAGraphMode.FULL}
    assert _example().check(reference, prompts, outputs, [5, 7, 9], eos=None) == []


def test_a_state_layer_model_is_served_with_prefix_caching_off_said_once(caplog):
    """Its states are not cached at block boundaries: prefix caching is off (one warning), prompts sharing a
    prefix are computed whole and served like generate."""
    model = hf.tiny_random_model("qwen3_next")
    reference = copy.deepcopy(model)
    from piecewise_backend.serve import engine as engine_module

    engine_module._said.clear()
    with caplog.at_level("WARNING"):
        engine = hf.HFEngine(model, CONFIG, max_num_reqs=2, max_model_len=32, block_size=4)
        hf.HFEngine(copy.deepcopy(reference), CONFIG, max_num_reqs=2, max_model_len=32, block_size=4)
    assert caplog.text.count("prefix caching is off for this engine: the model has state layers") == 1
    assert not engine.prefix_caching
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 1], [5, 6, 7, 8, 9, 10, 11, 12, 2]]
    outputs = [engine.generate([p], 4, eos_token_id=[])[0] for p in prompts]
    for p, out in zip(prompts, outputs):
        want = reference.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, min_new_tokens=4)[0, len(p):]
        assert out == want.tolist()
