"""Capture time of ``examples/serve.py`` on the simulated platform: what fidelity costs.

The serving setup of the example (toy Llama, 2 layers, ``pb_toy::attention`` custom op,
FULL_AND_PIECEWISE, capture sizes 1-32: 12 graphs) is captured by a fresh
``GraphRunner`` per timing, under three settings of the simulator, side by side:

* ``op as a whole``: the behaviour before issue 9: a custom op is recorded as one op (its
  Python re-runs on replay) and nothing checks that the recording is complete;
* ``inside ops``: the ATen ops inside custom ops are recorded (no Python on replay);
* ``inside ops + checks`` (the default): also the checks that refuse unrecordable work
  (caller check per op, validation replay per segment).

Each timing is one ``capture()`` (warmups included, as the example reports it), on the
CPU time of this thread. Run: ``python benchmarks/bench_sim_capture.py [--quick]``.
"""

from __future__ import annotations

import contextlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import torch

import piecewise_backend as pb
from benchmarks.common import Section, Variant, fmt_ratio, fmt_spread, measure, table
from piecewise_backend.platforms import get_platform
from piecewise_backend.toy_llama import AttnMetadata, make_model

MAX_REQS, MAX_LEN = 4, 32
SETTINGS = {  # name -> (record_inside_ops, validate)
    "op as a whole": (False, False),
    "inside ops": (True, False),
    "inside ops + checks": (True, True),
}


def _serve_setup() -> tuple[torch.nn.Module, pb.CompilationConfig, dict]:
    config = pb.CompilationConfig(
        cudagraph_mode="FULL_AND_PIECEWISE",
        capture_sizes=[1, 2, 4, 8, 16, 32],
        platform="simulated",
        compile_pieces="eager",
    )
    model = make_model(num_layers=2, attention="inplace")
    compiled = torch.compile(model, backend=pb.make_backend(config))
    kv = model.make_kv_caches(MAX_REQS + 1, MAX_LEN)
    kwargs = dict(
        inputs=[pb.StaticInput("input_ids"), pb.StaticInput("slot_mapping", pad=MAX_REQS), pb.StaticInput("positions")],
        model_args=["input_ids"],
        context_fn=lambda v: {"attn_metadata": AttnMetadata(v["slot_mapping"], v["positions"], kv)},
    )
    return compiled, config, kwargs


@contextlib.contextmanager
def _setting(record_inside_ops: bool, validate: bool):
    sim = get_platform("simulated")
    saved = sim.record_inside_ops, sim.validate
    sim.record_inside_ops, sim.validate = record_inside_ops, validate
    try:
        yield
    finally:
        sim.record_inside_ops, sim.validate = saved


def run(quick: bool = False, deadline: float | None = None) -> list[Section]:
    compiled, config, kwargs = _serve_setup()
    sim = get_platform("simulated")
    recorded: dict[str, int] = {}

    def capture(name: str) -> None:
        runner = pb.GraphRunner(compiled, config, **kwargs)
        before = sim.memory()
        runner.capture(disable_after=False, progress=False)
        recorded[name] = sim.memory() - before

    variants = [
        Variant(name, capture, (name,), context=lambda s=s: _setting(*s), number=1)
        for name, s in SETTINGS.items()
    ]
    with torch.inference_mode():
        capture("warm-up")  # Dynamo compiles the model here, outside the timings
        samples = measure(variants, reps=3 if quick else 7, deadline=deadline)
    base = "op as a whole"
    rows = [
        [
            name,
            fmt_spread(samples.times[name], 1e3, 0, " ms"),
            "1.000x" if name == base else fmt_ratio(samples.ratios(name, base)),
            recorded[name],
        ]
        for name in SETTINGS
    ]
    body = (
        "Capture of `examples/serve.py`'s 12 graphs (toy Llama, 2 layers, FULL_AND_PIECEWISE, sizes 1-32), "
        f"one `capture()` per timing, {len(samples.times[base])} interleaved repetitions, CPU time of the "
        "timing thread.\n\n"
        + table(["simulator setting", "capture time", "vs op as a whole", "ATen ops recorded"], rows)
    )
    return [Section("Simulated capture time: recording inside custom ops", body)]


if __name__ == "__main__":
    for section in run(quick="--quick" in sys.argv):
        print(section.markdown())
