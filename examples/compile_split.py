"""Compile a small Llama-style model with the piecewise backend and show what it did.

Prints the pieces (which are splitting ops, which are compiled), the compile counters
(identical layers compile once) and the max difference against eager.
Run: python examples/compile_split.py [--layers N] [--pieces inductor|eager]
"""

from __future__ import annotations

import argparse

import torch

import piecewise_backend as pb
from piecewise_backend.toy_llama import make_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pieces", choices=["inductor", "eager"], default="inductor")
    args = parser.parse_args()

    model = make_model(num_layers=args.layers, attention="inplace")
    backend = pb.make_backend(pb.CompilationConfig(compile_pieces=args.pieces))
    compiled = torch.compile(model, backend=backend)

    max_diff = 0.0
    with torch.inference_mode():
        for tokens in (3, 8, 17):
            ids = torch.randint(0, model.cfg.vocab_size, (tokens,))
            torch._dynamo.mark_dynamic(ids, 0)  # one graph for every token count > 1
            max_diff = max(max_diff, (compiled(ids) - model(ids)).abs().max().item())

    for i, split in enumerate(backend.splits):
        print(f"graph {i}: {len(split.pieces)} pieces")
        for p in split.pieces:
            kind = "splitting (runs eagerly, a break point)" if p.is_splitting else f"compiled ({args.pieces})"
            print(f"  {p.index}: {p.name:9s} {kind}")
    c = pb.counters
    print(f"compiled pieces: {c['compiled_pieces']}, Inductor compilations: {c['compiles']}, "
          f"reused for identical pieces: {c['compile_cache_hits']}")
    print(f"max |compiled - eager|: {max_diff:.2e}")
    if not max_diff < 1e-3:
        raise SystemExit("compiled output diverged from eager")


if __name__ == "__main__":
    main()
