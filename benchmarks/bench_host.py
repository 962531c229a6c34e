"""Host time of a FULL decode step outside the replay, and a mode-mismatched wrapper's passthrough.

A serving engine at batch 1 on a GPU spends its decode step on the host: a graph replay is one
``cudaGraphLaunch``, the rest is Python. Here the simulated replay is made a no-op (its ops are not
run), so what is timed is everything around it, side by side in one run:

* ``GraphRunner.run``: checking and filling the step's inputs, dispatch, the FULL replay's context
  check, the forward context, the wrapper, unpadding (goal: <= 25 us);
* ``Engine.step``: scheduling, the step's inputs (``PagedKVCache.stage_step``), ``GraphRunner.run``,
  sampling, the request bookkeeping (goal: <= 60 us at batch 1, <= 100 us at batch 8);

each at batch 1 and 8 (a uniform decode step of the examples/own_model.py decoder, 2 layers, FULL
graphs, ``max_model_len=1024``, ``block_size=16``, greedy), thread CPU time per step, median [p25,
p75] over interleaved repetitions. The last table is the passthrough of a wrapper whose mode does
not match the step's (``CUDAGraphWrapper(FULL)`` under PIECEWISE) against a bare class that
forwards ``__call__`` (goal: <= 2.0x).

``--baseline REV`` times the same steps side by side with the code of git revision ``REV``: its
``src/`` is extracted (``git archive``) into a temporary directory, and fresh processes measure the
two trees in turn (before, after, before, after, ... for ``--rounds`` rounds, this script's
measurement on either ``src/``); one table gives both medians and their ratio per row::

    python benchmarks/bench_host.py [--quick]
    python benchmarks/bench_host.py --baseline 7634807 [--rounds 4] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this tree's benchmarks and src/ (as run.py does)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch

import piecewise_backend as pb
from benchmarks.common import ROOT, Section, Variant, fmt_ratio, fmt_spread, measure, quiet_logs, table, verdict
from piecewise_backend import serve
from piecewise_backend.platforms.simulated.platform import SimulatedGraph

RUN_GOAL_US, PASSTHROUGH_GOAL = 25.0, 2.0
STEP_GOAL_US = {1: 60.0, 8: 100.0}  # Engine.step per batch size
MAX_MODEL_LEN, BLOCK_SIZE = 1024, 16
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
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 8],
                                  platform="simulated", compile_pieces="eager")
    engine = serve.Engine(own.make_model(), config, kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=8,
                          max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
    with torch.inference_mode(), quiet_logs():
        engine.capture()
    return engine


@contextlib.contextmanager
def decoding(engine: serve.Engine, batch: int) -> Iterator[None]:
    """``batch`` requests past their prefill, decoding (uniform FULL steps) while the block runs; cancelled after."""
    with torch.inference_mode():
        ids = [engine.add_request([5, 7, 9], MAX_MODEL_LEN - 8) for _ in range(batch)]
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
    """The keyword arguments the engine passes the GraphRunner in a decode step at ``batch``.

    The engine calls ``run_step`` (``run`` before it existed): both are recorded, so one bench
    measures trees from before and after that change alike.
    """
    runner, seen = engine.runner, []
    names = [n for n in ("run", "run_step") if hasattr(runner, n)]

    def recorder(real):
        def record(**kw):
            seen.append(kw)
            return real(**kw)
        return record

    with decoding(engine, batch):
        for n in names:
            setattr(runner, n, recorder(getattr(runner, n)))
        try:
            engine.step()
        finally:
            for n in names:
                delattr(runner, n)
    assert runner.last_mode == M.FULL and seen and seen[-1]["uniform_decode"], "the timed step is not a FULL decode step"
    return seen[-1]


class Forward:
    """A bare class forwarding ``__call__``: the floor any wrapper's passthrough is compared with."""

    def __init__(self, runnable):
        self.runnable = runnable

    def __call__(self, *args, **kwargs):
        return self.runnable(*args, **kwargs)


def ident(x):
    return x


def goal_us(name: str) -> float:
    """The goal of a row of the host table (``GraphRunner.run, batch 1``, ``Engine.step, batch 8``, ...)."""
    return RUN_GOAL_US if name.startswith("GraphRunner") else STEP_GOAL_US[int(name.rsplit(" ", 1)[1])]


def measure_steps(reps: int, deadline: float | None = None) -> dict[str, list[float]]:
    """Seconds (thread CPU) per step of every row, one sample per interleaved repetition."""
    engine = make_engine()
    with noop_replay():
        calls = {b: runner_call(engine, b) for b in BATCHES}
        variants = []
        for b in BATCHES:
            kw = calls[b]
            variants.append(Variant(f"GraphRunner.run, batch {b}", lambda kw=kw: engine.runner.run(**kw),
                                    context=torch.inference_mode, number=STEPS_PER_BLOCK))
            variants.append(Variant(f"Engine.step, batch {b}", engine.step,
                                    context=lambda b=b: decoding(engine, b), number=STEPS_PER_BLOCK))
        return measure(variants, reps=reps, deadline=deadline).times


def run(quick: bool = False, deadline: float | None = None) -> list[Section]:
    times = measure_steps(7 if quick else 21, deadline)
    rows, data = [], {}
    for name, samples in times.items():
        goal = goal_us(name)
        med = statistics.median(samples) * 1e6
        data[name] = med
        rows.append([name, fmt_spread(samples, 1e6, 1), f"<= {goal:.0f}", verdict(med, goal)])
    body = (
        f"Thread CPU us per FULL decode step with the replay a no-op, median [p25, p75] over "
        f"{len(next(iter(times.values())))} interleaved repetitions of {STEPS_PER_BLOCK} steps "
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


def extract(rev: str, into: Path) -> Path:
    """``rev``'s ``src/`` (git archive) under ``into``; returns that ``src`` directory."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "src"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def child_times(src: Path, reps: int) -> dict[str, list[float]]:
    """:func:`measure_steps` in a fresh process importing ``piecewise_backend`` from ``src``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_host", "--child", str(reps)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_host child on {src} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def side_by_side(rev: str, rounds: int, quick: bool) -> Section:
    """The host table of ``rev``'s ``src/`` and this tree's, measured in alternating processes."""
    reps = 5 if quick else 11
    before: dict[str, list[float]] = {}
    after: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_host_") as tmp:
        old = extract(rev, Path(tmp))
        for _ in range(rounds):
            for src, into in ((old, before), (ROOT / "src", after)):
                for name, samples in child_times(src, reps).items():
                    into.setdefault(name, []).extend(samples)
    rows = []
    for name in after:
        b, a, goal = statistics.median(before[name]) * 1e6, statistics.median(after[name]) * 1e6, goal_us(name)
        rows.append([name, fmt_spread(before[name], 1e6, 1), fmt_spread(after[name], 1e6, 1), f"{a / b:.2f}x",
                     f"<= {goal:.0f}", verdict(a, goal)])
    body = (
        f"Thread CPU us per FULL decode step with the replay a no-op, median [p25, p75] of {rounds} rounds of "
        f"alternating processes ({reps} interleaved repetitions of {STEPS_PER_BLOCK} steps each), before: `{rev}`'s "
        "src/, after: this tree's; the ratio is after / before.\n\n"
        + table(["what", f"before ({rev})", "after", "ratio", "goal", "after"], rows)
    )
    return Section(f"Host time per FULL decode step, before and after (CPU, baseline {rev})", body,
                   {"before": before, "after": after})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--baseline", metavar="REV", help="also time git revision REV's src/, side by side")
    ap.add_argument("--rounds", type=int, default=4, help="alternating before/after processes with --baseline")
    ap.add_argument("--child", type=int, metavar="REPS", help=argparse.SUPPRESS)  # one tree's samples, as JSON
    args = ap.parse_args()
    if args.child is not None:
        with quiet_logs():
            print(json.dumps(measure_steps(args.child)))
    elif args.baseline:
        print(side_by_side(args.baseline, args.rounds, args.quick).markdown())
    else:
        for section in run(quick=args.quick):
            print(section.markdown())
