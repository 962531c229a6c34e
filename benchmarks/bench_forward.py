"""Forward time of the backend (Inductor pieces) against whole-graph Inductor and eager, on CPU.

Model: ``piecewise_backend.toy_llama.make_model`` (Llama-style, ``pb_toy::attention``
in-place custom op as the splitting op), hidden size 256, 4 layers. No forward context,
so no graphs: this measures what splitting costs at run time (the split graph's Python,
the break points, fusion lost at piece boundaries). Goal: backend at most 1.05x
whole-graph Inductor.

Both compiled variants see the token dimension marked dynamic
(``torch._dynamo.mark_dynamic``) and are warmed up on every size before timing; all
variants run under ``torch.inference_mode``.
"""

from __future__ import annotations

import statistics
import sys

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import torch

import piecewise_backend as pb
from benchmarks.common import (
    Section, Variant, fmt_ratio, fmt_spread, log, measure, raise_recompile_limits, table, verdict,
)
from piecewise_backend.toy_llama import make_model

GOAL = 1.05
MODEL = dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=512, vocab_size=1024)


def _ids(t: int, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(t))
    if t > 1:
        torch._dynamo.mark_dynamic(ids, 0)  # 0/1 are specialized anyway: T=1 gets its own graph
    return ids


def run(quick: bool = False, deadline: float | None = None, threads: int = 1) -> list[Section]:
    raise_recompile_limits()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    # One thread: time the CPU time of this thread, which other processes' load barely changes.
    clock = "thread" if threads == 1 else "wall"
    tokens = (8,) if quick else (1, 8, 64)
    try:
        before = {k: pb.counters[k] for k in ("compiles", "compiled_pieces", "graphs")}
        with torch.inference_mode():
            model = make_model(attention="inplace", **MODEL)
            inductor = torch.compile(model)
            backend = pb.make_backend(pb.CompilationConfig())
            piecewise = torch.compile(model, backend=backend)
            inputs = {t: _ids(t, MODEL["vocab_size"]) for t in tokens}
            for t, ids in inputs.items():  # compile and warm up every size
                ref = model(ids)
                for name, fn in (("inductor", inductor), ("piecewise", piecewise)):
                    log(f"  forward: warming up {name} T={t}")
                    for _ in range(3):
                        out = fn(ids)
                    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3, msg=lambda m: f"{name} T={t}: {m}")
            graphs = pb.counters["graphs"]
            rows, ratio_rows, data = [], [], {}
            for t, ids in inputs.items():
                vs = [
                    Variant(f"T={t} eager", model, (ids,), clock=clock),
                    Variant(f"T={t} whole-graph Inductor", inductor, (ids,), clock=clock),
                    Variant(f"T={t} piecewise backend (Inductor pieces)", piecewise, (ids,), clock=clock),
                    # the same compiled callable timed twice: the ratio of the two is the noise floor
                    Variant(f"T={t} whole-graph Inductor, again (A/A control)", inductor, (ids,), clock=clock),
                ]
                s = measure(vs, reps=11 if quick else 41, target_s=0.05, deadline=deadline)
                for v in vs:
                    rows.append([v.name, fmt_spread(s.times[v.name], 1e6, 1)])
                eager, ind, pw, control = (v.name for v in vs)
                r = s.ratios(pw, ind)
                med = statistics.median(r)
                ratio_rows.append([t, fmt_ratio(r), fmt_ratio(s.ratios(control, ind)), fmt_ratio(s.ratios(ind, eager)),
                                   fmt_ratio(s.ratios(pw, eager)), verdict(med, GOAL)])
                data[t] = {"piecewise_over_inductor": med}
            delta = {k: pb.counters[k] - v for k, v in before.items()}
            if pb.counters["graphs"] != graphs:
                raise AssertionError("the piecewise backend recompiled while being timed")
    finally:
        torch.set_num_threads(prev_threads)
    cfg = ", ".join(f"{k}={v}" for k, v in MODEL.items())
    body = (
        f"Toy Llama ({cfg}), attention = `pb_toy::attention` (in-place custom op, the splitting op); "
        f"torch threads = {threads}, clock = {'CPU time of the timing thread' if clock == 'thread' else 'wall'}; "
        "no forward context (no graphs). Median [p25, p75] over interleaved repetitions.\n\n"
        + table(["variant", "us per forward"], rows)
        + f"\n\nRatios, paired per repetition (goal: piecewise / Inductor <= {GOAL}):\n\n"
        + table(["tokens", "piecewise / Inductor", "A/A: Inductor / Inductor", "Inductor / eager",
                 "piecewise / eager", "goal"], ratio_rows)
        + "\n\nThe A/A column times the same compiled Inductor callable as a fourth variant: its spread is "
        "what this machine's noise alone produces."
        + f"\n\nThe backend ran {delta['compiles']} Inductor compilations for "
        f"{delta['compiled_pieces']} compiled pieces over {delta['graphs']} Dynamo graph(s) "
        "(T=1 is specialized, T>1 shares one dynamic graph)."
    )
    return [Section("Forward time: piecewise backend vs whole-graph Inductor vs eager (CPU)", body, data)]


if __name__ == "__main__":
    for s in run(quick="--quick" in sys.argv):
        print(s.markdown())
