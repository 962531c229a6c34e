"""transformers' own ``generate`` with this backend: its decode steps replay CUDA graphs, no engine.

A tiny random model of ``--arch`` (nothing downloaded) generates greedily twice: plainly, and with a
static cache compiled by ``torch.compile(backend=pb.make_backend(config))`` through transformers'
``CompileConfig``. The compiled model captures a graph for its decode step by itself (the backend's
standalone capture: a call outside any runner) and replays it every later step. ``--check`` compares
the tokens; the counters say how many graphs were captured and replayed. On a CPU the graphs are the
simulator's (``platform="simulated"``), on a GPU CUDA graphs::

    python examples/compile_generate.py --arch llama --check
"""

from __future__ import annotations

import argparse
import logging

import torch

import piecewise_backend as pb
from piecewise_backend.hf import tiny_random_model


def generate(model: torch.nn.Module, prompt: list[int], new_tokens: int, backend: object = None) -> list[int]:
    """Greedy ``model.generate``; with ``backend``: a static cache compiled with it."""
    import transformers

    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    kw: dict = {}
    if backend is not None:
        config = transformers.CompileConfig(backend=backend)
        config._compile_all_devices = True  # transformers compiles on a GPU only, unless told to
        kw = dict(cache_implementation="static", compile_config=config)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="llama", help="a transformers model type (default llama)")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--experts", default=None, help="a MoE's experts_implementation, e.g. batched_mm (the "
                        "default eager loop reads the routing on the host: no graph)")
    parser.add_argument("--check", action="store_true", help="compare with plain generate")
    args = parser.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    platform = "cuda" if device == "cuda" else "simulated"
    config = pb.CompilationConfig(platform=platform, compile_pieces="inductor" if device == "cuda" else "eager")
    model = tiny_random_model(args.arch, device=device)
    if args.experts:
        model.set_experts_implementation(args.experts)
    prompt = [5, 6, 7, 8, 9]
    before = dict(captures=pb.counters["captures"], replays=pb.counters["replays"])
    tokens = generate(model, prompt, args.new_tokens, pb.make_backend(config))
    captured = pb.counters["captures"] - before["captures"]
    replayed = pb.counters["replays"] - before["replays"]
    print(f"{args.arch} on {platform}: tokens {tokens}")
    print(f"graphs captured: {captured}, replays: {replayed} (of {args.new_tokens - 1} decode steps)")
    if args.check:
        expected = generate(model, prompt, args.new_tokens)
        ok = tokens == expected
        print(f"check: {'tokens equal plain generate' if ok else f'MISMATCH: plain generate gives {expected}'}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
