"""Host time of a FULL decode step outside the replay, and a mode-mismatched wrapper's passthrough.

A serving engine at batch 1 on a GPU spends its decode step on the host: a graph replay is one
``cudaGraphLaunch``, the rest is Python. Here the simulated replay is made a no-op (its ops are not
run), so what is timed is everything around it, side by side in one run:

* ``GraphRunner.run``: checking and filling the step's inputs, dispatch, the FULL replay's context
  check, the forward context, the wrapper, unpadding (goal: <= 25 us);
* ``Engine.step``: scheduling, ``PagedKVCache.step_inputs``, ``GraphRunner.run``, sampling, the
  request bookkeeping (goal: <= 60 us);

each at batch 1 and 8 (a uniform decode step of the examples/own_model.py decoder, 2 layers, FULL
graphs), thread CPU time per step, median [p25, p75] over interleaved repetitions. The last table
is the passthrough of a wrapper whose mode does not match the step's (``CUDAGraphWrapper(FULL)``
under PIECEWISE) against a bare class that forwards ``__call__`` (goal: <= 2.0x).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import Iterator

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import torch

import piecewise_backend as pb
from benchmarks.common import Section, Variant, fmt_ratio, fmt_spread, measure, quiet_logs, table, verdict
from piecewise_backend import serve
from piecewise_backend.platforms.simulated.platform import SimulatedGraph

RUN_GOAL_US, STEP_GOAL_US, PASSTHROUGH_GOAL = 25.0, 60.0, 2.0
BATCHES = (1, 8)
STEPS_PER_BLOCK = 100
M = pb.CUDAGraphMode


def _own_model():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "own_model.py"
    spec = importlib.util.spec_from_file_location("own_model_bench", path)
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # Dynamo looks the module of the model's globals up in sys.modules  # type: ignore[union-attr]
    return module


@contextlib.contextmanager
def noop_replay() -> Iterator[None]:
    """Simulated graph replays do nothing meanwhile: what remains of a step is its host time."""
    real = SimulatedGraph.replay
    SimulatedGraph.replay = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimulatedGraph.replay = real  # type: ignore[method-assign]


def make_engine() -> serve.Engine:
    own = _own_model()
    torch.manual_seed(0)
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8],
                                  platform="simulated", compile_pieces="eager")
    engine = serve.Engine(own.make_model(), config, kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=8,
                          max_model_len=2048, block_size=16)
    with torch.inference_mode(), quiet_logs():
        engine.capture()
    return engine


@contextlib.contextmanager
def decoding(engine: serve.Engine, batch: int) -> Iterator[None]:
    """``batch`` requests past their prefill, decoding (uniform FULL steps) while the block runs; cancelled after."""
    with torch.inference_mode():
        ids = [engine.add_request([5, 7, 9], 2000) for _ in range(batch)]
        for _ in range(16):  # prefill (PIECEWISE steps) until every request decodes (FULL steps)
            engine.step()
            if engine.runner.last_mode == M.FULL:
                break
        try:
            yield
        finally:
            for i in ids:
                engine.cancel_request(i)
            while engine.has_unfinished_requests():
                engine.step()


def runner_call(engine: serve.Engine, batch: int) -> dict:
    """The keyword arguments the engine passes ``GraphRunner.run_step`` in a decode step at ``batch``."""
    runner, seen = engine.runner, []
    real = runner.run_step

    def record(**kw):
        seen.append(kw)
        return real(**kw)

    with decoding(engine, batch):
        runner.run_step = record  # type: ignore[method-assign]
        try:
            engine.step()
        finally:
            del runner.run_step
    assert runner.last_mode == M.FULL and seen[-1]["uniform_decode"], "the timed step is not a FULL decode step"
    return seen[-1]


class Forward:
    """A bare class forwarding ``__call__``: the floor any wrapper's passthrough is compared with."""

    def __init__(self, runnable):
        self.runnable = runnable

    def __call__(self, *args, **kwargs):
        return self.runnable(*args, **kwargs)


def ident(x):
    return x


def run(quick: bool = False, deadline: float | None = None) -> list[Section]:
    engine = make_engine()
    reps = 7 if quick else 21
    with noop_replay():
        calls = {b: runner_call(engine, b) for b in BATCHES}
        variants = []
        for b in BATCHES:
            kw = calls[b]
            variants.append(Variant(f"GraphRunner.run, batch {b}", lambda kw=kw: engine.runner.run(**kw),
                                    context=torch.inference_mode, number=STEPS_PER_BLOCK))
            variants.append(Variant(f"Engine.step, batch {b}", engine.step,
                                    context=lambda b=b: decoding(engine, b), number=STEPS_PER_BLOCK))
        samples = measure(variants, reps=reps, deadline=deadline)
    rows, data = [], {}
    for v in variants:
        goal = RUN_GOAL_US if v.name.startswith("GraphRunner") else STEP_GOAL_US
        med = statistics.median(samples.times[v.name]) * 1e6
        data[v.name] = med
        rows.append([v.name, fmt_spread(samples.times[v.name], 1e6, 1), f"<= {goal:.0f}", verdict(med, goal)])
    body = (
        f"Thread CPU us per FULL decode step with the replay a no-op, median [p25, p75] over "
        f"{len(samples.times[variants[0].name])} interleaved repetitions of {STEPS_PER_BLOCK} steps "
        "(examples/own_model.py's decoder, simulated platform).\n\n"
        + table(["what", "host us/step", "goal", ""], rows)
    )
    sections = [Section("Host time per FULL decode step, outside the replay (CPU)", body, data)]

    x = torch.zeros(1)
    full = pb.CUDAGraphWrapper(ident, M.FULL, config=pb.CompilationConfig(platform="simulated", compile_pieces="eager"))
    ctx = lambda: pb.set_forward_context(M.PIECEWISE, pb.BatchDescriptor(1))
    pair = [Variant("bare forwarding class", Forward(ident), (x,), ctx),
            Variant("CUDAGraphWrapper(FULL) under PIECEWISE", full, (x,), ctx)]
    s = measure(pair, reps=15 if quick else 41, target_s=0.01 if quick else 0.03, deadline=deadline)
    ratios = s.ratios(pair[1].name, pair[0].name)
    ratio = statistics.median(ratios)
    body = (
        "ns per call, median [p25, p75]; the ratio is paired per repetition.\n\n"
        + table(["variant", "ns/call"], [[v.name, fmt_spread(s.times[v.name], 1e9)] for v in pair])
        + f"\n\nMode-mismatched passthrough / bare forwarder: {fmt_ratio(ratios)} (goal <= {PASSTHROUGH_GOAL}x: "
        f"{verdict(ratio, PASSTHROUGH_GOAL)})."
    )
    sections.append(Section("Mode-mismatched wrapper passthrough vs a bare forwarder (CPU)", body,
                            {"passthrough_ratio": ratio}))
    return sections


if __name__ == "__main__":
    for section in run(quick="--quick" in sys.argv):
        print(section.markdown())
