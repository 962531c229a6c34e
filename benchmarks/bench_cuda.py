"""CUDA benchmarks: decode-step latency per graph scheme, and capture time/memory of the default ladder.

Decode step of the Llama-style toy model (``pb_toy::attention`` reading a KV cache through
the forward context's ``attn_metadata``), batch 1..64, one token per request:

* ``eager``: the plain model;
* ``FULL``: ``GraphRunner`` with ``cudagraph_mode="FULL"`` (one ``CUDAGraphWrapper(FULL)``
  graph per batch size, attention included);
* ``breakable PIECEWISE``: ``GraphRunner`` with ``cudagraph_mode="PIECEWISE"`` (one
  ``BreakableCUDAGraphWrapper`` capture per size, attention run eagerly between segments);
* ``per-piece PIECEWISE``: the same with ``use_breakable=False`` (a ``CUDAGraphWrapper`` per
  compiled piece);
* ``reduce-overhead``: ``torch.compile(model, mode="reduce-overhead")`` (Inductor + cudagraph trees);
* ``cudagraphs``: ``torch.compile(model, backend="cudagraphs")`` (Dynamo's own backend).

Every variant reads its inputs from the same static buffers, and the non-runner variants
do the same per-step input copies that ``GraphRunner.run`` does, so the comparison is
step for step. Every variant's logits are checked against eager's at every batch. Each variant is
set up inside ``try``: a failure becomes a table cell, not a crash; the exit status is 1 when a
variant of this library (FULL, breakable and per-piece PIECEWISE) failed or disagreed, while
torch's own variants failing on the installed torch are only reported in their cells.
``--headline`` measures batch 1, 8 and 32 against eager and ``reduce-overhead`` only (the first
benchmark of scripts/gpu_check.sh); ``--out FILE`` rewrites FILE with the tables after every batch,
so a run killed at its time limit keeps what it measured. Written for torch 2.11+ on one GPU;
``--simulate`` runs the ``pb`` variants on the CPU simulator to check the script itself without a
GPU (timings meaningless there).

    python -m benchmarks.bench_cuda [--quick] [--headline] [--out FILE] [--simulate]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import piecewise_backend as pb
from benchmarks.common import (
    Section, Variant, env_table, environment, fmt_ratio, log, measure, quiet_logs, raise_recompile_limits, table,
)
from piecewise_backend.toy_llama import AttnMetadata, make_model

MODEL = dict(num_layers=8, hidden_size=512, num_heads=8, intermediate_size=1024, vocab_size=4096)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
MAX_LEN = 128  # KV cache length per request slot
POS = 32  # every request decodes its token at this position
MAX_TOKENS = 512  # default ladder's largest size (max_capture_size)


def _err(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"error: {type(e).__name__}: {msg[:160]}"


class Setup:
    """Model, KV cache and static step inputs shared by every variant."""

    def __init__(self, device: str, simulate: bool):
        self.device, self.simulate = device, simulate
        self.dims = dict(MODEL, num_layers=2, hidden_size=64, intermediate_size=128) if simulate else MODEL
        self.model = make_model(attention="inplace", device=device, **self.dims)
        self.num_slots = max(BATCHES) + 1  # the last slot takes padding tokens' KV writes
        self.dummy_slot = self.num_slots - 1
        self.kv = self.model.make_kv_caches(self.num_slots, MAX_LEN)
        g = torch.Generator().manual_seed(0)
        n = max(BATCHES)
        # per-step sources (what a scheduler would produce) and static buffers the step reads
        self.src = {
            "input_ids": torch.randint(0, MODEL["vocab_size"], (n,), generator=g).to(device),
            "slot_mapping": torch.arange(n).to(device),
            "positions": torch.full((n,), POS, dtype=torch.long).to(device),
        }
        self.pad = {"input_ids": 0, "slot_mapping": self.dummy_slot, "positions": 0}
        self.static = {k: torch.empty_like(v) for k, v in self.src.items()}

    def meta(self, views: dict[str, torch.Tensor]) -> AttnMetadata:
        return AttnMetadata(views["slot_mapping"], views["positions"], self.kv)

    def context(self, views: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"attn_metadata": self.meta(views)}

    def config(self, mode: str, **kw: Any) -> pb.CompilationConfig:
        if self.simulate:
            kw.update(platform="simulated", compile_pieces="eager")
        else:
            kw.update(platform="cuda", compile_pieces="inductor")
        return pb.CompilationConfig(cudagraph_mode=mode, **kw)

    def runner(self, compiled: Any, config: pb.CompilationConfig) -> pb.GraphRunner:
        return pb.GraphRunner(
            compiled,
            config,
            inputs=[
                pb.StaticInput("input_ids"),
                pb.StaticInput("slot_mapping", pad=self.dummy_slot),
                pb.StaticInput("positions"),
            ],
            model_args=["input_ids"],
            context_fn=self.context,
            device=self.device,
        )

    # -- step functions: one decode step of b requests -------------------------------

    def runner_step(self, runner: pb.GraphRunner, b: int) -> Callable[[], Any]:
        batch = {k: v[:b] for k, v in self.src.items()}

        def step() -> Any:
            return runner.run(uniform_decode=True, num_reqs=b, **batch)

        return step

    def plain_step(self, fn: Callable[..., Any], b: int, mark_step: bool = False) -> Callable[[], Any]:
        """Copy the step's inputs into the static buffers (as GraphRunner.run does), then call ``fn``.

        ``mark_step``: tell cudagraph trees a new step begins (``reduce-overhead`` and
        ``cudagraphs`` variants), as an inference loop should.
        """
        views = {k: v[:b] for k, v in self.static.items()}
        srcs = [(views[k], self.src[k][:b], self.pad[k]) for k in views]
        meta = self.meta(views)
        ids = views["input_ids"]
        torch._dynamo.maybe_mark_dynamic(ids, 0)  # one dynamic graph for every batch (1 is specialized)

        mark = torch.compiler.cudagraph_mark_step_begin if mark_step else None

        def step() -> Any:
            for dst, src, pad in srcs:
                dst.fill_(pad)
                dst.copy_(src)
            if mark is not None:
                mark()
            with pb.set_forward_context(attn_metadata=meta):
                return fn(ids)

        return step


def _mark_dynamic_static(setup: Setup) -> None:
    for v in setup.static.values():
        torch._dynamo.maybe_mark_dynamic(v, 0)


LIBRARY = ("FULL", "breakable PIECEWISE", "per-piece PIECEWISE")  # this library's: a failure fails the benchmark
FOREIGN = ("reduce-overhead", "cudagraphs")  # torch's own: failing on the installed torch is a result (its cell)
HEADLINE_BATCHES = (1, 8, 32)
RTOL = 1e-2  # of max |eager logits|: Inductor reorders fp32 sums; a stale or misplaced replay is off by O(1)


def build_variants(
    setup: Setup, deadline: float | None, batches: tuple[int, ...] = BATCHES, foreign: tuple[str, ...] = FOREIGN
) -> tuple[dict[str, Callable[[int], Callable[[], Any]]], dict[str, str]]:
    """name -> (batch -> step); name -> error for the variants that could not be set up."""
    makers: dict[str, Callable[[int], Callable[[], Any]]] = {}
    errors: dict[str, str] = {}
    model = setup.model
    makers["eager"] = lambda b: setup.plain_step(model, b)
    capture_sizes = list(batches)

    def add(name: str, build: Callable[[], Callable[[int], Callable[[], Any]]]) -> None:
        if deadline is not None and time.monotonic() > deadline:
            errors[name] = "skipped (time budget)"
            return
        log(f"  cuda: setting up {name}")
        t0 = time.perf_counter()
        try:
            makers[name] = build()
            log(f"  cuda: {name} ready in {time.perf_counter() - t0:.1f} s")
        except Exception as e:  # record and go on
            traceback.print_exc()
            errors[name] = _err(e)

    shared: dict[str, Any] = {}

    def compiled_breakable() -> Any:
        if "compiled" not in shared:
            cfg = setup.config("FULL_AND_PIECEWISE", capture_sizes=capture_sizes, max_capture_size=max(capture_sizes))
            shared["compiled"] = torch.compile(model, backend=pb.make_backend(cfg))
        return shared["compiled"]

    def runner_variant(mode: str, **kw: Any) -> Callable[[], Callable[[int], Callable[[], Any]]]:
        def build() -> Callable[[int], Callable[[], Any]]:
            cfg = setup.config(mode, capture_sizes=capture_sizes, max_capture_size=max(capture_sizes), **kw)
            compiled = compiled_breakable() if cfg.use_breakable else torch.compile(model, backend=pb.make_backend(cfg))
            runner = setup.runner(compiled, cfg)
            with quiet_logs():
                runner.capture(progress=False)  # closed after: a step that would capture raises
            return lambda b: setup.runner_step(runner, b)

        return build

    add("FULL", runner_variant("FULL"))
    add("breakable PIECEWISE", runner_variant("PIECEWISE"))
    add("per-piece PIECEWISE", runner_variant("PIECEWISE", use_breakable=False))

    def torch_variant(**compile_kw: Any) -> Callable[[], Callable[[int], Callable[[], Any]]]:
        def build() -> Callable[[int], Callable[[], Any]]:
            compiled = torch.compile(model, **compile_kw)
            _mark_dynamic_static(setup)
            for b in sorted(batches, reverse=True):  # compile, warm up and record every size
                step = setup.plain_step(compiled, b, mark_step=True)
                for _ in range(3):
                    step()
            return lambda b: setup.plain_step(compiled, b, mark_step=True)

        return build

    kinds = {"reduce-overhead": dict(mode="reduce-overhead"), "cudagraphs": dict(backend="cudagraphs")}
    for name in foreign:
        if setup.simulate:
            errors[name] = "not run: needs a CUDA device"
        else:
            add(name, torch_variant(**kinds[name]))
    return makers, errors


def agree(out: Any, ref: torch.Tensor) -> tuple[bool, float]:
    """(close enough, max |out - ref|): within RTOL of max |ref|, same shape, finite."""
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return False, float("nan")
    diff = float((out.float() - ref.float()).abs().max())
    return diff <= RTOL * max(float(ref.float().abs().max()), 1.0), diff


def latency(
    setup: Setup, quick: bool, deadline: float | None, batches: tuple[int, ...] = BATCHES,
    foreign: tuple[str, ...] = FOREIGN, on_row: Callable[[Section], None] | None = None,
) -> Section:
    """The decode-step table; every variant's logits are checked against eager's at every batch.

    ``data["failed"]``: this library's variants that failed or disagreed (the benchmark then fails);
    a foreign variant's failure is only reported. ``on_row``: called with the table so far after each batch.
    """
    makers, errors = build_variants(setup, deadline, batches, foreign)
    sync = torch.cuda.synchronize if setup.device == "cuda" else None
    names = list(makers)
    rows: list[list[Any]] = []
    ratio_rows: list[list[Any]] = []
    diffs: dict[str, float] = {}
    wrong: dict[str, str] = {}

    def section(final: bool) -> Section:
        shown = names + [n for n in errors if n not in names]
        body = (
            "Decode step (one token per request), latency per step in us (median over interleaved repetitions, "
            "wall clock, synchronized per block). Model: "
            + ", ".join(f"{k}={v}" for k, v in setup.dims.items())
            + f", fp32, KV cache of {MAX_LEN} positions. Every variant's logits are checked against eager's at "
            f"every batch (within {RTOL:g} of max |logits|).\n\n"
            + table(["batch"] + shown, [r + [errors.get(n, "failed") for n in shown[len(r) - 1:]] for r in rows])
            + "\n\nRatio to eager, paired per repetition (median [p25, p75]; below 1 is faster):\n\n"
            + table(["batch"] + shown[1:], ratio_rows)
            + "\n\nmax |logits - eager| over the batches: "
            + ", ".join(f"{n} {d:.2e}" for n, d in diffs.items())
        )
        problems = {**errors, **wrong}
        if problems:
            body += "\n\nVariants that failed, disagreed or were skipped:\n\n" + table(["variant", "error"], list(problems.items()))
        failed = sorted(n for n in LIBRARY if n in problems)
        if not final:
            body += "\n\n_(measuring: more batches follow)_"
        return Section("Decode-step latency (CUDA)", body, {"failed": failed, "foreign_failed": sorted(
            n for n in foreign if n in problems), "diffs": diffs})

    for b in batches:
        if deadline is not None and time.monotonic() > deadline:
            rows.append([b] + ["skipped (time budget)"] * len(names))
            continue
        vs, got = [], set()
        ref = makers["eager"](b)()
        ref = ref.clone()
        for name in names:
            try:
                step = makers[name](b)
                ok, diff = agree(step(), ref)
                diffs[name] = diff if math.isnan(diff) else max(diffs.get(name, 0.0), diff)
                if not ok:
                    wrong.setdefault(name, f"logits differ from eager at batch {b}: max |diff| {diff:.3g}")
                    continue
                vs.append(Variant(name, step, sync=sync, clock="wall"))
                got.add(name)
            except Exception as e:
                traceback.print_exc()
                errors.setdefault(name, _err(e))
        s = measure(vs, reps=5 if quick else 15, target_s=0.01 if quick else 0.02, deadline=deadline)
        rows.append([b] + [f"{s.median(n) * 1e6:.1f}" if n in got else ("wrong" if n in wrong else "failed")
                           for n in names])
        if "eager" in got:
            ratio_rows.append([b] + [fmt_ratio(s.ratios(n, "eager")) if n in got else "-" for n in names[1:]]
                              + ["-"] * len([n for n in errors if n not in names]))
        if on_row is not None:
            on_row(section(final=False))
    diffs.pop("eager", None)
    return section(final=True)


def capture_report(setup: Setup, deadline: float | None) -> Section:
    """GraphRunner.capture() over the default ladder (max_capture_size=512)."""
    rows = []
    cases = [
        ("FULL_AND_PIECEWISE (breakable)", "FULL_AND_PIECEWISE", {}),
        ("PIECEWISE (breakable)", "PIECEWISE", {}),
        ("PIECEWISE (per-piece)", "PIECEWISE", {"use_breakable": False}),
    ]
    # padding tokens write to the dummy slot, so the default ladder needs no more KV slots
    big = {k: torch.full((MAX_TOKENS,), setup.pad[k], dtype=torch.long, device=setup.device) for k in setup.src}
    big["positions"].fill_(POS)
    for label, mode, kw in cases:
        if deadline is not None and time.monotonic() > deadline:
            rows.append([label, "skipped (time budget)", "", "", ""])
            continue
        log(f"  cuda: default-ladder capture, {label}")
        try:
            cfg = setup.config(mode, max_capture_size=MAX_TOKENS, **kw)
            compiled = torch.compile(setup.model, backend=pb.make_backend(cfg))
            runner = setup.runner(compiled, cfg)
            t0 = time.perf_counter()
            with quiet_logs():
                report = runner.capture(progress=False)  # closed after: a step that would capture raises
            wall = time.perf_counter() - t0
            # one real step at the top of the ladder, to show the captured graphs run
            n = MAX_TOKENS * 3 // 5
            runner.run(input_ids=big["input_ids"][:n], slot_mapping=big["slot_mapping"][:n],
                       positions=big["positions"][:n])
            rows.append([label, report.graphs, f"{report.seconds:.1f}", f"{wall:.1f}", report.stats])
            del runner, compiled
        except Exception as e:
            traceback.print_exc()
            rows.append([label, _err(e), "", "", ""])
        gc.collect()
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    sizes = pb.default_capture_sizes(MAX_TOKENS)
    body = (
        f"Default ladder: {len(sizes)} sizes ({sizes[0]}..{sizes[-1]}); `GraphRunner.capture()` report: graphs, "
        "seconds (eager warm-up of every size included; the first warm-ups also run Dynamo/Inductor on "
        "a cold process cache) and the bytes the capture added to the graph pool. All graphs share one pool, "
        "so a later row can reuse memory an earlier row added.\n\n"
        + table(["mode", "graphs", "capture s (report)", "wall s", "graph memory (report)"], rows)
    )
    return Section("Capture time and graph memory, default ladder (CUDA)", body)


PARTS = ("latency", "capture")


def run(
    quick: bool = False, deadline: float | None = None, simulate: bool = False, parts: tuple[str, ...] = PARTS,
    headline: bool = False, on_update: Callable[[list[Section]], None] | None = None,
) -> list[Section]:
    """The CUDA sections. ``headline``: only the decode-latency table at batch 1, 8 and 32 against eager and
    ``reduce-overhead`` (scripts/gpu_check.sh's first benchmark). ``on_update``: called with the sections so far
    whenever a batch was measured (to write them out at once)."""
    if not torch.cuda.is_available() and not simulate:
        return [Section("CUDA benchmarks", "not run: no CUDA device", {"failed": ["no CUDA device"]})]
    raise_recompile_limits()
    device = "cpu" if simulate else "cuda"
    global BATCHES, MAX_TOKENS
    if headline:
        BATCHES, parts = HEADLINE_BATCHES, ("latency",)
    elif simulate:
        BATCHES, MAX_TOKENS = (1, 4, 8), 16  # the simulator is slow: a smoke test of the script
    if simulate:
        torch.set_num_threads(1)
    sections: list[Section] = []
    foreign = ("reduce-overhead",) if headline else FOREIGN

    def partial(section: Section) -> None:
        if on_update is not None:
            on_update(sections + [section])

    with torch.inference_mode():
        setup = Setup(device, simulate)
        jobs = {"latency": lambda: latency(setup, quick, deadline, BATCHES, foreign, on_row=partial),
                "capture": lambda: capture_report(setup, deadline)}
        for name in parts:
            try:
                sections.append(jobs[name]())
            except Exception as e:  # never lose the other sections
                traceback.print_exc()
                sections.append(Section("CUDA benchmark error", _err(e), {"failed": [name]}))
            with contextlib.suppress(Exception):
                pb.set_capture_enabled(True)
            if on_update is not None:
                on_update(sections)
    if simulate:
        for s in sections:
            s.title += " [simulated on CPU: timings meaningless]"
    return sections


def failures(sections: list[Section]) -> list[str]:
    """This library's variants (or parts) that failed or disagreed with eager, over ``sections``."""
    return [name for s in sections for name in s.data.get("failed", ())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--simulate", action="store_true", help="check the script on the CPU simulator")
    ap.add_argument("--headline", action="store_true", help="decode latency at batch 1, 8, 32 only (vs reduce-overhead)")
    ap.add_argument("--out", type=Path, help="markdown file rewritten with the tables as soon as each batch is measured")
    args = ap.parse_args(argv)

    def write(sections: list[Section]) -> None:
        if args.out is not None:
            text = "\n".join(s.markdown() for s in sections)
            args.out.write_text(f"{env_table(environment('cpu' if args.simulate else 'cuda'))}\n\n{text}")

    sections = run(quick=args.quick, simulate=args.simulate, headline=args.headline, on_update=write)
    write(sections)
    for s in sections:
        print(s.markdown(), flush=True)
    failed = failures(sections)
    if failed:
        print(f"FAILED: {', '.join(failed)} (a variant of this library failed or disagreed with eager)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
