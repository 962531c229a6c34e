"""Cold start: seconds per captured graph, up-front ``capture()`` vs ``capture_idle``, by model depth.

Two HFEngines per depth (tiny llama widths, 4 and 24 layers; 2 with ``--quick``), simulated
graphs, eager pieces, FULL_AND_PIECEWISE up to 32 tokens, side by side in one process:

* **up-front**: ``capture()`` of every descriptor right after the engine is built (Dynamo cold for
  this engine's code object): its :class:`~piecewise_backend.CaptureReport` splits the seconds into
  the compile (the first warm-up traces the model), warm-ups, captures, the simulator's checks, gc;
* **capture_idle**: a lazy engine serves the same traffic (uncompiled), then ``capture_idle`` compiles
  (measured apart: ``runner.lazy.compile_seconds``) and captures what the traffic asked for;
* **no Dynamo**: ``capture()`` of an engine with ``compile_pieces="none"`` (the model's own forward, its
  splitting ops breaking at run time): no compile at all; its seconds against up-front's (goal <= 0.5x).

"per graph" is the seconds without the compile, divided by the graphs captured: what a graph costs
once the model is compiled, the number the two paths should agree on. The time to first token
(lazy vs up-front, fresh processes) is ``bench_serving``'s first table.

    python -m benchmarks.bench_cold_start [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import piecewise_backend as pb
from benchmarks.common import Section, fmt_time, log, quiet_logs, raise_recompile_limits, table

PROMPTS = [[5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [42]]


def engines(layers: int) -> tuple[dict, list[list]]:
    """Seconds of each path at ``layers`` layers: a dict per variant, and the rows of the table."""
    from piecewise_backend import hf

    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", cudagraph_mode="FULL_AND_PIECEWISE",
                                  max_capture_size=32)
    kwargs = {"max_num_reqs": 4, "max_model_len": 64, "block_size": 16}

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return hf.tiny_random_model("llama", num_hidden_layers=layers)

    log(f"cold start: {layers} layers, up-front capture()")
    up = hf.HFEngine(model(), config, **kwargs)
    report = up.capture()
    tokens = up.generate(PROMPTS, 8)
    log(f"cold start: {layers} layers, lazy then capture_idle")
    lazy = hf.HFEngine(model(), config, lazy_capture=True, step_capture_budget_s=0, **kwargs)
    if lazy.generate(PROMPTS, 8) != tokens:
        raise AssertionError(f"{layers} layers: the lazy engine's tokens differ from the up-front engine's")
    began = time.perf_counter()
    captured = lazy.capture_idle(600.0)
    idle_s = time.perf_counter() - began
    if lazy.generate(PROMPTS, 8) != tokens:
        raise AssertionError(f"{layers} layers: tokens differ after capture_idle")
    compile_idle = lazy.runner.lazy.compile_seconds or 0.0
    log(f"cold start: {layers} layers, compile_pieces='none' capture()")
    bare = hf.HFEngine(model(), config.replace(compile_pieces="none"), **kwargs)
    bare_report = bare.capture()
    if bare.generate(PROMPTS, 8) != tokens:
        raise AssertionError(f"{layers} layers: the engine without Dynamo gives other tokens than the compiled one")
    p = report.phases
    result = {
        "up-front": {"graphs": report.graphs, "seconds": report.seconds, "compile": p["compile"],
                     "per_graph": (report.seconds - p["compile"]) / report.graphs, "phases": p},
        "capture_idle": {"graphs": len(captured), "seconds": idle_s, "compile": compile_idle,
                         "per_graph": (idle_s - compile_idle) / max(1, len(captured))},
        "no Dynamo": {"graphs": bare_report.graphs, "seconds": bare_report.seconds, "compile": 0.0,
                      "per_graph": bare_report.seconds / max(1, bare_report.graphs)},
    }
    rows = []
    for name, r in result.items():
        split = (f"warm-up {fmt_time(p['warmup'])}, capture {fmt_time(p['capture'])}, checks {fmt_time(p['checks'])}, "
                 f"gc {fmt_time(p['gc'])}, other {fmt_time(p['other'])}") if name == "up-front" else "-"
        rows.append([layers, name, r["graphs"], fmt_time(r["seconds"]), fmt_time(r["compile"]), fmt_time(r["per_graph"]),
                     split])
    result["ratio"] = result["capture_idle"]["per_graph"] / result["up-front"]["per_graph"]
    result["no_dynamo_ratio"] = result["no Dynamo"]["seconds"] / result["up-front"]["seconds"]
    return result, rows


def warm() -> None:
    """A 1-layer engine captured on each path first: the process's one-time costs (the first Dynamo trace,
    the simulator's and transformers' first calls) would otherwise fall on whichever variant runs first."""
    from piecewise_backend import hf

    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", max_capture_size=4)
    for pieces in ("eager", "none"):
        torch.manual_seed(0)
        hf.HFEngine(hf.tiny_random_model("llama", num_hidden_layers=1), config.replace(compile_pieces=pieces),
                    max_num_reqs=2, max_model_len=32, block_size=16).capture()


def run(quick: bool = False, deadline: float | None = None) -> list[Section]:
    raise_recompile_limits()
    depths = (2,) if quick else (4, 24)
    rows, data = [], {}
    with quiet_logs():
        warm()
        for layers in depths:
            data[layers], r = engines(layers)
            rows += r
    body = table(["layers", "path", "graphs", "seconds", "of it: compile", "per graph (without the compile)",
                  "up-front split (without the compile)"], rows)
    ratios = ", ".join(f"{layers} layers {data[layers]['ratio']:.2f}x" for layers in depths)
    graphs = data[depths[0]]["up-front"]["graphs"]
    bare = ", ".join(f"{layers} layers {data[layers]['no_dynamo_ratio']:.2f}x" for layers in depths)
    body += (
        f"\n\nHFEngine, tiny llama widths, simulated graphs, eager pieces, FULL_AND_PIECEWISE up to 32 tokens ({graphs} "
        "graphs up front); capture_idle captures what 4 prompts of 8 new tokens asked for. One run each, in one process, "
        "after a 1-layer engine of each path warmed it. "
        f"capture_idle's seconds per graph vs up-front's: {ratios}. The compile (Dynamo's trace of the model and the "
        "pieces: the first warm-up up front, before the first capture in capture_idle) is what used to make up-front "
        "capture look slow per graph. compile_pieces='none' (no Dynamo: the same graphs, the splitting ops breaking at "
        f"run time) captures in this share of up-front capture()'s seconds, compile included: {bare} (goal <= 0.5x).\n"
    )
    return [Section("Cold start: seconds per captured graph, up-front vs capture_idle (simulated)", body,
                    {str(k): v for k, v in data.items()})]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers only")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for s in run(quick=args.quick):
        print(s.markdown(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
