"""Decode step time and per-request memory against context length: state layers against attention.

A state layer keeps a fixed-size state per request (a short convolution's last inputs, a gated
delta net's recurrent matrix), so its decode cost and memory should not depend on how long the
context is; an attention layer reads and holds K/V for every earlier token. Measured side by side
at 256 and 8192 tokens of context, one decode token for each of 4 requests, on tiny random
models through ``HFEngine``'s runner:

* ``Mamba only``: mamba (two Mamba1 mixers; no attention, no KV cache at all);
* ``state only``: lfm2 with short-convolution layers only (no attention either);
* ``hybrid``: qwen3_next, one gated delta net layer and one attention layer;
* ``attention``: llama with two attention layers (the reference for growth).

Steps run eagerly (``cudagraph_mode=NONE``, eager pieces) so that the attention reads the blocks
the context spans; a FULL graph would walk ``max_model_len`` at any context. The contexts are
synthetic: each request's blocks are reserved up to the context and its decode token sits at that
position (the K/V and states hold whatever the cache holds: timing does not depend on values).
"""

from __future__ import annotations

import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import torch

import piecewise_backend as pb
from benchmarks.common import Section, Variant, fmt_ratio, fmt_spread, log, measure, quiet_logs, table

KIB = 2**10
MODELS = (  # name, arch, sizes
    ("Mamba only (mamba, 2 layers)", "mamba", {}),
    ("state only (lfm2, 2 conv layers)", "lfm2", dict(num_hidden_layers=2, layer_types=["conv", "conv"])),
    ("hybrid (qwen3_next, delta net + attention)", "qwen3_next", {}),
    ("attention (llama, 2 layers)", "llama", {}),
)
REQUESTS = 4


def engine_for(arch: str, sizes: dict, max_len: int):
    from piecewise_backend.hf import HFEngine, tiny_random_model

    model = tiny_random_model(arch, max_position_embeddings=max_len, **sizes)
    config = pb.CompilationConfig(cudagraph_mode="NONE", compile_pieces="eager", platform="simulated",
                                  capture_sizes=[REQUESTS])
    # one set of requests per context, alive together: twice the slots and blocks of one step
    return HFEngine(model, config, max_num_reqs=2 * REQUESTS, max_model_len=max_len, block_size=16)


def decode_step(engine, context: int):
    """A callable running one decode step of REQUESTS requests at position ``context``."""
    chunks = [(("ctx", context, r), context, 1) for r in range(REQUESTS)]
    meta = engine.cache.step_inputs(chunks)
    if engine.states is not None:
        meta.update(engine.states.step_inputs(chunks))
    ids = torch.randint(3, engine.vocab_size, (REQUESTS,))

    def step() -> None:
        with torch.inference_mode():
            engine.runner.run(uniform_decode=True, num_reqs=REQUESTS, input_ids=ids, **meta)

    kv_bytes = sum(len(engine.cache.tables[c[0]]) for c in chunks) * engine.cache.block_size * sum(
        t[0, 0].numel() * t.element_size() for t in (*engine.cache.key_caches, *engine.cache.value_caches)
    ) // REQUESTS
    return step, kv_bytes


def run(quick: bool = False, deadline: float | None = None, contexts: tuple[int, int] = (256, 8192)) -> list[Section]:
    torch.set_num_threads(1)
    short, long = contexts
    reps = 5 if quick else 15
    rows, data = [], {}
    with quiet_logs():
        for name, arch, sizes in MODELS:
            if deadline is not None and time.monotonic() > deadline:
                rows.append([name] + ["(out of time)"] * 6)
                continue
            log(f"state: {name}")
            engine = engine_for(arch, sizes, max(contexts) + 16)
            variants, kv = [], {}
            for c in contexts:
                fn, kv[c] = decode_step(engine, c)
                variants.append(Variant(f"{c}", fn, clock="wall"))
            s = measure(variants, reps=reps, deadline=deadline)
            state = engine.states.bytes_per_request if engine.states is not None else 0
            data[arch] = {"median_s": {c: s.median(f"{c}") for c in contexts}, "kv_bytes": kv, "state_bytes": state}
            rows.append([
                name,
                fmt_spread(s.times[f"{short}"], 1e3, 2, " ms"), fmt_spread(s.times[f"{long}"], 1e3, 2, " ms"),
                fmt_ratio(s.ratios(f"{long}", f"{short}")),
                f"{kv[short] / KIB:.0f} / {kv[long] / KIB:.0f}",
                f"{state / KIB:.1f}",
                f"{(engine.states.memory_bytes if engine.states is not None else 0) / KIB:.0f}",
            ])
    headers = ["model", f"decode step, {short} ctx", f"decode step, {long} ctx", f"{long} / {short}",
               f"KV KiB per request ({short} / {long})", "state KiB per request (any ctx)", "state cache KiB (all slots, 2 copies)"]
    body = (
        f"{REQUESTS} requests, one decode token each, eager steps (attention reads the blocks its context spans); "
        "median [quartiles] over interleaved repetitions, wall clock, 1 thread.\n\n" + table(headers, rows)
    )
    return [Section("State layers: decode step and memory against context length (CPU)", body, data)]


if __name__ == "__main__":
    for section in run(quick="--quick" in sys.argv):
        print(section.markdown())
