"""Passthrough cost of the capture wrappers: what a wrapper adds when it does not capture.

A wrapper that is not meant to capture the current step (no forward context, runtime
mode NONE, or a mode it does not match) must call its runnable straight through. The
runnable here is a Python function returning its input, so the wrapper's own cost
dominates. Goal: at most 500 ns added per wrapper (per break point outside a capture).
"""

from __future__ import annotations

import sys

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import torch

import piecewise_backend as pb
from benchmarks.common import Section, Variant, fmt_spread, measure, table, verdict

GOAL_NS = 500.0
M = pb.CUDAGraphMode
D1 = pb.BatchDescriptor(1)
SIM = pb.CompilationConfig(platform="simulated", compile_pieces="eager")


def ident(x):
    return x


def _ctx(mode):
    return lambda: pb.set_forward_context(mode, None if mode == M.NONE else D1)


def variants() -> list[tuple[Variant, int]]:
    """(variant, number of wrapper layers it adds) -- the first one is the baseline."""
    x = torch.zeros(1)
    full = pb.CUDAGraphWrapper(ident, M.FULL, config=SIM)
    brk_pw = pb.BreakableCUDAGraphWrapper(ident, M.PIECEWISE, config=SIM)
    brk_any = pb.BreakableCUDAGraphWrapper(ident, config=SIM)
    stack = pb.CUDAGraphWrapper(pb.BreakableCUDAGraphWrapper(ident, M.PIECEWISE, config=SIM), M.FULL, config=SIM)
    decorated = pb.eager_break(ident)
    bp = pb.BreakPoint(ident, "ident")
    return [
        (Variant("direct call ident(x)", ident, (x,)), 0),
        (Variant("CUDAGraphWrapper(FULL), no context", full, (x,)), 1),
        (Variant("CUDAGraphWrapper(FULL), mode NONE", full, (x,), _ctx(M.NONE)), 1),
        (Variant("CUDAGraphWrapper(FULL) under PIECEWISE", full, (x,), _ctx(M.PIECEWISE)), 1),
        (Variant("Breakable(PIECEWISE), no context", brk_pw, (x,)), 1),
        (Variant("Breakable(PIECEWISE), mode NONE", brk_pw, (x,), _ctx(M.NONE)), 1),
        (Variant("Breakable(PIECEWISE) under FULL", brk_pw, (x,), _ctx(M.FULL)), 1),
        (Variant("Breakable(any), no context", brk_any, (x,)), 1),
        (Variant("FULL(Breakable(PIECEWISE)) stack under NONE", stack, (x,), _ctx(M.NONE)), 2),
        (Variant("eager_break fn outside capture", decorated, (x,)), 1),
        (Variant("BreakPoint outside capture", bp, (x,)), 1),
    ]


def run(quick: bool = False, deadline: float | None = None) -> list[Section]:
    vs = variants()
    samples = measure([v for v, _ in vs], reps=15 if quick else 41, target_s=0.01 if quick else 0.03, deadline=deadline)
    base = vs[0][0].name
    rows, worst = [], 0.0
    for v, layers in vs:
        t = samples.times[v.name]
        if v.name == base:
            rows.append([v.name, fmt_spread(t, 1e9), "-", "-", "-"])
            continue
        added = samples.diffs(v.name, base)
        per_layer = sorted(d / layers for d in added)
        med = per_layer[len(per_layer) // 2] * 1e9
        worst = max(worst, med)
        rows.append([v.name, fmt_spread(t, 1e9), fmt_spread(added, 1e9), f"{med:.0f}", verdict(med, GOAL_NS)])
    body = (
        "ns per call, median [p25, p75] over "
        f"{len(samples.times[base])} interleaved repetitions; 'added' is paired with the direct call "
        f"of the same repetition; goal: at most {GOAL_NS:.0f} ns added per wrapper layer.\n\n"
        + table(["variant", "ns/call", "added ns/call", "added per layer", "goal"], rows)
        + f"\n\nWorst median added cost per wrapper layer: {worst:.0f} ns ({verdict(worst, GOAL_NS)})."
    )
    return [Section("Wrapper passthrough cost (CPU)", body, {"worst_added_ns": worst})]


if __name__ == "__main__":
    for s in run(quick="--quick" in sys.argv):
        print(s.markdown())
