"""Image-text-to-text models on CUDA: a tiny LLaVA (encoder graphs over image budgets) and a tiny Qwen2-VL
(encoder graphs per image grid, M-RoPE) served by HFEngine with real CUDA graphs, tokens equal to the model's
own generate. The simulated twin is tests/hf/test_multimodal.py."""

from __future__ import annotations

import copy

import pytest
import torch

import piecewise_backend as pb
from pbtest.helpers import LLAVA_IMAGE, QWEN_IMAGE, tiny_llava, tiny_qwen2_vl, vlm_reference

pytest.importorskip("transformers")
from piecewise_backend import hf

pytestmark = pytest.mark.cuda

CONFIG = pb.CompilationConfig(platform="cuda", capture_sizes=[1, 2, 4, 8])
ENGINE = dict(max_num_reqs=3, max_model_len=64, block_size=4, max_num_batched_tokens=8)


@pytest.mark.parametrize("build", ["llava", "qwen2_vl"])
def test_vlm_replays_encoder_graphs_on_cuda(build):
    model = (tiny_llava if build == "llava" else tiny_qwen2_vl)().cuda()
    reference = copy.deepcopy(model)
    engine = hf.HFEngine(model, CONFIG, **ENGINE)
    engine.capture()
    g = torch.Generator().manual_seed(0)
    if build == "llava":
        mm = {"pixel_values": torch.randn(2, 3, 32, 32, generator=g).cuda()}
        prompt = [1, 5] + [LLAVA_IMAGE] * 32 + [7]
    else:
        mm = {"pixel_values": torch.randn(16, 96, generator=g).cuda(), "image_grid_thw": torch.tensor([[1, 4, 4]]).cuda()}
        prompt = [1, 152] + [QWEN_IMAGE] * 4 + [153, 7]
    text = [3, 4, 9, 10]
    for _ in range(2):  # the second round replays the encoder graph captured in the first (a grid key)
        engine.reset_prefix_cache()
        outs = engine.generate([prompt, text], 6, mm_inputs=[mm, None], eos_token_id=[])
        assert outs == [vlm_reference(reference, prompt, 6, mm), vlm_reference(reference, text, 6, None)]
    assert engine.encoder_graphs.replayed >= 2 and engine.encoder_graphs.eager == 0
