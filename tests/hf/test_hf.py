"""The transformers adapter (hf/engine.py) and examples/hf_generate.py, on the simulated platform."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pbtest.helpers import load_file
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend import kv

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf
from piecewise_backend.hf import adapter as hf_adapt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def load_example():
    return load_file("examples/hf_generate.py")


def test_importing_the_package_does_not_import_transformers():
    code = ("import sys, piecewise_backend, piecewise_backend.kv, piecewise_backend.serve.arguments; "
            "assert 'transformers' not in sys.modules, 'imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_adapted_model_matches_hf_sdpa_on_a_ragged_batch(arch):
    """Two prompts in one tokens-first step give HF's own logits, each with its own positions."""
    model = hf.tiny_random_model(arch)
    reference = copy.deepcopy(model)
    adapted = hf.adapt(model)
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    assert hf.ATTN_IMPLEMENTATION in transformers.AttentionInterface()
    cache = kv.PagedKVCache(*hf.kv_shape(model.config), num_blocks=8, block_size=4, max_model_len=16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g) for n in (7, 3)]
    meta = cache.step_inputs([(0, 0, 7), (1, 0, 3)])
    with torch.no_grad():
        with pb.set_forward_context(attn_metadata=cache.metadata(meta)):
            got = adapted(torch.cat(prompts), meta[kv.POSITIONS])
        expected = torch.cat([reference(p[None]).logits[0] for p in prompts])
        assert_close(got, expected, atol=1e-5, rtol=1e-5)
        # one decode token for request 1: it reads the 3 cached tokens through its block table
        nxt = torch.tensor([5])
        meta = cache.step_inputs([(1, 3, 1)])
        with pb.set_forward_context(attn_metadata=cache.metadata(meta)):
            step = adapted(nxt, meta[kv.POSITIONS])
        assert_close(step, reference(torch.cat([prompts[1], nxt])[None]).logits[0, -1:], atol=1e-5, rtol=1e-5)


def test_adapt_refuses_what_it_cannot_serve():
    with pytest.raises(TypeError, match="takes a transformers PreTrainedModel, got Linear"):
        hf.adapt(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="non-causal attention"):
        hf.adapt(hf.tiny_random_model("bert"))
    gemma2 = hf.tiny_random_model("gemma2")  # eager attention in transformers 5.24, SDPA in 5.17
    hf.adapt(gemma2)  # soft-capping is carried by the op now (served: test_hf_models.py)
    with pytest.raises(ValueError, match="'t5' has no causal LM class"):
        hf.tiny_random_model("t5")
    with pytest.raises(ValueError, match="'nope' is not a transformers model type"):
        hf.tiny_random_model("nope")


@pytest.mark.parametrize(
    "arch, sizes, reason",
    [
        # keys compressed over groups of tokens: a second, pooled cache the paged one does not hold
        ("deepseek_v4", {}, r"\['compressed_sparse_attention', 'heavily_compressed_attention'\] layers: .* compressed"),
        # earlier recurrent loops read the last loop's cache: no K/V of their own call site
        ("dory", {"recurrent_kv_cache_mode": "last_loop"}, r"recurrent_kv_cache_mode='last_loop'"),
    ],
)
def test_adapt_refuses_models_it_would_serve_wrongly(arch, sizes, reason):
    model = hf.tiny_random_model(arch, **sizes)
    with pytest.raises(ValueError, match=reason):
        hf.adapt(model)


def test_probe_finds_host_reads_of_moe_routing_and_adapt_switches_them_off():
    """The cause of mixtral's wrong tokens: HF's experts loop over ``nonzero()`` (eager) or, under
    Dynamo without CUDA bf16, over ``offsets.tolist()`` (grouped_mm's fallback), so a graph replays the
    routing seen at capture. The probe (which follows the branches taken under torch.compile) sees both;
    adapt switches to ``batched_mm`` (static shapes, no host read). (The engine twin: test_hf_models.py
    serves mixtral and checks its tokens.)"""
    model = hf.tiny_random_model("mixtral")
    model.set_experts_implementation("eager")
    assert any(r.startswith("aten::nonzero in ") and "experts" in r for r in hf_adapt.probe(model).host_reads)
    model.set_experts_implementation("grouped_mm")  # HF's default
    assert any(r.startswith("Tensor.tolist in ") and "experts" in r for r in hf_adapt.probe(model).host_reads)
    adapted = hf.adapt(model)
    assert model.config._experts_implementation == "batched_mm"
    assert hf_adapt.probe(model).host_reads == ()
    assert adapted.kv_shape == (2, 2, 16)


def test_kv_shape_comes_from_the_attention_modules():
    """Multi-query (gpt_bigcode: 1 KV head, the config says nothing of it) and MLA (deepseek_v3:
    K/V per query head, K's head dim 24 and V's 12: one cache of the wider)."""
    bigcode = hf.tiny_random_model("gpt_bigcode")
    assert hf.kv_shape(bigcode.config) != (2, 1, 16)  # what the config alone suggests: wrong
    assert hf.kv_shape(bigcode) == (2, 1, 16)
    deepseek = hf.tiny_random_model("deepseek_v3")
    assert hf.kv_shape(deepseek) == (2, 4, 24)
    assert deepseek.config._attn_implementation == "sdpa"  # the probe restores the model's attention


def test_mla_pads_v_to_the_cache_head_dim_and_matches_hf():
    """deepseek_v3's V head dim (12) is narrower than K's (24): padded inside the adapter, sliced after."""
    model = hf.tiny_random_model("deepseek_v3")
    reference = copy.deepcopy(model)
    adapted = hf.adapt(model)
    cache = kv.PagedKVCache(*adapted.kv_shape, num_blocks=8, block_size=4, max_model_len=16)
    prompt = torch.randint(3, 256, (6,), generator=torch.Generator().manual_seed(0))
    meta = cache.step_inputs([(0, 0, 6)])
    with torch.no_grad(), pb.set_forward_context(attn_metadata=cache.metadata(meta)):
        assert_close(adapted(prompt, meta[kv.POSITIONS]), reference(prompt[None]).logits[0], atol=1e-5, rtol=1e-5)


def test_layers_with_fewer_kv_heads_repeat_them_in_one_cache():
    """mimo_v2_flash's layers hold 2 or 4 KV heads (4 query heads): one cache of 4 KV heads, each of a
    2-head layer's KV heads stored twice, so every query head still meets its own KV head."""
    model = hf.tiny_random_model("mimo_v2_flash")
    reference = copy.deepcopy(model)
    assert sorted({l.kv_heads for l in hf_adapt.probe(model).layers.values()}) == [2, 4]
    adapted = hf.adapt(model)
    assert adapted.kv_shape[1] == 4
    cache = kv.PagedKVCache(*adapted.kv_shape, num_blocks=8, block_size=4, max_model_len=16)
    prompt = torch.randint(3, 256, (6,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        meta = cache.step_inputs([(0, 0, 6)])
        with pb.set_forward_context(attn_metadata=cache.metadata(meta)):
            assert_close(adapted(prompt, meta[kv.POSITIONS]), reference(prompt[None]).logits[0], atol=1e-5, rtol=1e-5)
        meta = cache.step_inputs([(0, 6, 1)])  # decode: reads the 6 cached tokens of every layer
        with pb.set_forward_context(attn_metadata=cache.metadata(meta)):
            step = adapted(torch.tensor([9]), meta[kv.POSITIONS])
        assert_close(step, reference(torch.cat([prompt, torch.tensor([9])])[None]).logits[0, -1:], atol=1e-5, rtol=1e-5)


def test_tiny_random_model_builds_configs_with_read_only_fields():
    falcon = hf.tiny_random_model("falcon")  # its head_dim is a property without a setter
    assert falcon.config.hidden_size == 64 and falcon.config.num_hidden_layers == 2
    mixtral = hf.tiny_random_model("mixtral")  # experts shrunk too
    assert mixtral.config.num_local_experts == 4 and sum(p.numel() for p in mixtral.parameters()) < 500_000
    llama4 = hf.tiny_random_model("llama4_text")  # its default experts' sizes would allocate GBs
    assert sum(p.numel() for p in llama4.parameters()) < 2_000_000
    plbart = hf.tiny_random_model("plbart")  # its encoder/decoder head counts must divide d_model
    assert plbart.config.d_model == 64


def test_tiny_random_model_names_what_it_cannot_shrink(monkeypatch):
    """A size field TINY does not know is found on the meta device (nothing allocated) and named: blt's hash
    embeddings without the size tiny_random_model's table gives them."""
    from piecewise_backend.testing import hf_models

    monkeypatch.delitem(hf_models.TINY_TYPE_SIZES, "blt")
    with pytest.raises(ValueError, match=r"cannot build 'blt' from a shrunk config \(\d+M parameters \(> 50M"):
        hf.tiny_random_model("blt")


def test_attention_refuses_other_layouts():
    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.zeros(1, 4, 3, 16)
    with pytest.raises(ValueError, match="batch of 1 row.*got batch 2"):
        hf.paged_attention_forward(module, q.expand(2, -1, -1, -1), q, q, None)


def _probe_one_layer(*args, **kwargs) -> hf_adapt.ProbeResult:
    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.zeros(1, 4, 3, 16)
    record = hf_adapt._Recording()
    token = hf_adapt._RECORDING.set(record)
    try:
        out, _ = hf_adapt.probe_attention_forward(module, q, q[:, :2], q[:, :2, :, :8], *args, **kwargs)
    finally:
        hf_adapt._RECORDING.reset(token)
    assert out.shape == (1, 3, 4, 8)  # (batch, tokens, heads, v's head dim)
    return hf_adapt._result(module, 3, False, record, hf_adapt._Recording(), {}, [])


def test_probe_refuses_attention_inputs_the_paged_attention_would_ignore():
    """An argument the op does not apply (a relative position bias, another sink convention) or a mask
    that is not the causal one would be dropped silently: refused up front, naming it."""
    assert hf_adapt.layout_refusal("M", _probe_one_layer(None, scaling=0.25, sliding_window=None, softcap=None)) is None
    extra = _probe_one_layer(None, position_bias=torch.zeros(4, 3, 3))
    expected = "M passes ['position_bias'] to attention (layer 0); the paged attention does not apply them"
    assert hf_adapt.layout_refusal("M", extra) == expected
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    assert hf_adapt.layout_refusal("M", _probe_one_layer(causal)) is None
    bidirectional = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    refused = hf_adapt.layout_refusal("M", _probe_one_layer(bidirectional))
    assert "builds its own attention mask for layer 0, not the causal mask" in refused
    window = torch.ones(3, 3, dtype=torch.bool).tril().triu(-1)[None, None]  # sliding window of 2
    assert hf_adapt.layout_refusal("M", _probe_one_layer(window, sliding_window=2)) is None
    assert hf_adapt.layout_refusal("M", _probe_one_layer(window)) is not None  # a window the op would not apply


@pytest.fixture(scope="module")
def llama_engine():
    """One llama engine with small capture sizes, shared by the engine tests."""
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[1, 2, 4, 8])
    model = hf.tiny_random_model("llama")
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, config, max_num_reqs=3, max_model_len=32, block_size=4)
    engine.capture()
    return engine, reference


@pytest.mark.parametrize("budget", [None, 16])
def test_engine_serves_every_mode_and_matches_generate(llama_engine, budget):
    """A prompt longer than the largest capture is prefilled in chunks of at most that size (default
    max_num_batched_tokens), or, with a larger budget, runs in one eager step; prompts join mid-decode
    (PIECEWISE), pure decode replays FULL graphs; all tokens equal HF greedy generate's."""
    engine, reference = llama_engine
    engine.reset_prefix_cache()  # the step shapes below are those of whole prompts (each parameter runs them again)
    # each Dynamo graph (one per compile; size 1 specializes) holds the whole model, no graph break,
    # and splits at each layer's paged attention
    assert engine.backend.splits
    for split in engine.backend.splits:
        assert split.found_ops == ["pb_kv::paged_attention"]
        assert [p.is_splitting for p in split.pieces] == [False, True, False, True, False]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 11, 1, 4)]
    budgets = [5, 2, 6, 3]
    steps: list[hf.StepInfo] = []
    assert engine.max_num_batched_tokens == 8  # the largest capture size
    engine.max_num_batched_tokens = budget or 8
    try:
        with pb.expect(captures=0):  # everything was captured up front
            outputs = engine.generate(prompts, budgets, on_step=steps.append)
    finally:
        engine.max_num_batched_tokens = 8
    modes = {s.mode for s in steps}
    graphs = {pb.CUDAGraphMode.PIECEWISE, pb.CUDAGraphMode.FULL}
    assert modes == (graphs if budget is None else graphs | {pb.CUDAGraphMode.NONE}), steps
    assert max(s.num_tokens for s in steps) <= (budget or 8) and (budget is None) == (max(s.num_tokens for s in steps) <= 8)
    assert all((s.mode == pb.CUDAGraphMode.FULL) == (s.uniform_decode and s.num_tokens <= 8) for s in steps), steps
    assert [len(o) for o in outputs] == budgets
    assert load_example().check(reference, prompts, outputs, budgets, eos=None) == []
    assert engine.cache.tables == {} and engine.cache.num_free_blocks == engine.cache.total_blocks  # free or evictable


def test_example_check_reports_a_difference(llama_engine, capsys):
    _, reference = llama_engine
    example = load_example()
    prompt = [5, 6, 7]
    good = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=3, eos_token_id=None,
                              attention_mask=torch.ones(1, 3, dtype=torch.long))[0, 3:].tolist()
    assert example.check(reference, [prompt], [good], [3], eos=None) == []
    with torch.no_grad():
        worst = reference(torch.tensor([prompt + good[:-1]])).logits[0, -1].argmin().item()
    wrong = good[:-1] + [worst]
    assert example.check(reference, [prompt, prompt], [good, wrong], [3, 3], eos=None) == [1]
    assert "MISMATCH request 1" in capsys.readouterr().out


def test_example_check_accepts_a_tie_and_only_a_tie(capsys):
    """Two tokens with the same lm_head row tie exactly: the engine may pick either. A token below
    the best logit by more than LOGIT_TOL is still wrong."""
    example = load_example()
    reference = hf.tiny_random_model("llama")
    prompt = [5, 6, 7]
    kwargs = dict(do_sample=False, max_new_tokens=1, eos_token_id=None, attention_mask=torch.ones(1, 3, dtype=torch.long))
    first = reference.generate(torch.tensor([prompt]), **kwargs)[0, 3].item()
    twin = (first + 1) % 256
    with torch.no_grad():
        reference.lm_head.weight[twin] = reference.lm_head.weight[first]
    ties: list[int] = []
    assert example.check(reference, [prompt], [[twin]], [1], eos=None, ties=ties) == [] and ties == [0]
    assert "TIE request 0" in capsys.readouterr().out
    with torch.no_grad():
        reference.lm_head.weight[twin] -= 0.05 * reference.lm_head.weight[twin].sign()  # now clearly below
    assert example.check(reference, [prompt], [[twin]], [1], eos=None) == [0]


def test_engine_rejects_bad_requests(llama_engine):
    engine, _ = llama_engine
    with pytest.raises(ValueError, match=r"prompt 0: 30 tokens \+ 5 new must be in 1..max_model_len=32"):
        engine.generate([[1] * 30], 5)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int or one per prompt"):
        engine.generate([[1], [2]], [3])
    # the checks every engine shares (serve/arguments.py): each error names the value and what is valid
    for bad, shown in ((2.5, "2.5"), (None, "None"), (True, "True")):
        with pytest.raises(ValueError, match=rf"max_new_tokens must be a positive int or one per prompt .*got {shown}$"):
            engine.generate([[1]], bad)
    with pytest.raises(ValueError, match=r"max_new_tokens\[0\] must be a positive int \(tokens to generate\), got 2.5"):
        engine.generate([[1]], [2.5])
    assert engine.cache.tables == {}


def test_engine_rejects_token_ids_outside_the_vocabulary(llama_engine):
    engine, _ = llama_engine
    with pytest.raises(ValueError, match=r"prompt 1: token id 256 is outside the vocabulary \(ids 0..255\)"):
        engine.generate([[3, 4], [5, 256]], 2)
    with pytest.raises(ValueError, match="prompt 0: token id -1 is outside the vocabulary"):
        engine.generate([[-1]], 2)
    assert engine.cache.tables == {}


def test_engine_refuses_float_ids_and_takes_tensors_and_arrays(llama_engine):
    """A float id is refused, not truncated; a 1-D tensor or numpy array serves as its list does."""
    np = pytest.importorskip("numpy")
    engine, _ = llama_engine
    with pytest.raises(ValueError, match=r"prompt 0: token id 5.5 \(float\) at position 0 is not an integer"):
        engine.generate([[5.5, 6.9]], 2)
    with pytest.raises(ValueError, match=r"prompt 0 is a 2-D Tensor of shape \(1, 2\)"):
        engine.generate([torch.tensor([[5, 6]])], 2)
    with pytest.raises(TypeError, match=r"prompt 0 is text"):
        engine.generate(["5 6"], 2)
    expected = engine.generate([[5, 6], [7, 8, 9]], 3)
    assert engine.generate([torch.tensor([5, 6]), np.array([7, 8, 9])], 3) == expected
    assert engine.cache.tables == {}


def _generate(reference, prompt: list[int], n: int, **eos) -> list[int]:
    """``reference.generate`` greedy; ``eos``: ``eos_token_id=...`` or nothing (the model's generation_config)."""
    ids = torch.tensor([prompt])
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0,
                             **eos)
    return out[0, len(prompt):].tolist()


def test_engine_stops_at_any_eos_of_a_list_and_at_the_models_own(llama_engine):
    """``eos_token_id`` as a list (what many HF configs hold) stops a request at any of them; without
    one the engine stops where ``model.generate`` does: at ``generation_config.eos_token_id``."""
    engine, reference = llama_engine
    prompts, n = [[5, 6, 7, 8], [9, 10, 11], [40, 41]], 10
    free = engine.generate(prompts, n, eos_token_id=[])  # []: no stop token
    assert free == [_generate(reference, p, n, eos_token_id=[]) for p in prompts] and all(len(o) == n for o in free)
    # a token request 0 first emits at its 3rd token and one request 1 first emits at its 5th
    eos = [next(o[i] for i in range(j, n) if o[i] not in o[:i]) for o, j in ((free[0], 2), (free[1], 4))]
    expected = [_generate(reference, p, n, eos_token_id=eos) for p in prompts]
    assert engine.generate(prompts, n, eos_token_id=eos) == expected
    assert engine.generate(prompts, n, eos_token_id=tuple(eos)) == expected
    assert len(expected[0]) < n and len(expected[1]) < n, expected  # both stopped early
    saved = engine.model.generation_config.eos_token_id, reference.generation_config.eos_token_id
    try:
        for default in (eos[0], eos):  # an int or a list in the model's generation config
            engine.model.generation_config.eos_token_id = reference.generation_config.eos_token_id = default
            expected = [_generate(reference, p, n) for p in prompts]
            assert len(expected[0]) < n, expected
            assert engine.generate(prompts, n) == expected
        engine.model.generation_config.eos_token_id = "2"
        with pytest.raises(ValueError, match=r"the model's generation_config.eos_token_id must be an int, a list .* got '2'"):
            engine.generate(prompts, n)
    finally:
        engine.model.generation_config.eos_token_id, reference.generation_config.eos_token_id = saved
    assert engine.cache.tables == {}


@pytest.mark.parametrize("eos", ["2", 2.0, True, [1, "x"], {2}, torch.tensor(2)])
def test_engine_refuses_an_eos_that_is_not_ints(llama_engine, eos):
    engine, _ = llama_engine
    with pytest.raises(ValueError, match=r"eos_token_id must be an int, a list or tuple of ints \(\[\]: no stop token\), "
                                         r"or None \(the model's generation_config.eos_token_id\), got "):
        engine.generate([[5, 6]], 2, eos_token_id=eos)
    with pytest.raises(ValueError, match=r"eos_token_id 256 is outside the vocabulary \(ids 0..255\)"):
        engine.generate([[5, 6]], 2, eos_token_id=[3, 256])


def test_ten_engines_in_one_process_each_compile_their_model():
    """Dynamo keeps compiled code per code object and stops compiling one after 8 entries
    (``recompile_limit``): every engine's adapted model has its own ``forward`` code, so the 10th
    engine in a process is compiled and split like the first (no ``torch._dynamo.reset()``)."""
    config = pb.CompilationConfig(cudagraph_mode="NONE", platform="simulated", compile_pieces="eager",
                                  capture_sizes=[2, 4])
    model = hf.tiny_random_model("llama", num_hidden_layers=1)
    outputs, splits = [], []
    for _ in range(10):
        engine = hf.HFEngine(copy.deepcopy(model), config, max_num_reqs=2, max_model_len=16, block_size=4)
        outputs.append(engine.generate([[5, 6, 7], [8, 9]], 1))  # one step: one Dynamo graph per engine
        splits.append([s.found_ops for s in engine.backend.splits])
    assert outputs == [outputs[0]] * 10
    assert all(s and all(ops == ["pb_kv::paged_attention"] for ops in s) for s in splits), splits
    first, second = (hf.adapt(copy.deepcopy(model)) for _ in range(2))
    assert isinstance(first, hf.TokensFirst) and type(first).__name__ == "TokensFirst"
    assert type(first).forward.__code__ is not type(second).forward.__code__


def test_engine_rejects_max_model_len_past_the_models_positions():
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2])
    model = hf.tiny_random_model("gpt2", max_position_embeddings=16)  # learned positions: 16 rows
    with pytest.raises(ValueError, match=r"max_model_len=32 exceeds GPT2LMHeadModel's max_position_embeddings=16: use max_model_len <= 16"):
        hf.HFEngine(model, config, max_model_len=32)


def test_engine_arguments_are_checked_before_adapt_and_from_pretrained_routes_them_by_field(tmp_path):
    """HFEngine takes serve.EngineArgs' fields but eos_token_id (its stop token is the model's), as keywords or
    ``args``; a bad one is refused before adapt touches the model; from_pretrained sends exactly those to it."""
    from piecewise_backend.hf import engine as hf_engine
    from piecewise_backend.serve import EngineArgs, arguments

    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2])
    model = hf.tiny_random_model("llama", num_hidden_layers=1)
    for bad, error, match in (
        (dict(max_num_reqs=0), ValueError, r"max_num_reqs must be a positive int \(requests a step runs at most\)"),
        (dict(step_capture_budget_s=-1), ValueError, r"step_capture_budget_s must be None .* got -1"),
        (dict(eos_token_id=3), TypeError, r"HFEngine.__init__\(\) got an unexpected keyword argument 'eos_token_id'"),
        (dict(args=EngineArgs(eos_token_id=3)), TypeError, r"HFEngine takes no eos_token_id"),
    ):
        with pytest.raises(error, match=match):
            hf.HFEngine(model, config, **bad)
    assert model.config._attn_implementation != hf.ATTN_IMPLEMENTATION  # refused before adapt
    assert hf_engine._ENGINE_KWARGS == {*arguments.engine_keywords(exclude=["eos_token_id"]), "args"}
    copy.deepcopy(model).save_pretrained(tmp_path)
    engine = hf.HFEngine.from_pretrained(tmp_path, config, args=EngineArgs(max_num_reqs=2, max_model_len=16),
                                         block_size=4, dtype=torch.float32)
    assert engine.args == EngineArgs(max_num_reqs=2, max_model_len=16, block_size=4)
    assert engine.cache.block_size == 4 and engine.model_runners[0].model.model is engine.model


def test_engine_frees_blocks_when_a_step_fails(llama_engine):
    engine, _ = llama_engine

    def stop(info: hf.StepInfo) -> None:
        if info.step == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.generate([[3, 4, 5], [6, 7]], 4, on_step=stop)
    assert engine.cache.tables == {} and engine.cache.num_free_blocks == engine.cache.total_blocks  # free or evictable
    assert [len(o) for o in engine.generate([[3, 4, 5]], 2)] == [2]  # still serves


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_generate_example_checks_against_generate(arch):
    """On the simulator here; on a GPU machine the example itself picks CUDA (see the cuda twin)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_generate.py"), "--arch", arch, "--check"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    steps = re.findall(r"^step\s+\d+:\s+(\d+) tokens, (\d) reqs, (decode|mixed)\s* -> (\w+)$", proc.stdout, re.M)
    assert {(kind, mode) for _, _, kind, mode in steps} == {("mixed", "PIECEWISE"), ("decode", "FULL")}, proc.stdout
    assert "check: 5/5 requests match model.generate" in proc.stdout


def test_hf_generate_example_serves_lazily_samples_and_streams():
    """--lazy: served eagerly, captured in idle time, served again on graphs (the same tokens); --sample:
    one seed, the same draws twice; --stream: every token printed as produced; --check: greedy vs generate."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_generate.py"), "--arch", "llama", "--check", "--lazy", "--sample",
         "--stream"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    assert "captured" not in out.split("capture_idle:")[0]  # nothing captured before the first run
    modes = re.findall(r"^step +\d+:.* -> (\w+)$", out, re.M)
    first, second = modes[: len(modes) // 2], modes[len(modes) // 2:]
    assert set(first) == {"NONE"} and set(second) == {"PIECEWISE", "FULL"}, out
    assert "lazy: the run on graphs equals the run before capture" in out
    assert "sample: seed 0 drew the same tokens twice" in out and "check: 5/5 requests match model.generate" in out
    streamed = re.findall(r"^  token: request (\d) -> (\d+)$", out, re.M)
    greedy = {int(i): eval(toks) for i, toks in re.findall(r"^request (\d): prompt +\d+ tokens -> (\[.*\])$", out, re.M)}
    first_run = streamed[: sum(len(t) for t in greedy.values())]  # the greedy run streams first, in order
    assert {i: [int(t) for r, t in first_run if int(r) == i] for i in greedy} == greedy


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss", "gemma2", "gpt_bigcode"])
def test_hf_generate_example_on_cuda(arch, capsys):
    """The twins on CPU: test_hf_models.py's engine sample and the simulated example run above. On a GPU a
    host read inside a capture raises, so this also checks the MoE experts switch is graph-safe there. In this
    process on eager pieces (five cold Inductor subprocesses would not fit the GPU check): llama's Inductor
    run is scripts/gpu_check.sh's "example" step."""
    assert load_example().main(["--arch", arch, "--check", "--compile-pieces", "eager"]) == 0
    out = capsys.readouterr().out
    assert "platform: cuda" in out and "check: 5/5 requests match model.generate" in out


@pytest.mark.cuda
def test_hf_generate_example_serves_lazily_and_samples_on_cuda():
    """The twin of test_hf_generate_example_serves_lazily_samples_and_streams: on a GPU, idle-time CUDA graph
    captures between batches serve the same tokens as the eager steps before them."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_generate.py"), "--arch", "llama", "--check", "--lazy", "--sample"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "platform: cuda" in proc.stdout and "lazy: the run on graphs equals the run before capture" in proc.stdout


def test_hf_generate_example_exits_2_with_the_reason_for_a_refused_model():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_generate.py"), "--arch", "bert", "--check"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "error: BertLMHeadModel has non-causal attention" in proc.stderr


def test_model_survey_classifies_each_exit_and_groups_the_table():
    survey = load_file("scripts/model_survey.py")
    results = [
        survey.classify("a", 0, "step 0: ...\ndynamo graphs: 1\ncheck: 5/5 requests match model.generate\n", 1.0),
        survey.classify("b", 2, "usage: x\nhf_generate.py: error: BForCausalLM uses chunked attention\n", 0.5),
        survey.classify("c", 2, "hf_generate.py: error: tiny_random_model cannot build 'c' from a shrunk config (X)\n", 0.2),
        survey.classify("d", 1, "MISMATCH request 1: engine [1] != generate [2]\ncheck: 4/5 requests match model.generate\n", 2.0),
        survey.classify("e", 1, "Traceback (most recent call last):\n  File ...\nRuntimeError: boom\n", 0.1),
        survey.classify("f", None, "", 60.0),
    ]
    assert [(r.arch, r.outcome) for r in results] == [
        ("a", "pass"), ("b", "refused"), ("c", "not built"), ("d", "wrong"), ("e", "crash"), ("f", "timeout")
    ]
    assert results[1].reason == "BForCausalLM uses chunked attention" and results[4].reason == "RuntimeError: boom"
    text = survey.table(results, "test conditions")
    assert "Counts: 1 pass, 1 refused, 1 not built, 1 wrong, 1 crash, 1 timeout (6 types)." in text
    assert text.index("## pass (1)") < text.index("## refused (1)") < text.index("## timeout (1)")
    assert "| d | wrong | 4/5 requests match model.generate; first: MISMATCH request 1" in text
    assert survey.parse(text) == results  # what --merge reads back
    assert "| a | pass | 1 | 5/5 requests match model.generate |" in text
    assert "## passes with more than one Dynamo graph (0)" in text


def test_model_survey_records_the_dynamo_graphs_of_a_pass_and_lists_the_graph_breaks():
    survey = load_file("scripts/model_survey.py")
    out = ("dynamo graphs: 2; first graph break: Dynamo ended this graph at a graph break at m.py:7 (Could not guard | x)\n"
           "check: 5/5 requests match model.generate\n")
    results = [survey.classify("one", 0, "dynamo graphs: 1\ncheck: 5/5 requests match model.generate\n", 1.0),
               survey.classify("two", 0, out, 2.0),
               survey.classify("again", 0, "dynamo graphs: 3\ncheck: 5/5 requests match model.generate\n", 2.0),
               survey.classify("old", 0, "check: 5/5 requests match model.generate\n", 1.0)]
    assert [(r.graphs, r.graph_break[:20]) for r in results] == [
        (1, ""), (2, "Dynamo ended this gr"), (3, "no graph break recor"), (None, "")]
    text = survey.table(results, "test conditions")
    assert "## passes with more than one Dynamo graph (2)" in text
    assert "| two | 2 | Dynamo ended this graph at a graph break at m.py:7 (Could not guard \\| x) |" in text
    assert "| old | pass | ? |" in text
    assert survey.parse(text) == results


def test_probe_leaves_torch_as_it_found_it():
    tolist, is_compiling = torch.Tensor.tolist, torch.compiler.is_compiling
    hf_adapt.probe(hf.tiny_random_model("llama"))
    assert "tolist" not in torch.Tensor.__dict__ and torch.Tensor.tolist is tolist
    assert torch.compiler.is_compiling is is_compiling and not torch.compiler.is_compiling()


def test_adapt_refuses_a_dynamic_mask():
    """doge builds its attention mask from the values (the op would drop it); the probe's own mask
    comparison is no host read of the model's."""
    with pytest.raises(ValueError, match="DogeForCausalLM builds its own attention mask for layer 0, not the causal mask"):
        hf.adapt(hf.tiny_random_model("doge"))


def test_adapt_refuses_a_model_whose_forward_needs_more_than_ids():
    """xmod needs a language set before any forward: a token-id forward fails, and adapt says so
    (the same in transformers 5.17 and 5.24)."""
    with pytest.raises(ValueError, match=r"fails on a plain token-id forward \(ValueError: Input language unknown"):
        hf.adapt(hf.tiny_random_model("xmod"))


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "NONE"])
def test_micro_batched_engine_matches_generate(mode):
    """Decode steps of 4 requests split 2 + 2 (max_num_reqs is the running count): the second
    half's requests read their own block tables (before: other requests' tokens, or an IndexError)."""
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 8], cudagraph_mode=mode,
                                  use_ubatching=True, dbo_decode_token_threshold=2)
    model = hf.tiny_random_model("llama")
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, config, max_num_reqs=4, max_model_len=32, block_size=4)
    engine.capture()
    prompts = [[5, 6], [8], [10, 11, 12], [14]]  # one prompt step, then decode steps of all 4
    steps: list[tuple[hf.StepInfo, bool]] = []
    outputs = engine.generate(prompts, 4, on_step=lambda info: steps.append((info, engine.runner.last_ubatched)))
    assert [(info.num_reqs, ubatched) for info, ubatched in steps] == [(4, False)] + [(4, True)] * 3, steps
    expected = pb.CUDAGraphMode.FULL if mode != "NONE" else pb.CUDAGraphMode.NONE
    assert engine.runner.last_mode == expected
    assert load_example().check(reference, prompts, outputs, [4] * 4, eos=None) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(lazy_capture="yes"), r"lazy_capture must be a bool, got 'yes'"),
    (dict(max_num_reqs=0), r"max_num_reqs must be a positive int"),
    (dict(max_num_reqs=2.5), r"max_num_reqs must be a positive int .* got 2.5"),
    (dict(block_size=0), r"block_size must be a positive int"),
    (dict(num_blocks=0), r"num_blocks must be None .* or a positive int, got 0"),
    (dict(attention_backend="nope"), r"unknown attention backend 'nope'"),
])
def test_a_refused_engine_leaves_the_callers_model_as_it_was(kwargs, match):
    """Every argument is checked before adapt: the model keeps its own attention and generate()."""
    model = hf.tiny_random_model("llama", num_hidden_layers=1)
    implementation = model.config._attn_implementation
    ids = torch.tensor([[5, 6, 7]])
    before = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=3, pad_token_id=0)
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4])
    with pytest.raises(ValueError, match=match):
        hf.HFEngine(model, config, **kwargs)
    with pytest.raises(ValueError, match=match):
        hf.SpecEngine(model, model, config, num_speculative_tokens=2, **kwargs)
    assert model.config._attn_implementation == implementation
    after = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=3, pad_token_id=0)
    assert torch.equal(before, after)


def test_an_engine_without_graphs_or_capture_sizes_serves_whole_prompts():
    model = hf.tiny_random_model("llama", num_hidden_layers=1)
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, pb.CompilationConfig(cudagraph_mode="NONE", capture_sizes=[]), max_model_len=32)
    assert engine.max_num_batched_tokens == 32
    prompt = [5, 6, 7, 8, 9]
    ids = torch.tensor([prompt])
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4,
                                  pad_token_id=0, eos_token_id=None)[0, 5:].tolist()
    assert engine.generate([prompt], 4, eos_token_id=[]) == [expected]
