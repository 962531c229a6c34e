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
step for step. Each variant is set up inside ``try``: a failure becomes a table cell, not
a crash. Written for torch 2.11+ on one GPU; ``--simulate`` runs the ``pb`` variants on the
CPU simulator to check the script itself without a GPU (timings meaningless there).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import piecewise_backend as pb
from benchmarks.common import Section, Variant, fmt_ratio, log, measure, quiet_logs, raise_recompile_limits, table
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


def build_variants(setup: Setup, deadline: float | None) -> tuple[dict[str, Callable[[int], Callable[[], Any]]], dict[str, str]]:
    """name -> (batch -> step); name -> error for the variants that could not be set up."""
    makers: dict[str, Callable[[int], Callable[[], Any]]] = {}
    errors: dict[str, str] = {}
    model = setup.model
    makers["eager"] = lambda b: setup.plain_step(model, b)
    capture_sizes = list(BATCHES)

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
            for b in sorted(BATCHES, reverse=True):  # compile, warm up and record every size
                step = setup.plain_step(compiled, b, mark_step=True)
                for _ in range(3):
                    step()
            return lambda b: setup.plain_step(compiled, b, mark_step=True)

        return build

    if setup.simulate:
        errors["reduce-overhead"] = errors["cudagraphs"] = "not run: needs a CUDA device"
    else:
        add("reduce-overhead", torch_variant(mode="reduce-overhead"))
        add("cudagraphs", torch_variant(backend="cudagraphs"))
    return makers, errors


def check(setup: Setup, makers: dict[str, Callable[[int], Callable[[], Any]]], errors: dict[str, str]) -> dict[str, float]:
    """Max |variant - eager| of the logits at the largest batch; a failing variant moves to errors."""
    b = max(BATCHES)
    ref = makers["eager"](b)()
    ref = ref.clone() if isinstance(ref, torch.Tensor) else ref
    diffs = {}
    for name in list(makers):
        if name == "eager":
            continue
        try:
            out = makers[name](b)()
            diffs[name] = float((out.float() - ref.float()).abs().max())
        except Exception as e:
            traceback.print_exc()
            errors[name] = _err(e)
            del makers[name]
    return diffs


def latency(setup: Setup, quick: bool, deadline: float | None) -> Section:
    makers, errors = build_variants(setup, deadline)
    diffs = check(setup, makers, errors)
    sync = torch.cuda.synchronize if setup.device == "cuda" else None
    names = list(makers)
    rows, ratio_rows = [], []
    for b in BATCHES:
        if deadline is not None and time.monotonic() > deadline:
            rows.append([b] + ["skipped (time budget)"] * len(names))
            continue
        vs = []
        for name in names:
            try:
                step = makers[name](b)
                step()
                vs.append(Variant(name, step, sync=sync, clock="wall"))
            except Exception as e:
                errors.setdefault(name, _err(e))
        s = measure(vs, reps=5 if quick else 15, target_s=0.01 if quick else 0.02, deadline=deadline)
        got = {v.name for v in vs}
        rows.append([b] + [f"{s.median(n) * 1e6:.1f}" if n in got else "failed" for n in names])
        if "eager" in got:
            ratio_rows.append([b] + [fmt_ratio(s.ratios(n, "eager")) if n in got else "-" for n in names[1:]])
    body = (
        "Decode step (one token per request), latency per step in us (median over interleaved repetitions, "
        "wall clock, synchronized per block). Model: "
        + ", ".join(f"{k}={v}" for k, v in setup.dims.items())
        + f", fp32, KV cache of {MAX_LEN} positions.\n\n"
        + table(["batch"] + names, rows)
        + "\n\nRatio to eager, paired per repetition (median [p25, p75]; below 1 is faster):\n\n"
        + table(["batch"] + names[1:], ratio_rows)
        + "\n\nmax |logits - eager| at batch "
        + f"{max(BATCHES)}: "
        + ", ".join(f"{n} {d:.2e}" for n, d in diffs.items())
    )
    if errors:
        body += "\n\nVariants that failed or were skipped:\n\n" + table(["variant", "error"], list(errors.items()))
    return Section("Decode-step latency (CUDA)", body)


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
    quick: bool = False, deadline: float | None = None, simulate: bool = False, parts: tuple[str, ...] = PARTS
) -> list[Section]:
    if not torch.cuda.is_available() and not simulate:
        return [Section("CUDA benchmarks", "not run: no CUDA device")]
    raise_recompile_limits()
    device = "cpu" if simulate else "cuda"
    if simulate:
        global BATCHES, MAX_TOKENS
        BATCHES, MAX_TOKENS = (1, 4, 8), 16  # the simulator is slow: a smoke test of the script
        torch.set_num_threads(1)
    sections = []
    with torch.inference_mode():
        setup = Setup(device, simulate)
        jobs = {"latency": lambda: latency(setup, quick, deadline), "capture": lambda: capture_report(setup, deadline)}
        for name in parts:
            try:
                sections.append(jobs[name]())
            except Exception as e:  # never lose the other sections
                traceback.print_exc()
                sections.append(Section("CUDA benchmark error", _err(e)))
            with contextlib.suppress(Exception):
                pb.set_capture_enabled(True)
    if simulate:
        for s in sections:
            s.title += " [simulated on CPU: timings meaningless]"
    return sections


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--simulate", action="store_true", help="check the script on the CPU simulator")
    args = ap.parse_args()
    for s in run(quick=args.quick, simulate=args.simulate):
        print(s.markdown())


if __name__ == "__main__":
    main()
