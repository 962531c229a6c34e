"""Tensor parallel admission (issue 46 item 3): ranks given different requests are refused on every rank before
the step runs, naming the request and the field; the same requests are served as on one rank. Two gloo ranks
(``dist_harness``), each with examples/own_model.py's decoder (not sharded: the check is the serving loop's)."""

from __future__ import annotations

from typing import Any

import pytest

import piecewise_backend as pb
from pbtest.dist_harness import oks, run_ranks
from pbtest.helpers import load_file
from piecewise_backend import serve
from piecewise_backend.serve import admission
from piecewise_backend.serve.scheduler import Request

PROMPTS = [[5, 7, 9], [3, 1, 4, 1]]


def _engine() -> tuple[serve.Engine, Any]:
    own = load_file("examples/own_model.py")
    config = pb.CompilationConfig(cudagraph_mode="NONE", platform="simulated", compile_pieces="eager")
    engine = serve.Engine(own.make_model(), config, kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=2,
                          max_model_len=32, block_size=4)
    return engine, own


def _worker_admission(rank: int, mesh: Any) -> dict[str, Any]:
    engine, own = _engine()
    said: dict[str, Any] = {}
    sampling = None if rank == 0 else serve.SamplingParams(temperature=1.0, seed=7)  # rank 0 greedy, rank 1 seeded
    for case, kwargs in (("sampling", dict(prompts=PROMPTS, sampling=sampling)),
                         ("prompt", dict(prompts=[PROMPTS[0], [3, 1, 4, rank]])),
                         ("count", dict(prompts=PROMPTS[: rank + 1]))):
        try:
            engine.generate(kwargs.pop("prompts"), 4, **kwargs)
            said[case] = "served"
        except ValueError as e:
            said[case] = str(e)
    online = engine.add_request(PROMPTS[0], 4, stop_token_ids=[rank])  # the online API: ended with "error"
    try:
        engine.step()
    except ValueError:
        pass
    said["online"] = [(r.request_id, r.finish_reason) for r in engine.step()]
    said["online_id"] = online
    said["same"] = engine.generate(PROMPTS, 4) == [own.reference(own.make_model(), p, 4) for p in PROMPTS]
    return said


def test_ranks_given_different_requests_are_refused_on_every_rank_naming_the_field():
    r0, r1 = oks(run_ranks(_worker_admission, timeout_s=240))
    for said in (r0, r1):
        assert "request 0 (number 1 of those added before this step) has a different sampling on each rank (rank 0: ('greedy',), rank 1: (1.0, 0, 1.0," in said["sampling"]
        assert "request 1 (number 2 of those added before this step) has a different prompt on each rank " \
               "(rank 0: [3, 1, 4, 0], rank 1: [3, 1, 4, 1])" in said["prompt"]
        assert "added different numbers of requests before this step (rank 0: 1, rank 1: 2)" in said["count"]
        assert said["online"] == [(said["online_id"], "error")]
        assert said["same"]  # the same requests on every rank: served, as on one rank


def test_request_fields_tell_each_field_apart():
    def request(budget: int = 3, **kw: Any) -> Request:
        return Request("a", kw.get("prompt", [1, 2]), budget, kw.get("sampling", serve.sampling.GREEDY), 0,
                       frozenset(kw.get("stops", ())), 0, cache_salt=kw.get("salt"))

    fields = admission.request_fields(request())
    assert len(fields) == len(admission.FIELDS) == 5 and len(set(fields)) == 5
    for name, other in (("prompt", request(prompt=[1, 3])), ("max_new_tokens", request(4)),
                        ("stop_token_ids", request(stops=[2])),
                        ("sampling", request(sampling=serve.SamplingParams(temperature=0.5))),
                        ("cache_salt", request(salt="tenant"))):
        changed = [n for n, a, b in zip(admission.FIELDS, fields, admission.request_fields(other)) if a != b]
        assert changed == [name]
