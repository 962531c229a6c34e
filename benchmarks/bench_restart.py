"""Restart time: from ``torch.compile`` (or loading) to the first output, in fresh processes.

Four ways to get a compiled toy Llama (hidden 256) running, 1 and 8 layers:

* ``inductor``: whole-graph ``torch.compile`` (Inductor), the reference;
* ``piecewise``: the piecewise backend, no ``cache_dir``;
* ``cache_dir``: the piecewise backend with ``CompilationConfig(cache_dir=...)``;
* ``aot``: ``pb.aot_compile(..., path=...)`` in the cold process, ``pb.load_compiled`` in the warm ones.

Each (variant, layers) pair gets its own empty ``TORCHINDUCTOR_CACHE_DIR`` and cache files:
"cold" is its first process, "warm" the next ones on the same directories. The variants of one
phase run one after the other in a shuffled order, so background load hits them alike. The
token dimension is marked with ``pb.mark_token_dim`` (one graph for every size) for every variant.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Section, log, spawn_child, table

MODEL = dict(hidden_size=256, num_heads=4, intermediate_size=512, vocab_size=1024)
VARIANTS = ("inductor", "piecewise", "cache_dir", "aot")


def child(layers: int, variant: str, phase: str, work: str) -> dict:
    """Runs in the subprocess: time from compile (or load) to the first output."""
    t0 = time.perf_counter()
    import torch

    import piecewise_backend as pb
    from piecewise_backend.toy_llama import make_model

    t_import = time.perf_counter() - t0
    model = make_model(num_layers=layers, attention="inplace", **MODEL)
    aot_path = os.path.join(work, "model.pb")
    with torch.inference_mode():
        ids = torch.randint(0, MODEL["vocab_size"], (8,))
        t1 = time.perf_counter()
        if variant == "inductor":
            compiled = torch.compile(model)
        elif variant == "aot":
            if phase == "cold":
                compiled = pb.aot_compile(model, [pb.mark_token_dim(ids.clone())], path=aot_path)
            else:
                compiled = pb.load_compiled(aot_path, model)
        else:
            cache = os.path.join(work, "pieces") if variant == "cache_dir" else None
            compiled = torch.compile(model, backend=pb.make_backend(pb.CompilationConfig(cache_dir=cache)))
        out = compiled(pb.mark_token_dim(ids.clone()) if variant != "aot" else ids)
        t_first = time.perf_counter() - t1
        ok = bool(torch.allclose(out, model(ids), atol=1e-4, rtol=1e-4))
    keys = ("graphs", "compiled_pieces", "compiles", "cache_loads", "cache_saves", "cache_rejects")
    return {"import_s": t_import, "first_output_s": t_first, "matches_eager": ok,
            "counters": {k: pb.counters[k] for k in keys}}


def _spawn(layers: int, variant: str, phase: str, work: str, timeout: float) -> dict:
    args = ["--layers", str(layers), "--variant", variant, "--phase", phase, "--work", work]
    return spawn_child("benchmarks.bench_restart", args, os.path.join(work, "inductor"), timeout)


def run(quick: bool = False, layer_counts: tuple[int, ...] = (1, 8), warm_reps: int = 2, seed: int = 0) -> list[Section]:
    rng = random.Random(seed)
    layer_counts = (1,) if quick else layer_counts
    warm_reps = 1 if quick else warm_reps
    data: dict[str, list[dict]] = {}
    works = {(v, n): tempfile.mkdtemp(prefix=f"pb_restart_{v}_{n}_") for v in VARIANTS for n in layer_counts}
    try:
        for layers in layer_counts:
            for phase in ["cold"] + ["warm"] * warm_reps:
                order = list(VARIANTS)
                rng.shuffle(order)
                for variant in order:
                    try:
                        r = _spawn(layers, variant, phase, works[variant, layers], timeout=900)
                        log(f"  restart: {variant} {layers} layer(s), {phase}: first output {r['first_output_s']:.1f} s, "
                            f"process {r['process_s']:.1f} s, {r['counters']}")
                    except Exception as e:  # keep the table: record the failure
                        log(f"  restart: {variant} {layers} layer(s), {phase}: FAILED {e}")
                        r = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}
                    data.setdefault(f"{variant}/{layers}/{phase}", []).append(r)
    finally:
        for w in works.values():
            shutil.rmtree(w, ignore_errors=True)

    def med(variant: str, layers: int, phase: str, field: str = "first_output_s") -> float | None:
        runs = [r for r in data.get(f"{variant}/{layers}/{phase}", []) if "error" not in r]
        return statistics.median(r[field] for r in runs) if runs else None

    rows = []
    for layers in layer_counts:
        base = med("inductor", layers, "warm")
        for variant in VARIANTS:
            cold, warm = med(variant, layers, "cold"), med(variant, layers, "warm")
            runs = data.get(f"{variant}/{layers}/cold", []) + data.get(f"{variant}/{layers}/warm", [])
            errors = [r["error"] for r in runs if "error" in r]
            last = next((r for r in reversed(runs) if "error" not in r), None)
            c = last["counters"] if last else {}
            rows.append([
                variant, layers,
                f"{cold:.1f}" if cold is not None else "error",
                f"{warm:.1f}" if warm is not None else "error",
                f"{warm / base:.2f}x" if warm is not None and base else "-",
                f"{med(variant, layers, 'warm', 'process_s'):.1f}" if warm is not None else "-",
                f"{c.get('compiles', 0)} / {c.get('cache_loads', 0)}" if variant != "inductor" else "-",
                "yes" if all(r.get("matches_eager") for r in runs if "error" not in r) else "NO",
                "; ".join(e.splitlines()[-1] for e in errors)[:200],
            ])
    body = (
        "Fresh process per cell; seconds from `torch.compile` / `pb.aot_compile` / `pb.load_compiled` to the first "
        f"output (T=8), median of {warm_reps} warm process(es); warm vs the whole-graph Inductor warm restart of "
        "the same run.\n\n"
        + table(["variant", "layers", "cold s", "warm s", "warm / inductor warm", "warm process s (with imports)",
                 "compiles / loads (last warm)", "matches eager", "errors"], rows)
    )
    return [Section("Restart: compile or load to first output, cold and warm (CPU)", body, data)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--variant", choices=VARIANTS, default="piecewise")
    ap.add_argument("--phase", choices=("cold", "warm"), default="cold")
    ap.add_argument("--work", default="")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warm-reps", type=int, default=2)
    ap.add_argument("--layer-counts", default="1,8", help="comma-separated, e.g. 1,8")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.layers, args.variant, args.phase, args.work)))
        return
    counts = tuple(int(n) for n in args.layer_counts.split(","))
    for s in run(quick=args.quick, layer_counts=counts, warm_reps=args.warm_reps):
        print(s.markdown())


if __name__ == "__main__":
    main()
