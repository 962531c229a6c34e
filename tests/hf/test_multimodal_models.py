"""Tiny random image-text-to-text models of many types (``hf.tiny_random_vlm``, ``hf.random_mm_inputs``) on
HFEngine: an image prompt beside a text-only one, chunked, tokens equal to the model's own ``generate``; the
per-family entries of hf/multimodal/families.py (refusals with the reason, image-token counts, pixel layouts)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import piecewise_backend as pb

transformers = pytest.importorskip("transformers")
from pbtest.helpers import load_file

from piecewise_backend import hf

CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[1, 2, 4, 8])
example = load_file("examples/vlm_generate.py")


@pytest.fixture(autouse=True)
def _cheap_gc(monkeypatch):
    monkeypatch.setattr(gc, "collect", lambda *a: 0)


# llava and qwen2_vl (the core), qwen2_5_vl / smolvlm / mistral3 (named in issue 48), hunyuan_vl
# (GRID_COUNT_BY_ENCODER), idefics3 (BATCHED_PIXELS), glm4v_moe (a partial-rotary M-RoPE section in the fixture),
# qwen3_5 (one linear and one full attention layer), aria (its projector's patch-to-query map), qwen3_vl
# (deepstack: vision features added in its first text layers), llava_onevision (logits_to_keep in its kwargs)
# (llava and qwen2_vl's own tests are tests/hf/test_multimodal.py's)
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "mistral3", "smolvlm", "idefics3", "hunyuan_vl", "glm4v_moe", "qwen3_5",
                                  "aria", "qwen3_vl", "llava_onevision"])
def test_served_types_equal_generate(arch):
    model = hf.tiny_random_vlm(arch)
    model.generation_config.eos_token_id = None
    reference = copy.deepcopy(model)
    mm, count = hf.random_mm_inputs(model)
    image_prompt, text_prompt = example.prompts(model, [count], torch.Generator().manual_seed(1))
    engine = hf.HFEngine(model, CONFIG, max_num_reqs=2, max_model_len=96, block_size=4, max_num_batched_tokens=8)
    outs = engine.generate([image_prompt, text_prompt], 5, mm_inputs=[mm, None], eos_token_id=[])
    for prompt, inputs, out in zip((image_prompt, text_prompt), (mm, None), outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5,
                                      min_new_tokens=5, **example.reference_kwargs(reference, ids, inputs))
        assert out == want[0, len(prompt):].tolist(), (arch, prompt)


def test_tiny_random_vlm_seeded_small_and_tokens_in_vocab():
    a, b, c = hf.tiny_random_vlm("qwen2_vl"), hf.tiny_random_vlm("qwen2_vl"), hf.tiny_random_vlm("qwen2_vl", seed=1)
    first = lambda m: next(m.parameters())  # noqa: E731
    assert torch.equal(first(a), first(b)) and not torch.equal(first(a), first(c))
    assert sum(p.numel() for p in a.parameters()) < 5_000_000
    vocab = a.config.get_text_config().vocab_size
    assert vocab <= 512
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert 0 <= getattr(a.config, name) < vocab, name
    assert a.training is False and a.config.get_text_config()._attn_implementation == "sdpa"


def test_random_mm_inputs_shapes_and_counts():
    qwen = hf.tiny_random_vlm("qwen2_vl")
    mm, count = hf.random_mm_inputs(qwen, images=2)
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4]] * 2 and mm["pixel_values"].shape[0] == 32 and count == 8
    llava = hf.tiny_random_vlm("llava")
    mm, count = hf.random_mm_inputs(llava)
    assert tuple(mm["pixel_values"].shape) == (1, 3, 32, 32) and count == 16
    mm, _ = hf.random_mm_inputs(hf.tiny_random_vlm("mistral3"))
    assert mm["image_sizes"].tolist() == [[32, 32]]


@pytest.mark.parametrize("arch, match", [
    ("llama", "not an image-text-to-text model type"),
    ("mistral4", "cannot build 'mistral4'"),
])
def test_tiny_random_vlm_says_why_not(arch, match):
    with pytest.raises(ValueError, match=match):
        hf.tiny_random_vlm(arch)


@pytest.mark.parametrize("arch, match", [
    ("ovis2", "visual-indicator"),  # REFUSED: it crashed on the encoder's output
    ("shieldgemma2", "bidirectionally"),  # REFUSED: gemma3 under another type (its tiny model passed without token_type_ids)
])
def test_families_refused_with_the_reason(arch, match):
    with pytest.raises(ValueError, match=match):
        hf.HFEngine(hf.tiny_random_vlm(arch), CONFIG, max_num_reqs=2, max_model_len=64, block_size=4,
                    max_num_batched_tokens=8)
