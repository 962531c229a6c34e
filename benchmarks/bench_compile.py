"""Compile time of the backend for 1, 4 and 8 identical layers, cold and warm cache.

Each measurement is a fresh Python process (the first Inductor compile in a process pays
a fixed startup cost, which a long-lived benchmark process would hide):

* cold: a new, empty ``TORCHINDUCTOR_CACHE_DIR``;
* warm: a second process with the same cache directory.

"compile" is the wall time of the first call of the compiled model (Dynamo tracing,
splitting, Inductor); the child also reports the backend's counters, which show that
identical pieces compile once: ``compiles`` (Inductor runs) stays at the number of
*distinct* pieces while ``compiled_pieces`` grows with the layer count. Whole-graph
``torch.compile`` (Inductor) is measured the same way for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Section, log, spawn_child, table

MODEL = dict(hidden_size=256, num_heads=4, intermediate_size=512, vocab_size=1024)


def child(layers: int, variant: str) -> dict:
    """Runs in the subprocess: compile the model once, report times and counters as JSON."""
    t0 = time.perf_counter()
    import torch

    import piecewise_backend as pb
    from piecewise_backend.toy_llama import make_model

    t_import = time.perf_counter() - t0
    model = make_model(num_layers=layers, attention="inplace", **MODEL)
    ids = torch.randint(0, MODEL["vocab_size"], (8,))
    torch._dynamo.mark_dynamic(ids, 0)
    if variant == "piecewise":
        compiled = torch.compile(model, backend=pb.make_backend(pb.CompilationConfig()))
    else:
        compiled = torch.compile(model)
    with torch.inference_mode():
        t1 = time.perf_counter()
        compiled(ids)
        t_compile = time.perf_counter() - t1
    keys = ("graphs", "pieces", "splitting_pieces", "compiled_pieces", "compiles", "compile_cache_hits")
    return {
        "import_s": t_import,
        "compile_s": t_compile,
        "counters": {k: pb.counters[k] for k in keys},
    }


def _spawn(layers: int, variant: str, cache_dir: str, timeout: float) -> dict:
    return spawn_child("benchmarks.bench_compile", ["--layers", str(layers), "--variant", variant], cache_dir, timeout)


PLAN = {"piecewise": (1, 4, 8), "inductor": (1, 8)}


def run(quick: bool = False, deadline: float | None = None) -> list[Section]:
    plan = {"piecewise": (1, 4)} if quick else PLAN
    rows, data = [], {}
    for variant, layer_counts in plan.items():
        for layers in layer_counts:
            cache = tempfile.mkdtemp(prefix="pb_bench_inductor_cache_")
            try:
                for phase in ("cold", "warm"):
                    if deadline is not None and time.monotonic() > deadline:
                        rows.append([variant, layers, phase, "skipped (time budget)", "", "", ""])
                        continue
                    log(f"  compile: {variant} {layers} layer(s), {phase} cache")
                    try:
                        r = _spawn(layers, variant, cache, timeout=900)
                    except Exception as e:  # keep the table: record the failure
                        rows.append([variant, layers, phase, f"error: {type(e).__name__}: {str(e)[:200]}", "", "", ""])
                        continue
                    c = r["counters"]
                    pieces = (f"{c['compiles']} / {c['compiled_pieces']}" if variant == "piecewise" else "-")
                    rows.append([
                        variant, layers, phase, f"{r['compile_s']:.1f}", f"{r['process_s']:.1f}", pieces,
                        f"{c['pieces']} ({c['splitting_pieces']} split)" if variant == "piecewise" else "-",
                    ])
                    data[f"{variant}/{layers}/{phase}"] = r
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    body = (
        "Fresh process per row; cold = empty `TORCHINDUCTOR_CACHE_DIR`, warm = second process on the same "
        "directory. Token dimension marked dynamic (T=8).\n\n"
        + table(
            ["variant", "layers", "cache", "compile s (1st call)", "process s (with imports)",
             "compiles / compiled_pieces", "pieces"],
            rows,
        )
        + "\n\n`compiles / compiled_pieces`: Inductor compilations actually run / pieces that run compiled code "
        "(`pb.counters`). Identical layers compile once: the count of compilations stays at the number of "
        "distinct pieces (first, middle, last) whatever the layer count."
    )
    return [Section("Compile time: 1, 4, 8 identical layers, cold and warm cache (CPU)", body, data)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--variant", choices=("piecewise", "inductor"), default="piecewise")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.layers, args.variant)))
        return
    for s in run(quick=args.quick):
        print(s.markdown())


if __name__ == "__main__":
    main()
