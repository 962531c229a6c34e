"""Image-text-to-text models on HFEngine (hf/multimodal/): images in requests beside text-only ones,
chunked prefill through image tokens, M-RoPE, preemption, prefix caching keyed by image content, bad
inputs refused at add_request; tokens equal to the model's own ``generate``. Simulated platform."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import piecewise_backend as pb

transformers = pytest.importorskip("transformers")
from pbtest.helpers import LLAVA_IMAGE, QWEN_IMAGE, tiny_llava, tiny_qwen2_5_vl, tiny_qwen2_vl, vlm_reference

from piecewise_backend import hf
from piecewise_backend.hf import multimodal

SIZES = [1, 2, 4, 8]
CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=SIZES)
ENGINE = dict(max_num_reqs=3, max_model_len=64, block_size=4)
TEXT = [3, 4, 9, 10]


@pytest.fixture(autouse=True)
def _cheap_gc(monkeypatch):
    monkeypatch.setattr(gc, "collect", lambda *a: 0)


def pixels(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def llava_prompt(images: int) -> list[int]:
    return [1, 5, 6] + [LLAVA_IMAGE] * (16 * images) + [7, 8]


def qwen_image(h: int, w: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(h * w, 96, generator=g), "image_grid_thw": torch.tensor([[1, h, w]])}


def qwen_images(*images: dict) -> dict:
    return {k: torch.cat([i[k] for i in images]) for k in images[0]}


@pytest.fixture(scope="module")
def llava():
    model = tiny_llava()
    reference = copy.deepcopy(model)
    return hf.HFEngine(model, CONFIG, max_num_batched_tokens=8, **ENGINE), reference


@pytest.fixture(scope="module")
def qwen():
    model = tiny_qwen2_vl()
    reference = copy.deepcopy(model)
    return hf.HFEngine(model, CONFIG, max_num_batched_tokens=8, **ENGINE), reference


def test_llava_images_beside_text_chunked(llava):
    """Two image prompts (one with two images) and a text-only one in one batch, every prompt cut into
    8-token chunks (through the image tokens): tokens equal generate's; other pixels give other tokens."""
    engine, reference = llava
    engine.capture()
    engine.reset_prefix_cache()
    one, two = {"pixel_values": pixels(1, 1)}, {"pixel_values": pixels(2, 2)}
    before = pb.counters["replays"]
    outs = engine.generate([llava_prompt(1), TEXT, llava_prompt(2)], 6, mm_inputs=[one, None, two], eos_token_id=[])
    assert outs == [vlm_reference(reference, llava_prompt(1), 6, one), vlm_reference(reference, TEXT, 6, None),
                    vlm_reference(reference, llava_prompt(2), 6, two)]
    assert pb.counters["replays"] > before  # the text model's steps replay graphs
    other = engine.generate([llava_prompt(1)], 6, mm_inputs=[{"pixel_values": pixels(1, 7)}], eos_token_id=[])
    assert other[0] != outs[0]


def test_qwen2_vl_mrope(qwen):
    """M-RoPE: per-request 3-D positions and rope deltas (two images of different grids in one prompt, a
    text-only request beside), chunked prefill; tokens equal generate's."""
    engine, reference = qwen
    engine.capture()
    a, b = qwen_image(4, 4, 1), qwen_image(4, 8, 2)
    p1 = [1, 5, 152] + [QWEN_IMAGE] * 4 + [153, 7, 8]
    p3 = [1, 152] + [QWEN_IMAGE] * 8 + [153, 6, 152] + [QWEN_IMAGE] * 4 + [153, 9]
    both = qwen_images(b, a)
    outs = engine.generate([p1, TEXT, p3], 6, mm_inputs=[a, None, both], eos_token_id=[])
    assert outs == [vlm_reference(reference, p1, 6, a), vlm_reference(reference, TEXT, 6, None),
                    vlm_reference(reference, p3, 6, both)]
    images = multimodal.Admit(reference)(p3, both, "request 0")
    assert images.delta != 0 and images.rope.shape == (len(p3), 3)  # the case 1-D positions would get wrong


def test_online_inputs_copied(llava):
    """add_request copies mm_inputs: the caller may reuse its tensor at once."""
    engine, reference = llava
    engine.reset_prefix_cache()
    mine = pixels(1, 3)
    want = vlm_reference(reference, llava_prompt(1), 5, {"pixel_values": mine.clone()})
    rid = engine.add_request(llava_prompt(1), 5, mm_inputs={"pixel_values": mine}, stop_token_ids=[])
    mine.zero_()
    outs = {o.request_id: o.token_ids for o in engine.results()}
    assert outs[rid] == want


def test_preempted_request_encodes_again(monkeypatch):
    """Too few blocks for both: the newest is preempted, comes back, its encoder runs again; tokens exact."""
    model = tiny_llava()
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, CONFIG, max_num_batched_tokens=8, num_blocks=10, enable_prefix_caching=False,
                         **ENGINE)
    calls = []
    real = multimodal.step.encode
    monkeypatch.setattr(multimodal.step, "encode", lambda m, images: calls.append(1) or real(m, images))
    mms = [{"pixel_values": pixels(1, 4)}, {"pixel_values": pixels(1, 5)}]
    steps = []
    outs = engine.generate([llava_prompt(1)] * 2, 16, mm_inputs=mms, eos_token_id=[], on_step=steps.append)
    assert any(s.preempted for s in steps)
    assert outs == [vlm_reference(reference, llava_prompt(1), 16, mm) for mm in mms]
    assert len(calls) + engine.encoder_graphs.replayed > 2


def test_prefix_cache_keys_hold_the_images(llava):
    """The same prompt with the same image reuses its blocks; with another image it shares none."""
    engine, reference = llava
    engine.reset_prefix_cache()
    mm, other = {"pixel_values": pixels(1, 8)}, {"pixel_values": pixels(1, 9)}
    first = engine.add_request(llava_prompt(1), 4, mm_inputs=mm, stop_token_ids=[])
    list(engine.results())
    ids = [engine.add_request(llava_prompt(1), 4, mm_inputs=m, stop_token_ids=[]) for m in (other, mm)]
    outs = {o.request_id: o for o in engine.results()}
    assert first not in outs
    assert outs[ids[0]].num_cached_tokens == 0 and outs[ids[1]].num_cached_tokens > 0
    assert outs[ids[0]].token_ids == vlm_reference(reference, llava_prompt(1), 4, other)
    assert outs[ids[1]].token_ids == vlm_reference(reference, llava_prompt(1), 4, mm)


@pytest.mark.parametrize("prompt, mm, match", [
    (llava_prompt(1)[:-6], {"pixel_values": pixels(1, 0)}, "make 16 image tokens, the prompt holds 12"),
    (llava_prompt(2), {"pixel_values": pixels(1, 0)}, "make 16 image tokens, the prompt holds 32"),
    (llava_prompt(1), {"pixel_values": torch.randn(1, 3, 16, 16)}, r"pixel_values must be \(images, 3, 32, 32\)"),
    (llava_prompt(1), None, "holds 16 image tokens .* but no mm_inputs"),
    (TEXT, {"pixel_values": pixels(1, 0)}, "the prompt holds no image token"),
    (llava_prompt(1), {"pixel_values": pixels(1, 0), "pixel_values_videos": pixels(1, 0)}, "video inputs"),
    (llava_prompt(1), {"pixel_values": pixels(1, 0), "colour": torch.ones(1)}, r"\['colour'\] are not keyword inputs"),
    (llava_prompt(1), [pixels(1, 0)], "must be a non-empty dict"),
])
def test_bad_inputs_refused_at_add_request(llava, prompt, mm, match):
    engine, reference = llava
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, 3, mm_inputs=mm)
    assert not engine.has_unfinished_requests()
    assert engine.generate([TEXT], 3, eos_token_id=[]) == [vlm_reference(reference, TEXT, 3, None)]


def test_qwen_grid_mismatch_refused(qwen):
    engine, _ = qwen
    p = [1, 152] + [QWEN_IMAGE] * 4 + [153]
    bad = {"pixel_values": torch.randn(12, 96), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ValueError, match=r"do not match image_grid_thw \[\[1, 4, 4\]\]: it needs \(16, patch features\)"):
        engine.add_request(p, 3, mm_inputs=bad)
    with pytest.raises(ValueError, match="make 8 image tokens, the prompt holds 4"):
        engine.add_request(p, 3, mm_inputs=qwen_image(4, 8, 0))


def test_generate_mm_inputs_one_per_prompt(llava):
    engine, _ = llava
    with pytest.raises(ValueError, match=r"one dict \(or None\) per prompt \(2\), got list of 1"):
        engine.generate([TEXT, TEXT], 3, mm_inputs=[None])


def test_text_model_refuses_mm_inputs():
    engine = hf.HFEngine(hf.tiny_random_model("llama"), CONFIG, **ENGINE)
    with pytest.raises(ValueError, match="serves a text-only model"):
        engine.add_request([1, 2, 3], 2, mm_inputs={"pixel_values": pixels(1, 0)})
    assert not engine.has_unfinished_requests()


def test_only_the_text_model_gets_the_paged_attention(llava):
    engine, _ = llava
    model = engine.model
    assert model.config.get_text_config()._attn_implementation == hf.ATTN_IMPLEMENTATION
    assert model.config.vision_config._attn_implementation != hf.ATTN_IMPLEMENTATION


def test_no_dynamo_and_lazy_capture():
    """compile_pieces="none" with lazy capture: served before any graph, then replays; tokens exact."""
    model = tiny_qwen2_vl()
    reference = copy.deepcopy(model)
    config = pb.CompilationConfig(platform="simulated", compile_pieces="none", capture_sizes=SIZES)
    engine = hf.HFEngine(model, config, lazy_capture=True, step_capture_budget_s=0, max_num_batched_tokens=8,
                         **ENGINE)
    a = qwen_image(4, 4, 3)
    p = [1, 5, 152] + [QWEN_IMAGE] * 4 + [153, 7, 8]
    assert engine.generate([p, TEXT], 5, mm_inputs=[a, None], eos_token_id=[]) == [
        vlm_reference(reference, p, 5, a), vlm_reference(reference, TEXT, 5, None)]
    assert engine.capture_idle(60)
    before = pb.counters["replays"]
    assert engine.generate([TEXT, p], 5, mm_inputs=[None, a], eos_token_id=[]) == [
        vlm_reference(reference, TEXT, 5, None), vlm_reference(reference, p, 5, a)]
    assert pb.counters["replays"] > before


@pytest.mark.parametrize("arch", sorted(multimodal.REFUSED))
def test_refused_families_name_the_reason(arch):
    config = transformers.AutoConfig.for_model(arch)
    model = type("Fake", (), {"config": config})()
    why = multimodal.refusal(model, CONFIG, pb.serve.EngineArgs(), tensor_parallel=False)
    assert why is not None and multimodal.REFUSED[arch] in why


def test_split_inputs_of_a_batch(llava, qwen):
    """A processor's batched output cut into one dict per prompt (None for a text-only prompt)."""
    engine, reference = llava
    pads = max(len(llava_prompt(2)), len(TEXT))
    prompts = [llava_prompt(2), TEXT, llava_prompt(1)]
    ids = torch.tensor([p + [0] * (pads - len(p)) for p in prompts])
    px = pixels(3, 11)
    split = multimodal.split_inputs({"input_ids": ids, "pixel_values": px}, reference)
    assert split[1] is None and torch.equal(split[0]["pixel_values"], px[:2]) and torch.equal(split[2]["pixel_values"], px[2:])
    _, qref = qwen
    a, b = qwen_image(4, 4, 1), qwen_image(4, 8, 2)
    q = [[1] + [QWEN_IMAGE] * 8 + [2], [1] + [QWEN_IMAGE] * 4 + [0] * 5]
    split = multimodal.split_inputs({"input_ids": torch.tensor(q), **qwen_images(b, a)}, qref)
    assert torch.equal(split[0]["pixel_values"], b["pixel_values"]) and split[1]["image_grid_thw"].tolist() == [[1, 4, 4]]
    with pytest.raises(ValueError, match="prompt 0 holds 7 image tokens; its images make 8"):
        multimodal.split_inputs({"input_ids": torch.tensor([q[0][:-2]]), **b}, qref)


def test_encoder_replays_graphs_over_image_budgets(llava):
    """The images of a step packed into the smallest budget that holds them: two requests of 1 and 2 images
    prefilled in one step replay the 4-image graph once; tokens exact. A step budget beyond the image-token
    buffers is refused."""
    with pytest.raises(ValueError, match="built for steps of at most 8 tokens"):
        llava[0].max_num_batched_tokens = 64
    model = tiny_llava()
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, CONFIG, max_num_batched_tokens=64, **ENGINE)
    graphs = engine.encoder_graphs
    assert graphs.budgets == (1, 2, 4, 8)
    engine.capture()
    assert graphs.captured == 4
    one, two = {"pixel_values": pixels(1, 12)}, {"pixel_values": pixels(2, 13)}
    short = [LLAVA_IMAGE] * 16 + [7]
    replayed, replays = graphs.replayed, pb.counters["replays"]
    outs = engine.generate([short, [LLAVA_IMAGE] * 32 + [8]], 4, mm_inputs=[one, two], eos_token_id=[])
    assert graphs.replayed == replayed + 1 and graphs.eager == 0
    assert pb.counters["replays"] > replays
    assert outs == [vlm_reference(reference, short, 4, one), vlm_reference(reference, [LLAVA_IMAGE] * 32 + [8], 4, two)]


def test_encoder_token_budgets():
    """Budgets in image tokens become images per graph; more images than the largest run eagerly, exactly."""
    model = tiny_llava()
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, CONFIG, encoder_token_budgets=[16, 40], **ENGINE)
    assert engine.encoder_graphs.budgets == (1, 2)
    assert engine.estimate_capture_memory() > sum(m.runner.estimate_capture_memory() for m in engine.model_runners)
    engine.capture()
    three = {"pixel_values": pixels(3, 14)}
    prompt = [LLAVA_IMAGE] * 48 + [9]
    assert engine.generate([prompt], 3, mm_inputs=[three], eos_token_id=[]) == [vlm_reference(reference, prompt, 3, three)]
    assert engine.encoder_graphs.eager == 1
    with pytest.raises(ValueError, match="each is fewer than the 16 tokens of one image"):
        hf.HFEngine(tiny_llava(), CONFIG, encoder_token_budgets=[8], **ENGINE)
    with pytest.raises(ValueError, match="encoder_token_budgets must be None or a non-empty list"):
        hf.HFEngine(tiny_llava(), CONFIG, encoder_token_budgets=[0], **ENGINE)
    with pytest.raises(ValueError, match="this engine serves a text-only model"):
        hf.HFEngine(hf.tiny_random_model("llama"), CONFIG, encoder_token_budgets=[16], **ENGINE)


def test_lazy_encoder_graphs_captured_in_idle_time():
    """A lazy engine encodes eagerly until capture_idle captures the image budgets steps asked for."""
    model = tiny_llava()
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, CONFIG, lazy_capture=True, step_capture_budget_s=0, **ENGINE)
    graphs = engine.encoder_graphs
    mm = {"pixel_values": pixels(1, 15)}
    want = vlm_reference(reference, llava_prompt(1), 3, mm)
    assert engine.generate([llava_prompt(1)], 3, mm_inputs=[mm], eos_token_id=[]) == [want]
    assert (graphs.eager, graphs.replayed, graphs.captured, graphs.demand) == (1, 0, 0, {1})
    captured = engine.capture_idle(60)
    assert (pb.CUDAGraphMode.FULL, pb.BatchDescriptor(1)) in captured and graphs.captured == 1
    engine.reset_prefix_cache()
    assert engine.generate([llava_prompt(1)], 3, mm_inputs=[mm], eos_token_id=[]) == [want]
    assert graphs.replayed == 1


def test_speculative_and_micro_batching_refused_up_front():
    model = tiny_llava()
    with pytest.raises(ValueError, match="SpecEngine does not serve image-text-to-text models yet"):
        hf.SpecEngine(model, hf.tiny_random_model("llama"), CONFIG, num_speculative_tokens=2, **ENGINE)
    with pytest.raises(ValueError, match="micro-batching"):
        hf.HFEngine(model, CONFIG.replace(use_ubatching=True), **ENGINE)
    assert model.config.get_text_config()._attn_implementation == "sdpa"  # nothing changed


def test_encoder_mismatch_ends_that_request_only(monkeypatch):
    """A family whose image token count only the encoder tells: a request whose features do not match its
    image tokens ends with finish_reason="error" naming both counts; the others in its step are served."""
    model = tiny_llava()
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, CONFIG.replace(cudagraph_mode="NONE"), **ENGINE)
    assert engine.encoder_graphs is None  # no graphs: the encoder runs eagerly
    monkeypatch.setattr(multimodal.Admit, "image_tokens", lambda self, inputs, where: None)
    bad = engine.add_request(llava_prompt(2), 3, mm_inputs={"pixel_values": pixels(1, 0)}, stop_token_ids=[])
    good = engine.add_request(TEXT, 3, stop_token_ids=[])
    outs = {o.request_id: o for o in engine.results()}
    assert outs[bad].finish_reason == "error" and "its images make 16 image features, its prompt holds 32" in outs[bad].error
    assert outs[good].token_ids == vlm_reference(reference, TEXT, 3, None)


def test_sampling_and_streaming(llava):
    """Seeded sampling with images: the same seed gives the same tokens, streamed as they are produced."""
    engine, _ = llava
    engine.reset_prefix_cache()
    mm = {"pixel_values": pixels(1, 16)}
    params = hf.SamplingParams(temperature=0.9, top_k=20, seed=7)
    streamed = []
    first = engine.generate([llava_prompt(1), TEXT], 6, mm_inputs=[mm, None], sampling=params, eos_token_id=[],
                            on_token=lambda i, t: streamed.append((i, t)))
    assert [t for i, t in streamed if i == 0] == first[0] and [t for i, t in streamed if i == 1] == first[1]
    engine.reset_prefix_cache()
    assert engine.generate([llava_prompt(1), TEXT], 6, mm_inputs=[mm, None], sampling=params, eos_token_id=[]) == first


def test_qwen2_vl_encoder_graphs_per_grid(monkeypatch):
    """Qwen2-VL's tower as a graph per image grid: captured on first sight (its host reads computed outside
    the capture), replayed for the same grids, eager past max_graphs; tokens equal generate's."""
    model = tiny_qwen2_vl()
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, CONFIG, **ENGINE)
    graphs = engine.encoder_graphs
    assert isinstance(graphs, hf.multimodal.encoder_graphs.GridEncoderGraphs)
    a, b = qwen_image(4, 4, 5), qwen_image(4, 8, 6)
    p1 = [1, 152] + [QWEN_IMAGE] * 4 + [153, 7]
    p2 = [1, 152] + [QWEN_IMAGE] * 8 + [153, 8]
    outs = engine.generate([p1, p2], 4, mm_inputs=[a, b], eos_token_id=[])
    assert outs == [vlm_reference(reference, p1, 4, a), vlm_reference(reference, p2, 4, b)]
    first = (graphs.captured, graphs.replayed)
    assert first[0] >= 1 and first[1] >= 1 and graphs.eager == 0
    engine.reset_prefix_cache()
    before = pb.counters["replays"]
    assert engine.generate([p1, p2], 4, mm_inputs=[a, b], eos_token_id=[]) == outs
    assert graphs.captured == first[0] and graphs.replayed > first[1] and pb.counters["replays"] > before
    monkeypatch.setattr(graphs, "max_graphs", graphs.captured)
    c = qwen_image(8, 4, 7)
    assert engine.generate([p2], 4, mm_inputs=[c], eos_token_id=[]) == [vlm_reference(reference, p2, 4, c)]
    assert graphs.eager == 1
    with pytest.raises(ValueError, match="keyed by the images' grids"):
        hf.HFEngine(tiny_qwen2_vl(), CONFIG, encoder_token_budgets=[16], **ENGINE)


def test_qwen2_vl_lazy_grid_graphs():
    model = tiny_qwen2_vl()
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, CONFIG, lazy_capture=True, step_capture_budget_s=0, **ENGINE)
    graphs = engine.encoder_graphs
    a = qwen_image(4, 4, 8)
    p = [1, 152] + [QWEN_IMAGE] * 4 + [153, 7]
    want = [vlm_reference(reference, p, 3, a)]
    assert engine.generate([p], 3, mm_inputs=[a], eos_token_id=[]) == want
    assert (graphs.eager, graphs.captured, list(graphs.demand)) == (1, 0, [((1, 4, 4),)])
    engine.capture_idle(60)
    assert graphs.captured == 1
    engine.reset_prefix_cache()
    assert engine.generate([p], 3, mm_inputs=[a], eos_token_id=[]) == want and graphs.replayed == 1


@pytest.mark.parametrize("build", [tiny_qwen2_vl, tiny_qwen2_5_vl], ids=["qwen2_vl", "qwen2_5_vl"])
def test_grid_graphs_equal_the_tower(build):
    """A grid graph's features equal the tower's own eager forward (two images; qwen2.5-vl's windowed layer
    attends within windows, its full layer over each image); tokens equal generate's, chunked."""
    model = build()
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, CONFIG, max_num_batched_tokens=8, **ENGINE)
    graphs = engine.encoder_graphs
    both = qwen_images(qwen_image(8, 8, 1), qwen_image(4, 12, 2))
    with torch.inference_mode():
        got = graphs(both["pixel_values"], both["image_grid_thw"])
        want = graphs.encode_eagerly(both["pixel_values"], both["image_grid_thw"])
    assert graphs.replayed == 1 and torch.allclose(got, want, atol=1e-6, rtol=0)
    p = [1, 152] + [QWEN_IMAGE] * 16 + [153, 152] + [QWEN_IMAGE] * 12 + [153, 7]
    assert engine.generate([p, TEXT], 4, mm_inputs=[both, None], eos_token_id=[]) == [
        vlm_reference(reference, p, 4, both), vlm_reference(reference, TEXT, 4, None)]


def test_a_failed_build_leaves_a_deepstack_model_as_it_was(monkeypatch):
    """qwen3-vl's deepstack step is swapped on its text model by the layout: an engine that fails to build
    afterwards (here: its runner) leaves the model unadapted, the swap undone."""
    from piecewise_backend.hf import engine as hf_engine
    from piecewise_backend.hf.modality import text_model

    model = hf.tiny_random_vlm("qwen3_vl")
    assert multimodal.deepstack_layers(model) > 0

    def broken(*args, **kwargs):
        raise RuntimeError("runner failed")

    monkeypatch.setattr(hf_engine, "ModelRunner", broken)
    with pytest.raises(RuntimeError, match="runner failed"):
        hf.HFEngine(model, CONFIG, **ENGINE)
    assert "_deepstack_process" not in vars(text_model(model))
    assert model.config.get_text_config()._attn_implementation != hf.ATTN_IMPLEMENTATION


def test_from_pretrained_loads_an_image_text_to_text_checkpoint(tmp_path):
    """HFEngine.from_pretrained picks AutoModelForImageTextToText for a llava folder; tokens equal generate's."""
    model = tiny_llava()
    model.save_pretrained(tmp_path)
    engine = hf.HFEngine.from_pretrained(tmp_path, CONFIG, **ENGINE)
    assert type(engine.model).__name__ == "LlavaForConditionalGeneration"
    mm = {"pixel_values": pixels(1, 17)}
    assert engine.generate([llava_prompt(1)], 3, mm_inputs=[mm], eos_token_id=[]) == [
        vlm_reference(model, llava_prompt(1), 3, mm)]
