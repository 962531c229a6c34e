"""Graph memory of a whole capture ladder against its largest size alone, and the estimate.

Every graph shares one pool and an entry keeps what its capture allocated only through weak
views, so a smaller size captured after a larger one reuses the larger one's memory: the
ladder should cost about its largest size (goal: <= 1.25x). ``estimate_capture_memory()``
captures the largest descriptor of each mode into a scratch pool before the real capture
(goal: within 10 % of what the capture then adds).

Model: toy Llama, 4 layers, hidden 256, attention as a splitting op; default capture ladder
up to 256 tokens (35 sizes; ``--quick``: up to 64, 11 sizes). Schemes: the breakable wrapper
(PIECEWISE), the classic per-piece wrappers (``use_breakable=False``), FULL, and
FULL_AND_PIECEWISE (both ladders into one pool). Memory is pool bytes: the simulated pool on
the CPU (``platform="simulated"``), the CUDA graph pool with ``--cuda``. "strong entries" is
the counterfactual, measured in the same run: the ladder captured with entries that own what
their capture allocated (``weak.strong_references()``), as before entries held weak views.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import torch

import piecewise_backend as pb
from benchmarks.common import Section, log, quiet_logs, raise_recompile_limits, table
from piecewise_backend.capture.memory import captured_wrappers, fresh_pool
from piecewise_backend.platforms import get_platform
from piecewise_backend.toy_llama import make_model
from piecewise_backend.weak import strong_references

M = pb.CUDAGraphMode
MIB = 2**20
SCHEMES = (  # name, mode, use_breakable
    ("breakable", M.PIECEWISE, True),
    ("per-piece", M.PIECEWISE, False),
    ("FULL", M.FULL, True),
    ("FULL_AND_PIECEWISE", M.FULL_AND_PIECEWISE, True),
)


@contextlib.contextmanager
def measured_alone(platform: object) -> Iterator[None]:
    """Measure in a pool of its own; drop every graph and give its memory back afterwards."""
    with fresh_pool(platform):
        try:
            yield
        finally:
            for w in captured_wrappers():
                w.clear_graphs()


def _capture(runner: pb.GraphRunner) -> pb.CaptureReport:
    with torch.no_grad():
        return runner.capture(progress=False)


def measure_scheme(model: torch.nn.Module, config: pb.CompilationConfig, device: str) -> dict[str, float]:
    platform = get_platform(config.platform)
    inputs = [pb.StaticInput("input_ids")]
    ladder = config.sizes
    with measured_alone(platform):
        alone = _capture(pb.GraphRunner(model, config.replace(capture_sizes=[ladder[-1]]), inputs, device=device))
    with measured_alone(platform), strong_references():  # the counterfactual: entries own what they captured
        strong = _capture(pb.GraphRunner(model, config, inputs, device=device))
    with measured_alone(platform):
        runner = pb.GraphRunner(model, config, inputs, device=device)
        with torch.no_grad():
            estimate = runner.estimate_capture_memory()
        report = _capture(runner)
        ids = torch.randint(0, 128, (ladder[-1] - 3,), device=device)
        with torch.no_grad():  # the shared pool must not change results
            torch.testing.assert_close(runner.run(input_ids=ids), model(ids))
    return {
        "sizes": len(ladder), "descriptors": report.descriptors, "graphs": report.graph_segments,
        "ladder": report.memory_bytes, "alone": alone.memory_bytes, "strong": strong.memory_bytes, "estimate": estimate, "seconds": report.seconds,
    }


def run(quick: bool = False, deadline: float | None = None, cuda: bool = False) -> list[Section]:
    raise_recompile_limits()
    torch.set_num_threads(1)  # on a loaded CPU, more threads made each small copy cost milliseconds
    device = "cuda" if cuda else "cpu"
    platform = "cuda" if cuda else "simulated"
    max_size = 64 if quick else 256
    model = make_model(4, "inplace", hidden_size=256, intermediate_size=512, device=device)
    compiled: dict[bool, torch.nn.Module] = {}
    rows, data = [], {}
    with quiet_logs():
        for name, mode, breakable in SCHEMES:
            if deadline is not None and time.monotonic() > deadline:
                rows.append([name] + ["(out of time)"] * 9)
                continue
            config = pb.CompilationConfig(cudagraph_mode=mode, platform=platform, compile_pieces="eager",
                                          use_breakable=breakable, max_capture_size=max_size)
            if breakable not in compiled:
                torch._dynamo.reset()
                compiled[breakable] = torch.compile(model, backend=pb.make_backend(config))
            log(f"memory: {name}")
            r = measure_scheme(compiled[breakable], config, device)
            data[name] = r
            ratio, est = r["ladder"] / r["alone"], r["estimate"] / r["ladder"]
            rows.append([
                name, r["sizes"], f"{r['descriptors']} / {r['graphs']}", f"{r['ladder'] / MIB:.2f}",
                f"{r['alone'] / MIB:.2f}", f"{ratio:.3f}x ({'ok' if ratio <= 1.25 else 'ABOVE GOAL'})",
                f"{r['estimate'] / MIB:.2f}", f"{est:.3f} ({'ok' if abs(est - 1) <= 0.1 else 'OFF GOAL'})",
                f"{r['strong'] / MIB:.2f} ({r['strong'] / r['alone']:.1f}x)", f"{r['seconds']:.1f}",
            ])
    headers = ["scheme", "sizes", "descriptors / graphs", "ladder MiB", "largest alone MiB",
               "ladder / largest (goal <= 1.25x)", "estimate MiB", "estimate / actual (goal 0.9-1.1)",
               "strong entries MiB (x largest)", "capture s"]
    where = "CUDA graph pool" if cuda else "simulated pool (CPU)"
    body = (f"Toy Llama 4 layers, hidden 256, ladder up to {max_size} tokens, {where}.\n\n"
            + table(headers, rows))
    return [Section(f"Graph memory: ladder vs largest size, estimate vs actual ({where})", body, data)]


if __name__ == "__main__":
    for s in run(quick="--quick" in sys.argv, cuda="--cuda" in sys.argv):
        print(s.markdown())
