"""transformers' own generate with a static cache and CompileConfig(backend=make_backend(config)): its decode
steps replay the backend's graphs, tokens equal plain generate (backend/standalone.py); simulated platform."""

from __future__ import annotations

import logging

import pytest
import torch

import piecewise_backend as pb

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf

CFG = pb.CompilationConfig(platform="simulated", compile_pieces="eager")
PROMPT = [5, 6, 7, 8, 9]
NEW = 8


def _generate(model, **kw):
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(PROMPT):].tolist()


def compiled_generate(model) -> list[int]:
    config = transformers.CompileConfig(backend=pb.make_backend(CFG))  # generate deep-copies it, backend included
    config._compile_all_devices = True  # transformers compiles on a CPU only when told to
    return _generate(model, cache_implementation="static", compile_config=config)


# MoE experts through batched_mm: the default eager experts loop reads the routing on the host (no graph, said)
@pytest.mark.parametrize("arch, experts", [("llama", None), ("qwen3", None), ("mixtral", "batched_mm"),
                                           ("qwen3_next", "batched_mm"), ("mamba2", None)])
def test_generate_replays_graphs_for_its_decode_steps(arch, experts):
    torch._dynamo.reset()
    model = hf.tiny_random_model(arch)
    if experts is not None:
        model.set_experts_implementation(experts)
    expected = _generate(model)
    before = pb.counters["replays"]
    with pb.expect(captures=1):
        got = compiled_generate(model)
    assert got == expected
    # NEW - 1 decode calls (the prefill runs uncompiled): the first warms up, the second captures and replays
    assert pb.counters["replays"] - before == NEW - 2


def test_what_gives_no_graph_is_said_and_tokens_stay_equal(caplog):
    """gemma3's sliding-window StaticCache passes a length that grows every step (a new signature each
    call) and mixtral's eager experts read the routing on the host: no graph, one message each, equal tokens."""
    for arch, says in (("gemma3_text", "every call brings a new input signature"), ("mixtral", "capturing failed")):
        torch._dynamo.reset()
        model = hf.tiny_random_model(arch)
        expected = _generate(model)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="piecewise_backend"), pb.expect(replays=0):
            got = compiled_generate(model)
        assert got == expected
        said = [r.getMessage() for r in caplog.records if says in r.getMessage()]
        assert len(said) == 1, (arch, [r.getMessage() for r in caplog.records])
