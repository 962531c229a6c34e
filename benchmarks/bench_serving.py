"""Serve before capture: time to the first token with ``lazy_capture=True`` vs an up-front ``capture()``,
and decode tokens/s after ``capture_idle`` vs after a full capture.

**Time to first token**: from ``HFEngine(...)`` (the model already built) to the first token a request
streams (``on_token``: after the step's ids were read back, so synchronized). Each run is a fresh
process (``--child``): Dynamo starts cold, as when a server starts (on CUDA the Inductor cache is warm, filled
by an untimed process first, as on a server's restart); variants
alternate in a fresh random order per repetition and ratios are paired per repetition. The time is
split into what it is made of: building the engine (adapting the model: its probe forward; the
cache; the runner), capturing (up front only) and the first step (for the lazy engine, one forward of
the uncompiled model: it serves before Dynamo traces, ``capture_idle`` or the step catch-up compiles
later; for the up-front engine the warm-ups compiled before capture, so its first step replays
graphs). "Dynamo" is what Dynamo's ``entire_frame_compile`` timer counted from the engine's build to
the first token (tracing and compiling the pieces), inside the other columns.

**Decode tokens/s**: two engines in one process over the same weights: one captured up front, one lazy
that served the same traffic once (every step eager), then ``capture_idle`` with time to spare (the
demanded graphs only). Per-token timestamps, window from the moment every request has its first token
to the last token (``bench_hf_throughput.decode_window``); the lazy engine before capture (eager decode)
is the third row. Tokens are checked equal across the three. On the CPU the graphs are simulated:
replaying them costs host time like running the ops, so only the time-to-first-token split says
something there; a GPU run (``--device cuda``) measures both.

    python -m benchmarks.bench_serving [--quick] [--device cuda] [--out FILE]

Exit status 1 when the engines' tokens differ (lazy vs up-front, or after capture_idle vs a full capture).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import piecewise_backend as pb
from benchmarks.bench_hf_throughput import SIZES, decode_window
from benchmarks.common import (
    Section, env_table, environment, fmt_ratio, fmt_time, log, quiet_logs, raise_recompile_limits, spawn_child, table,
)

MAX_CAPTURE = {"cpu": 64, "cuda": 256}  # the default ladder up to this: 11 sizes on the CPU, 35 on CUDA, per mode
VARIANTS = ("up-front", "lazy")


def setup(device: str, quick: bool) -> tuple[pb.CompilationConfig, dict, list[list[int]], int, dict]:
    """Config, model sizes, prompts, new tokens and engine kwargs, the same in the parent and the children."""
    cuda = device == "cuda"
    config = pb.CompilationConfig(
        platform="cuda" if cuda else "simulated", compile_pieces="inductor" if cuda else "eager",
        cudagraph_mode="FULL_AND_PIECEWISE", max_capture_size=MAX_CAPTURE[device],
    )
    sizes = SIZES[("cuda" if cuda else "cpu") + ("-quick" if quick else "")]
    g = torch.Generator().manual_seed(2)
    vocab = sizes.get("vocab_size", 256)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (12, 30, 7, 21)]
    new = 8 if quick else 32
    block = 256 if cuda else 16
    engine = dict(max_num_reqs=len(prompts), max_model_len=-(-(max(map(len, prompts)) + new) // block) * block,
                  block_size=block)
    return config, sizes, prompts, new, engine


def make_model(device: str, sizes: dict) -> torch.nn.Module:
    from piecewise_backend import hf

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return hf.tiny_random_model("llama", device=device, **sizes).to(dtype)


def child(variant: str, device: str, quick: bool) -> dict:
    """One cold start: seconds to build the engine, to capture (up-front), to the first streamed token."""
    import torch._dynamo.utils as dynamo_utils

    from piecewise_backend import hf

    config, sizes, prompts, new, kwargs = setup(device, quick)
    model = make_model(device, sizes)
    first: list[float] = []
    dynamo: list[float] = []

    def on_token(request: int, token: int) -> None:
        if not first:
            first.append(time.perf_counter())
            dynamo.append(dynamo_seconds() - dynamo0)

    def dynamo_seconds() -> float:
        return dynamo_utils.calculate_time_spent().get("entire_frame_compile", 0.0)

    with quiet_logs():
        dynamo0 = dynamo_seconds()  # the timer is per process: count this engine's only
        t0 = time.perf_counter()
        engine = hf.HFEngine(model, config, lazy_capture=variant == "lazy", **kwargs)
        built = time.perf_counter()
        graphs = 0
        if variant == "up-front":
            graphs = engine.capture().graphs
        captured = time.perf_counter()
        tokens = engine.generate(prompts, new, eos_token_id=[], on_token=on_token)  # []: a fixed token count
    return {
        "build_s": built - t0, "capture_s": captured - built, "first_step_s": first[0] - captured,
        "ttft_s": first[0] - t0, "dynamo_s": dynamo[0],
        "graphs": graphs, "tokens": tokens,
    }


def ttft_table(device: str, quick: bool, deadline: float | None) -> Section:
    reps = (1 if device == "cuda" else 2) if quick else 5
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    rng = random.Random(0)
    order = list(VARIANTS)
    with tempfile.TemporaryDirectory() as cache:  # one Inductor cache for all: warm, as on a server's restart
        if device == "cuda":  # fill it first (untimed): Inductor's kernels for both variants' one graph
            log("serving: time to first token, warming the Inductor cache")
            spawn_child("benchmarks.bench_serving", ["--variant", "up-front", "--device", device] + (["--quick"] if quick else []),
                        cache, timeout=900)
        for rep in range(reps):
            if deadline is not None and rep >= 1 and time.monotonic() > deadline:
                break
            rng.shuffle(order)
            for v in order:
                log(f"serving: time to first token, {v} ({rep + 1}/{reps})")
                args = ["--variant", v, "--device", device] + (["--quick"] if quick else [])
                runs[v].append(spawn_child("benchmarks.bench_serving", args, cache, timeout=900))
    if runs["lazy"][0]["tokens"] != runs["up-front"][0]["tokens"]:
        raise AssertionError("the lazy engine's tokens differ from the up-front engine's")
    med = {v: {k: statistics.median(r[k] for r in runs[v]) for k in ("build_s", "capture_s", "first_step_s", "ttft_s",
                                                                     "dynamo_s")} for v in VARIANTS}
    ratios = [a["ttft_s"] / b["ttft_s"] for a, b in zip(runs["lazy"], runs["up-front"])]
    rows = []
    for v in VARIANTS:
        m = med[v]
        ratio = "1.000x" if v == "up-front" else fmt_ratio(ratios)
        rows.append([f"HFEngine, {v} capture", fmt_time(m["build_s"]), fmt_time(m["capture_s"]) if v == "up-front" else "-",
                     fmt_time(m["first_step_s"]), fmt_time(m["dynamo_s"]), fmt_time(m["ttft_s"]), ratio])
    goal = statistics.median(ratios)
    body = table(["engine", "build", "capture", "first step", "(of it: Dynamo)", "time to first token",
                  "vs up-front (goal <= 0.2x)"], rows)
    graphs = runs["up-front"][0]["graphs"]
    body += (f"\n\n{len(runs['lazy'])} cold processes per variant (one shared Inductor cache, warm on CUDA: filled by an untimed process first; Dynamo cold in every process), medians; ratio: median "
             f"[p25, p75] of paired ones; the up-front engine captured {graphs} graphs (FULL_AND_PIECEWISE, sizes up to "
             f"{MAX_CAPTURE[device]}). Goal <= 0.2x: {'met' if goal <= 0.2 else 'not met'} ({goal:.3f}x).\n")
    data = {"ratio": goal, "median": med, "graphs": graphs}
    return Section(f"Serve before capture: time to first token, lazy vs up-front ({device})", body, data)


def decode_table(device: str, quick: bool, deadline: float | None) -> Section:
    from piecewise_backend import hf

    config, sizes, prompts, new, kwargs = setup(device, quick)
    raise_recompile_limits()
    full = hf.HFEngine(make_model(device, sizes), config, **kwargs)
    report = full.capture()
    lazy = hf.HFEngine(make_model(device, sizes), config, lazy_capture=True, step_capture_budget_s=0, **kwargs)

    def timed(engine: hf.HFEngine) -> tuple[float, list[list[int]], set]:
        events: list[tuple[float, int]] = []
        modes = set()
        first: dict[int, float] = {}

        def on_token(i: int, t: int) -> None:
            now = time.perf_counter()
            first.setdefault(i, now)
            events.append((now, 1))

        tokens = engine.generate(prompts, new, eos_token_id=[], on_token=on_token,
                                 on_step=lambda info: modes.add(info.mode))
        n, s = decode_window(events, max(first.values()))
        return n / s if s else float("nan"), tokens, modes

    eager_rate, eager_tokens, eager_modes = timed(lazy)  # the traffic that makes the demand
    t0 = time.perf_counter()
    captured = lazy.capture_idle(max_seconds=600.0)
    idle_s = time.perf_counter() - t0
    engines = {"after a full capture()": full, "after capture_idle (demanded graphs only)": lazy}
    first = {name: timed(e) for name, e in engines.items()}  # warm-up, and the tokens checked
    if any(t != eager_tokens for _, t, _ in first.values()):
        raise AssertionError("tokens differ between the full capture, capture_idle and the eager run")
    rates: dict[str, list[float]] = {name: [] for name in engines}
    order, rng = list(engines), random.Random(1)
    for rep in range(3 if quick else 7):
        if deadline is not None and rep >= 2 and time.monotonic() > deadline:
            break
        rng.shuffle(order)
        for name in order:
            rates[name].append(timed(engines[name])[0])
    base = "after a full capture()"
    rows = []
    for name in engines:
        ratio = [a / b for a, b in zip(rates[name], rates[base])]
        modes = "/".join(sorted(m.name for m in first[name][2]))
        rows.append([f"HFEngine {name}", f"{statistics.median(rates[name]):,.0f}", fmt_ratio(ratio), modes])
    rows.append(["HFEngine lazy, before capture (eager)", f"{eager_rate:,.0f}", "(one run)",
                 "/".join(sorted(m.name for m in eager_modes))])
    body = table(["engine", "decode tokens/s", "vs full capture", "step modes"], rows)
    body += (f"\n\nfull capture: {report.graphs} graphs in {report.seconds:.2f} s; capture_idle: {len(captured)} graphs "
             f"in {idle_s:.2f} s ({', '.join(f'{m.name} {d.num_tokens}' for m, d in captured)}). {len(prompts)} prompts "
             f"of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, {new} new tokens each, greedy; tokens equal "
             f"in all three rows; {len(rates[base])} interleaved repetitions, medians.\n")
    if device == "cpu":
        body += ("\n**CPU: graphs are simulated (replayed op by op on the host), so decode rates here show only that "
                 "the graphs capture_idle chose serve the traffic (same modes, same tokens), not a speed-up.**\n")
    return Section(f"Serve before capture: decode tokens/s after capture_idle vs a full capture ({device})", body,
                   {"rates": {k: statistics.median(v) for k, v in rates.items()}, "captured": len(captured)})


def run(quick: bool = False, deadline: float | None = None, device: str = "cpu", out: Path | None = None) -> list[Section]:
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        return [Section(f"Serve before capture ({device})", f"skipped: {e}")]
    sections: list[Section] = []
    with quiet_logs():
        for make in (ttft_table, decode_table):
            sections.append(make(device, quick, deadline))
            if out is not None:  # a killed run keeps the tables it has
                out.write_text(f"{env_table(environment(device))}\n\n" + "\n".join(s.markdown() for s in sections))
    return sections


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller model, fewer tokens and repetitions")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", type=Path, help="markdown file to write the tables to (after each one)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False here; use --device cpu")
    if args.child:
        if args.device == "cpu":
            torch.set_num_threads(1)
        print(json.dumps(child(args.variant, args.device, args.quick)))
        return 0
    if args.device == "cpu":
        torch.set_num_threads(1)  # on a shared CPU, idle intra-op threads only add noise
    try:
        sections = run(quick=args.quick, device=args.device, out=args.out)
    except AssertionError as e:  # tokens differ between the engines
        print(f"FAILED: {e}", flush=True)
        return 1
    for s in sections:
        print(s.markdown(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
