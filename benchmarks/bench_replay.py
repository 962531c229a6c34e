"""Python cost of a breakable replay, per segment, against the classic per-piece scheme.

The model has N layers whose pieces are trivial (one tiny ATen op each) and whose
"attention" is a trivial break (a copy into a caller buffer), so what is timed is the
replay machinery, on the simulated platform (CPU):

* ``breakable``: the backend with eager pieces, wrapped in
  ``BreakableCUDAGraphWrapper(PIECEWISE)``: a replay walks the recorded segment list
  (graph, break, graph, ...) and runs no model Python;
* ``per-piece``: the same backend with ``use_breakable=False``: every compiled piece is a
  ``CUDAGraphWrapper(PIECEWISE)``, so a replay runs Dynamo's guards, the split graph's
  Python and one wrapper per piece;
* ``eager_break``: the compile-free path (a plain module whose attention is an
  ``eager_break`` function) in a ``BreakableCUDAGraphWrapper``;
* ``eager``: the same computations without any graph, for scale;
* ``breakable, persistent input``: the breakable variant fed a buffer marked with
  ``pb.mark_persistent`` (what ``GraphRunner`` does with its buffers): the graph reads it in
  place, where a plain caller tensor is first copied into the wrapper's staging buffer (the
  replay contract: a replay never writes into a caller's tensor);
* ``machinery only``: identity breaks between *empty* graph segments: what remains is the
  Python cost of walking the segment list (wrapper call, input check, one replay call per
  segment), without the simulator's ATen ops.

A replay of N layers has 2N+1 segments (N+1 graphs, N breaks); "per segment" divides by that.
"""

from __future__ import annotations

import sys

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import torch
import torch.nn as nn

import piecewise_backend as pb
from benchmarks.common import Section, Variant, fmt_ratio, fmt_spread, measure, raise_recompile_limits, table

M = pb.CUDAGraphMode
WIDTH = 8  # elements per tensor: the ops are as small as they get


@torch.library.custom_op("pb_bench::touch", mutates_args=("out",))
def touch(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)


@pb.eager_break
def touch_break(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(x)
    return out


@pb.eager_break
def identity_break(x: torch.Tensor) -> torch.Tensor:
    return x


class EmptyLayers(nn.Module):
    """N x an identity break and nothing else: empty graph segments, so only the machinery is timed."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = identity_break(x)
        return x


class TrivialOpLayers(nn.Module):
    """N x (one op, then the splitting op ``pb_bench::touch`` into a fresh buffer)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x + 1
            out = torch.empty_like(x)
            torch.ops.pb_bench.touch(x, out)
            x = out
        return x + 1


class TrivialBreakLayers(TrivialOpLayers):
    """The same with an ``eager_break`` Python function as attention (no torch.compile)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x + 1
            x = touch_break(x, torch.empty_like(x))
        return x + 1


def _config(use_breakable: bool) -> pb.CompilationConfig:
    return pb.CompilationConfig(
        cudagraph_mode="PIECEWISE",
        platform="simulated",
        compile_pieces="eager",
        use_breakable=use_breakable,
        splitting_ops=["pb_bench::touch"],
    )


def _ctx(desc: pb.BatchDescriptor):
    return lambda: pb.set_forward_context(M.PIECEWISE, desc)


def _variants(n: int) -> tuple[list[Variant], dict[str, int]]:
    desc = pb.BatchDescriptor(WIDTH)
    x = torch.randn(WIDTH)
    ref = TrivialOpLayers(n)(x)

    brk_cfg, pp_cfg = _config(True), _config(False)
    compiled = torch.compile(TrivialOpLayers(n), backend=pb.make_backend(brk_cfg), dynamic=False)
    compiled(x)  # compile (eager run through the split graph)
    breakable = pb.BreakableCUDAGraphWrapper(compiled, M.PIECEWISE, config=brk_cfg)

    per_piece = torch.compile(TrivialOpLayers(n), backend=pb.make_backend(pp_cfg), dynamic=False)
    per_piece(x)

    eb_model = TrivialBreakLayers(n)
    eb = pb.BreakableCUDAGraphWrapper(eb_model, M.PIECEWISE, config=brk_cfg)
    empty = pb.BreakableCUDAGraphWrapper(EmptyLayers(n), M.PIECEWISE, config=brk_cfg)
    x_static = x.clone()
    pb.mark_persistent(x_static)
    breakable_static = pb.BreakableCUDAGraphWrapper(compiled, M.PIECEWISE, config=brk_cfg)

    variants = [
        Variant(f"N={n} eager (no graphs)", eb_model, (x,)),
        Variant(f"N={n} breakable (backend, eager pieces)", breakable, (x,), _ctx(desc)),
        Variant(f"N={n} per-piece (use_breakable=False)", per_piece, (x,), _ctx(desc)),
        Variant(f"N={n} eager_break + Breakable wrapper", eb, (x,), _ctx(desc)),
        Variant(f"N={n} empty pieces, identity breaks (machinery only)", empty, (x,), _ctx(desc)),
        Variant(f"N={n} breakable, persistent input", breakable_static, (x_static,), _ctx(desc)),
    ]
    # capture now (the first call under PIECEWISE), then check every variant against eager
    segments = {}
    for v in variants:
        with v.context() if v.context else pb.set_forward_context():
            out = v.fn(*v.args)
            out = v.fn(*v.args)
        if v.fn is not empty and not torch.allclose(out, ref):
            raise AssertionError(f"{v.name}: replay differs from eager")
    segments[variants[1].name] = len(breakable.entries[desc].segments)
    segments[variants[3].name] = len(eb.entries[desc].segments)
    segments[variants[4].name] = len(empty.entries[desc].segments)
    return variants, segments


def run(quick: bool = False, deadline: float | None = None) -> list[Section]:
    raise_recompile_limits()
    sizes = (1, 16) if quick else (1, 4, 16)
    rows, ratio_rows, data = [], [], {}
    with torch.inference_mode():
        for n in sizes:
            variants, segments = _variants(n)
            nseg = 2 * n + 1
            for name, count in segments.items():
                if count != nseg:
                    raise AssertionError(f"{name}: {count} segments, expected {nseg}")
            s = measure(variants, reps=9 if quick else 25, target_s=0.02 if quick else 0.05, deadline=deadline)
            for v in variants:
                t = s.times[v.name]
                rows.append([v.name, fmt_spread(t, 1e6, 1), fmt_spread([x / nseg for x in t], 1e6, 2)])
            eager, brk, pp, eb, _, brk_static = (v.name for v in variants)
            ratio_rows.append([
                n, nseg,
                fmt_ratio(s.ratios(brk, pp)),
                fmt_ratio(s.ratios(eb, pp)),
                fmt_ratio(s.ratios(brk, eager)),
                fmt_ratio(s.ratios(brk_static, brk)),
            ])
            data[n] = {"breakable_us": s.median(brk) * 1e6, "per_piece_us": s.median(pp) * 1e6}
    body = (
        "Simulated platform (CPU), tensors of "
        f"{WIDTH} elements, torch.inference_mode; median [p25, p75] over interleaved repetitions.\n\n"
        + table(["variant", "us per replay", "us per segment"], rows)
        + "\n\nRatios, paired per repetition (median [p25, p75]; below 1 means the first is faster):\n\n"
        + table(["N layers", "segments", "breakable / per-piece", "eager_break / per-piece", "breakable / eager",
                 "persistent / staged input"], ratio_rows)
    )
    return [Section("Breakable replay vs per-piece replay (CPU, simulated platform)", body, data)]


if __name__ == "__main__":
    for s in run(quick="--quick" in sys.argv):
        print(s.markdown())
