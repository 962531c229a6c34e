"""Soak: a lazy engine under traffic that never lets the queue drain, against one captured up front.

Seeded online traffic, the same for both engines and both rounds, keyed by step number: requests
arrive (prompts of 3..40 tokens, longer than a step's token budget: chunked prefill), some are
cancelled while they run, the KV cache is small (preemption), and a request is added whenever fewer
than ``min_queue`` are unfinished, so the engine is never idle and ``capture_idle`` is never called.
The lazy engine (``lazy_capture=True``, the default ``step_capture_budget_s``) has only its step
catch-up to compile and capture; the up-front engine captured everything before round 1 (not
counted). Round 2 serves the same traffic again.

Reported per engine and round: steps, steps that replayed a graph, wall seconds; for the lazy
engine the step at which it compiled and the worst step latency the catch-up added (the compile or
captures done inside that step). Goals (round 2): the lazy engine replays graphs for >= 90% of the
steps the up-front engine does, and its wall time is <= 1.1x. Tokens are checked equal between the
engines (eager pieces: exactly).

    python -m benchmarks.bench_soak [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import piecewise_backend as pb
from benchmarks.common import Section, fmt_time, log, quiet_logs, raise_recompile_limits, table

VARIANTS = ("up-front", "lazy")


@dataclass
class Traffic:
    """Per step: the requests that arrive (prompt, max new tokens) and the arrival indices cancelled."""

    arrivals: dict[int, list[tuple[list[int], int]]]
    cancels: dict[int, list[int]]
    steps: int
    refill: list[tuple[list[int], int]]  # added, in order, whenever the queue runs short
    min_queue: int


def make_traffic(seed: int, steps: int, vocab: int, min_queue: int) -> Traffic:
    rng = random.Random(seed)

    def request() -> tuple[list[int], int]:
        return [rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))], rng.randint(4, 24)

    arrivals: dict[int, list] = {}
    cancels: dict[int, list[int]] = {}
    n = 0
    for i in range(steps):
        for _ in range(1 if rng.random() < 0.3 else 0):
            arrivals.setdefault(i, []).append(request())
            n += 1
        if n and rng.random() < 0.05:
            cancels.setdefault(i, []).append(rng.randrange(n))
    return Traffic(arrivals, cancels, steps, [request() for _ in range(4 * steps)], min_queue)


@dataclass
class Round:
    steps: int
    replayed: int
    seconds: float
    worst_catch_up_s: float
    catch_up_s: float
    compiled_at: int | None
    tokens: dict[int, list[int]]


def serve_round(engine, traffic: Traffic) -> Round:
    """One round of ``traffic`` on ``engine``; the tokens of every request by arrival order."""
    ids: list = []
    refill = iter(traffic.refill)
    lazy = engine.runner.lazy
    replayed, worst, total, compiled_at = 0, 0.0, 0.0, None
    done: dict = {}
    began = time.perf_counter()
    step = 0
    while step < traffic.steps or engine.has_unfinished_requests():
        if step < traffic.steps:
            for prompt, new in traffic.arrivals.get(step, ()):
                ids.append(engine.add_request(prompt, new, stop_token_ids=[]))
            for k in traffic.cancels.get(step, ()):
                if k < len(ids):
                    engine.cancel_request(ids[k])
            while sum(1 for i in ids if i not in done) < traffic.min_queue:  # never drains
                prompt, new = next(refill)
                ids.append(engine.add_request(prompt, new, stop_token_ids=[]))
        history, needed = len(lazy.history), engine.runner.needs_compile
        for r in engine.step():
            done[r.request_id] = r.token_ids
        added = sum(r.seconds for r in lazy.history[history:])
        if needed and not engine.runner.needs_compile:
            compiled_at, added = step, added + (lazy.compile_seconds or 0.0)
        worst, total = max(worst, added), total + added
        replayed += engine.runner.last_mode != pb.CUDAGraphMode.NONE
        step += 1
        if step > 50 * traffic.steps:
            raise RuntimeError("the soak did not finish")
    seconds = time.perf_counter() - began
    for r in engine.results():
        done[r.request_id] = r.token_ids
    return Round(step, replayed, seconds, worst, total, compiled_at, {k: done[i] for k, i in enumerate(ids) if i in done})


def run(quick: bool = False, deadline: float | None = None) -> list[Section]:
    from piecewise_backend import hf

    raise_recompile_limits()
    layers, steps = (2, 80) if quick else (4, 400)
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", cudagraph_mode="FULL_AND_PIECEWISE",
                                  max_capture_size=16)
    kwargs = {"max_num_reqs": 4, "max_model_len": 64, "block_size": 8, "num_blocks": 18, "max_num_batched_tokens": 16}
    traffic = make_traffic(7, steps, 256, min_queue=3)
    engines = {}
    with quiet_logs():
        for v in VARIANTS:
            torch.manual_seed(0)
            model = hf.tiny_random_model("llama", num_hidden_layers=layers)
            engines[v] = hf.HFEngine(model, config, lazy_capture=v == "lazy", **kwargs)
        report = engines["up-front"].capture()
        rounds: dict[str, list[Round]] = {v: [] for v in VARIANTS}
        for r in range(2):
            for v in VARIANTS:
                log(f"soak: round {r + 1}, {v}")
                rounds[v].append(serve_round(engines[v], traffic))
    failed = []
    for r in range(2):
        if rounds["lazy"][r].tokens != rounds["up-front"][r].tokens:
            failed.append(f"round {r + 1}: tokens differ")
    rows = []
    for r in range(2):
        for v in VARIANTS:
            x = rounds[v][r]
            rows.append([f"round {r + 1}", v, x.steps, f"{x.replayed} ({x.replayed / x.steps:.0%})", fmt_time(x.seconds),
                         "-" if v == "up-front" else fmt_time(x.worst_catch_up_s),
                         "-" if v == "up-front" else fmt_time(x.catch_up_s),
                         "-" if v == "up-front" or x.compiled_at is None else x.compiled_at])
    up, lz = rounds["up-front"][1], rounds["lazy"][1]
    replay_ratio = lz.replayed / up.replayed if up.replayed else float("nan")
    wall_ratio = lz.seconds / up.seconds
    body = table(["round", "engine", "steps", "steps replaying a graph", "wall", "worst catch-up in a step",
                  "catch-up in all", "compiled at step"], rows)
    budget = engines["lazy"].step_capture_budget_s
    body += (
        f"\n\nHFEngine, tiny llama ({layers} layers), simulated graphs, eager pieces; {steps} steps of seeded traffic "
        f"per round (arrivals, cancels, at least {traffic.min_queue} unfinished requests at any time), 16 tokens a "
        f"step (chunked prefill), {kwargs['num_blocks']} KV blocks of {kwargs['block_size']} (preemption); lazy "
        f"engine: default step_capture_budget_s={budget}, never capture_idle; up-front: {report.graphs} graphs "
        f"captured before round 1 in {report.seconds:.2f} s (not counted). Round 2, lazy vs up-front: steps "
        f"replaying a graph {replay_ratio:.2f}x (goal >= 0.90: {'met' if replay_ratio >= 0.9 else 'not met'}), wall "
        f"{wall_ratio:.2f}x (goal <= 1.1x: {'met' if wall_ratio <= 1.1 else 'not met'}; without its catch-up "
        f"{(lz.seconds - lz.catch_up_s) / up.seconds:.2f}x). One run (no repetitions): "
        "the wall ratio is noisy on a shared machine.\n"
    )
    if failed:
        body += f"\n**FAILED: {'; '.join(failed)}**\n"
    data = {"replay_ratio": replay_ratio, "wall_ratio": wall_ratio, "failed": failed,
            "wall_ratio_without_catch_up": (lz.seconds - lz.catch_up_s) / up.seconds,
            "worst_catch_up_s": max(x.worst_catch_up_s for x in rounds["lazy"])}
    return [Section("Cold start: a lazy engine under traffic that never drains (soak)", body, data)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 2-layer model, 80 steps a round")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sections = run(quick=args.quick)
    for s in sections:
        print(s.markdown(), flush=True)
    return 1 if any(s.data.get("failed") for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
