"""HF models with DeepSeek-V3.2-style indexed (sparse) attention through HFEngine (hf/indexed.py, kv/indexed.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from pbtest.helpers import load_file

import piecewise_backend as pb
from piecewise_backend.kv import indexed as kv_indexed

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every engine here compiles the same code objects: reset Dynamo's recompile counts between tests."""
    torch._dynamo.reset()


CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 16])
PROMPT_LENS, BUDGETS = (6, 11, 3), [5, 7, 9]


def serve(model: torch.nn.Module, capture: bool = True, **kwargs) -> tuple[list[list[int]], list[list[int]], list, hf.HFEngine]:
    """Three requests that join and finish at different steps; prompts longer than the tiny index_topk (4)."""
    engine = hf.HFEngine(model, CONFIG, max_num_reqs=3, max_model_len=32, block_size=4, **kwargs)
    if capture:
        engine.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    steps: list[hf.StepInfo] = []
    outputs = engine.generate(prompts, BUDGETS, on_step=steps.append)
    return prompts, outputs, steps, engine


def check(reference, prompts, outputs) -> list:
    return load_file("examples/hf_generate.py").check(reference, prompts, outputs, BUDGETS, eos=None)


# one per indexer family: half-split RoPE (deepseek_v32), interleaved with shared-index layers (glm_moe_dsa),
# RoPE on the head's last part with sinks and the scale on the head weights (hy_v4)
@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa", "hy_v4"])
def test_engine_serves_indexed_attention_like_generate(arch):
    model = hf.tiny_random_model(arch)
    assert model.config.get_text_config().index_topk < max(PROMPT_LENS)  # the selection drops tokens
    reference = copy.deepcopy(model)
    prompts, outputs, steps, engine = serve(model)
    assert {s.mode for s in steps} >= {pb.CUDAGraphMode.PIECEWISE, pb.CUDAGraphMode.FULL}, steps
    assert engine.cache.indexer_caches, "the cache keeps indexer keys"
    assert check(reference, prompts, outputs) == []


def test_a_wrong_selection_changes_the_tokens(monkeypatch):
    """The control: an indexer that picks the first positions instead of the best differs from generate."""
    def first_positions(q, weights, index_cache, positions, request_index, block_tables, scale, topk):
        pos = torch.arange(topk, device=q.device).expand(q.shape[0], topk)
        return pos.masked_fill(pos > positions[: q.shape[0], None], -1)

    monkeypatch.setattr(kv_indexed, "index_topk", first_positions)
    model = hf.tiny_random_model("deepseek_v32")
    reference = copy.deepcopy(model)
    prompts, outputs, _, _ = serve(model, capture=False)
    assert check(reference, prompts, outputs) != []


def test_chunked_prefill_preemption_and_lazy_capture_keep_the_indexer_keys_right():
    """Prompts prefilled 4 tokens a step score the keys of their earlier chunks; preempted requests are
    recomputed into new blocks; with lazy capture on, steps without a graph run eagerly."""
    model = hf.tiny_random_model("deepseek_v32")
    reference = copy.deepcopy(model)
    prompts, outputs, steps, _ = serve(model, capture=False, num_blocks=6, max_num_batched_tokens=4, lazy_capture=True)
    assert any(s.preempted for s in steps), steps
    assert max(s.num_tokens for s in steps) <= 4
    assert check(reference, prompts, outputs) == []


@pytest.mark.parametrize("arch, match", [
    ("qwen4_exp_text", r"Qwen4ExpTextQSAIndexer .* pooled or compressed key blocks is not built"),
    ("deepseek_v4", r"compressed_sparse_attention.*does not hold"),
])
def test_other_sparse_attention_is_refused_naming_what_is_missing(arch, match):
    model = hf.tiny_random_model(arch)
    assert "indexed_attention" in model.config.get_text_config().layer_types or arch == "deepseek_v4"
    with pytest.raises(ValueError, match=match):
        hf.HFEngine(model, CONFIG, max_num_reqs=2, max_model_len=16, block_size=4)
