"""mark_token_dim / mark_token_views: one Dynamo graph for every token count, 1 included."""

from __future__ import annotations

import torch

import piecewise_backend as pb
from pbtest.helpers import SIM, TINY_LLAMA, tiny_llama

M = pb.CUDAGraphMode


def test_one_graph_serves_every_token_count_including_one():
    torch._dynamo.reset()
    model = tiny_llama(2)
    compiled = torch.compile(model, backend=pb.make_backend(SIM.replace(cudagraph_mode=M.NONE)))
    with torch.inference_mode():
        ids = torch.arange(8) % TINY_LLAMA["vocab_size"]
        with pb.expect(graphs=1):
            compiled(pb.mark_token_dim(ids.clone()))
            for n in (1, 3, 8):
                torch.testing.assert_close(compiled(ids[:n]), model(ids[:n]))


def test_mark_dynamic_alone_traces_a_second_graph_for_one_token():
    # the behaviour mark_token_dim replaces: if this starts passing with one graph, drop the helper
    torch._dynamo.reset()
    compiled = torch.compile(tiny_llama(2), backend=pb.make_backend(SIM.replace(cudagraph_mode=M.NONE)))
    with torch.inference_mode():
        ids = torch.arange(8) % TINY_LLAMA["vocab_size"]
        torch._dynamo.mark_dynamic(ids, 0)
        with pb.expect(graphs=2):
            compiled(ids)
            compiled(ids[:1])


def test_runner_captures_sizes_one_to_eight_from_one_graph():
    torch._dynamo.reset()
    model = tiny_llama(2)
    config = SIM.replace(capture_sizes=[1, 2, 8], cudagraph_mode=M.PIECEWISE)
    compiled = torch.compile(model, backend=pb.make_backend(config))
    with torch.inference_mode():
        runner = pb.GraphRunner(compiled, config, [pb.StaticInput("input_ids")])
        with pb.expect(graphs=1):
            runner.capture(progress=False)
        ids = torch.arange(5) % TINY_LLAMA["vocab_size"]
        torch.testing.assert_close(runner.run(input_ids=ids), model(ids))


def test_mark_token_views_leaves_per_request_inputs_static():
    class Spec:
        def __init__(self, per):
            self.per = per

    views = {"ids": torch.zeros(4, dtype=torch.long), "blocks": torch.zeros(2, 3, dtype=torch.long)}
    pb.shapes.mark_token_views(views, {"ids": Spec("token"), "blocks": Spec("request")})
    assert 0 in getattr(views["ids"], "_dynamo_unbacked_indices", set())
    assert not getattr(views["blocks"], "_dynamo_unbacked_indices", set())
