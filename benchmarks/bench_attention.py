"""Attention cost against ``max_model_len`` at equal context, per attention backend.

Two tables, every variant timed side by side (interleaved repetitions):

* **op**: one decode step of ``pb_kv::paged_attention``'s attention (8 requests, 200 cached
  tokens each, 8 query heads over 2 KV heads of 64) at ``max_model_len`` 256 .. 8192: time per
  step and peak working memory, for ``reference``, ``bounded`` run eagerly (NONE steps,
  PIECEWISE breaks) and ``bounded`` as captured in a FULL graph (static span, online softmax),
  and ``varlen`` where it runs. Memory on the CPU: the most bytes of op outputs alive at once
  (inputs and the cache excluded); on CUDA: ``torch.cuda.max_memory_allocated`` above the start.
* **engine**: ``HFEngine`` on a tiny random llama (4 layers), 4 prompts, 24 new tokens each, in
  NONE and PIECEWISE modes (simulated platform on the CPU), ``max_model_len`` 8192 against 256,
  per backend; tokens are checked identical across every variant. Goal: <= 1.3x. With
  ``--device cuda``: FULL_AND_PIECEWISE on CUDA graphs, a bf16 model in blocks of 256 (what
  ``varlen`` takes); every variant must still produce the same tokens.
* **dsa**: the same check for indexed (sparse) attention: ``HFEngine`` on a tiny random
  ``deepseek_v32`` (indexer keys in the paged cache, top-k 4), NONE, PIECEWISE and
  FULL_AND_PIECEWISE, ``max_model_len`` 8192 against 256. Goal: <= 1.2x.

On CUDA the captured row is a real CUDA graph, timed by its replay. Every op output is checked
against the reference; the exit status is 1 if one differs, or the engine variants' tokens do.

    python -m benchmarks.bench_attention [--quick] [--device cuda] [--tables op,engine,dsa] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import piecewise_backend as pb
from benchmarks.common import (
    Section, Variant, env_table, environment, fmt_ratio, fmt_time, log, measure, quiet_logs, raise_recompile_limits,
    table, verdict,
)
from piecewise_backend import attention, kv

MIB = 2**20
LENS = (256, 1024, 4096, 8192)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of op outputs alive at once (storages counted once, released when their last tensor
    dies; views of tensors made outside, such as the cache or the metadata, not counted)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._storages: dict[int, list[int]] = {}

    def _release(self, key: int) -> None:
        entry = self._storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._storages[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outside = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key in outside and key not in self._storages:
                    continue  # a view of an input or of the cache: not working memory
                if key not in self._storages:
                    self._storages[key] = [0, t.untyped_storage().nbytes()]
                    self.live += self._storages[key][1]
                    self.peak = max(self.peak, self.live)
                self._storages[key][0] += 1
                weakref.finalize(t, self._release, key)
        return out


def decode_step(
    max_model_len: int, device: str, dtype: torch.dtype, block_size: int, reqs: int = 8, context: int = 200
) -> tuple[kv.PagedKVCache, kv.PagedAttentionMetadata, torch.Tensor]:
    """A cache holding ``reqs`` requests of ``context`` tokens, and one decode step's query and metadata."""
    g = torch.Generator().manual_seed(0)
    cache = kv.PagedKVCache(1, 2, 64, num_blocks=reqs * (-(-(context + 1) // block_size)), block_size=block_size,
                            max_model_len=max_model_len, dtype=dtype, device=device, attention_backend="reference")
    for c in cache.key_caches + cache.value_caches:
        c.copy_(torch.randn(c.shape, generator=g))
    meta = cache.metadata(cache.step_inputs([(r, context, 1) for r in range(reqs)]))
    q = torch.randn(reqs, 8, 64, generator=g).to(device, dtype)
    return cache, meta, q


def op_variant(backend: str, captured: bool, cache: kv.PagedKVCache, meta: Any, q: torch.Tensor) -> Callable[[], Any]:
    mode = pb.CUDAGraphMode.FULL if captured else pb.CUDAGraphMode.NONE

    def step() -> Any:
        with pb.set_forward_context(mode):
            caches = cache.key_caches[0], cache.value_caches[0]
            return attention.run_attention((backend,), q, *caches, meta, 0.125, -1, 0.0, None)

    return step


def graph_replay(fn: Callable[[], Any]) -> tuple[Callable[[], Any], Any, int]:
    """``fn`` captured in a CUDA graph: (its replay, the graph's output tensor, bytes the capture allocated).

    Warmed up on the capture stream first (kernels selected outside the capture); the graph is kept alive by
    the returned replay (a bound method)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph.replay, out, torch.cuda.max_memory_allocated() - start


def op_table(
    quick: bool, device: str, deadline: float | None, lens: tuple[int, ...] | None = None, reps: int | None = None
) -> Section:
    cuda = device == "cuda"
    dtype, block = (torch.bfloat16, 256) if cuda else (torch.float32, 16)
    kinds = [
        ("reference", "reference", False),
        ("bounded (eager)", "bounded", False),
        ("bounded (captured)", "bounded", True),
    ]
    if cuda and attention.get_attention_backend("varlen").available(torch.device("cuda"), block) is None:
        kinds.append(("varlen", "varlen", False))
    lens = lens or ((256, 8192) if quick else LENS)
    variants, memory, wrong = [], {}, {}
    sync = torch.cuda.synchronize if cuda else None
    tol = 2e-2 if cuda else 1e-5  # bf16 kernels round differently; float32 on the CPU must agree
    for n in lens:
        cache, meta, q = decode_step(n, device, dtype, block)
        expected = op_variant("reference", False, cache, meta, q)().float()
        for label, backend, captured in kinds:
            fn = op_variant(backend, captured, cache, meta, q)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
                if captured:  # a real graph, timed by its replay (its memory: what the capture allocated)
                    fn, out, memory[label, n] = graph_replay(fn)
                    fn()
                else:
                    out = fn()
                    memory[label, n] = torch.cuda.max_memory_allocated() - start
                torch.cuda.synchronize()
            else:  # no graphs on the CPU: the captured row runs the path a FULL graph records, eagerly
                with LiveBytes() as live:
                    out = fn()
                memory[label, n] = live.peak
            diff = float((out.float() - expected).abs().max())
            if not diff <= tol * max(float(expected.abs().max()), 1.0):
                wrong[label, n] = diff
            variants.append(Variant(f"{label} @{n}", fn, sync=sync, clock="wall" if cuda else "thread"))
    samples = measure(variants, reps=reps or (5 if quick else 15), deadline=deadline)
    rows = []
    for label, _, _ in kinds:
        base = f"{label} @{lens[0]}"
        for n in lens:
            name = f"{label} @{n}"
            rows.append([label, n, fmt_time(samples.median(name)), fmt_ratio(samples.ratios(name, base)),
                         f"{memory[label, n] / MIB:.2f}"])
    body = table(["backend", "max_model_len", "decode step", f"vs max_model_len {lens[0]}", "peak MiB"], rows)
    body += (f"\n\n8 decode tokens, 200 cached tokens each, 8 query heads / 2 KV heads of 64, block {block}, {dtype}, "
             f"{device}. Captured: " + ("a CUDA graph of the FULL path, timed by its replay; its memory is what the "
                                        "capture allocated." if cuda else "the path a FULL graph records (no host "
                                        "read), run eagerly: the CPU has no graphs.")
             + f" Every output is checked against the reference (within {tol:g} of its max).\n")
    if wrong:
        body += "\n**Outputs that differ from the reference:** " + ", ".join(
            f"{label} @{n} (max |diff| {d:.3g})" for (label, n), d in wrong.items()) + "\n"
    return Section(f"Attention decode step vs max_model_len ({device})", body,
                   {"memory": memory, "failed": [f"{label} @{n}" for label, n in wrong]})


def engine_table(quick: bool, device: str, deadline: float | None) -> Section:
    from piecewise_backend import hf

    cuda = device == "cuda"
    raise_recompile_limits()  # one compile per engine, all of the same forward
    modes = ("FULL_AND_PIECEWISE",) if cuda else ("NONE", "PIECEWISE")
    backends = ("reference", "auto")
    lens = (256, 8192)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (12, 30, 7, 21)]
    new_tokens = 8 if quick else 24
    variants, engines, tokens, names = [], {}, {}, {}
    for mode in modes:
        config = pb.CompilationConfig(
            platform="cuda" if cuda else "simulated", cudagraph_mode=mode,
            compile_pieces="inductor" if cuda else "eager",
            capture_sizes=[4, 8, 16, 32, 64, 128],  # no size 1: Dynamo would specialize and trace again
        )
        for backend in backends:
            for n in lens:
                model = hf.tiny_random_model("llama", num_hidden_layers=4, device=device)
                if cuda:  # what varlen takes: a bf16 cache in blocks of 256
                    model = model.to(torch.bfloat16)
                engine = hf.HFEngine(model, config, max_num_reqs=4, max_model_len=n, block_size=256 if cuda else 16,
                                     attention_backend=backend)
                if mode != "NONE":
                    engine.capture()
                key = (mode, backend, n)
                engines[key], names[backend] = engine, engine.attention_backend
                tokens[key] = engine.generate(prompts, new_tokens, eos_token_id=[])  # []: a fixed token count
                variants.append(Variant(f"{mode} {backend} @{n}", engine.generate, (prompts, new_tokens), number=1,
                                        clock="wall" if cuda else "thread"))
    same = len({str(t) for t in tokens.values()}) == 1
    samples = measure(variants, reps=3 if quick else 7, deadline=deadline)
    rows, data = [], {}
    for mode in modes:
        for backend in backends:
            small, big = (f"{mode} {backend} @{n}" for n in lens)
            ratios = samples.ratios(big, small)
            data[mode, backend] = statistics.median(ratios)
            rows.append([mode, names[backend], fmt_time(samples.median(small)), fmt_time(samples.median(big)),
                         fmt_ratio(ratios), verdict(statistics.median(ratios), 1.3) if backend == "auto" else ""])
    body = table(["mode", "attention", "max_model_len 256", "max_model_len 8192", "8192 / 256", "goal <= 1.3x"], rows)
    body += (f"\n\nHFEngine, tiny random llama (4 layers), prompts of 12, 30, 7, 21 tokens, {new_tokens} new tokens, "
             f"{device}; tokens identical across every row: {'yes' if same else 'NO'}.\n")
    if not same and not cuda:  # float32 on the CPU: the backends must agree token for token
        raise AssertionError(f"tokens differ between variants: {tokens}")
    return Section(f"HFEngine generation vs max_model_len ({device})", body,
                   {"ratios": data, "failed": [] if same else ["engine tokens differ between variants"]})


def dsa_table(quick: bool, device: str, deadline: float | None) -> Section:
    """The attention-scale check for indexed (sparse) attention: HFEngine on a tiny DeepSeek-V3.2 (its
    indexer keys in the paged cache, top-k 4), decode step time at max_model_len 8192 against 256."""
    from piecewise_backend import hf

    cuda = device == "cuda"
    raise_recompile_limits()
    modes = ("FULL_AND_PIECEWISE",) if cuda else ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE")
    lens = (256, 8192)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (12, 30, 7, 21)]
    new_tokens = 8 if quick else 24
    variants, tokens = [], {}
    for mode in modes:
        config = pb.CompilationConfig(
            platform="cuda" if cuda else "simulated", cudagraph_mode=mode,
            compile_pieces="inductor" if cuda else "eager", capture_sizes=[4, 8, 16, 32, 64, 128],
        )
        for n in lens:
            model = hf.tiny_random_model("deepseek_v32", max_position_embeddings=8192, device=device)
            engine = hf.HFEngine(model, config, max_num_reqs=4, max_model_len=n, block_size=16)
            if mode != "NONE":
                engine.capture()
            tokens[mode, n] = engine.generate(prompts, new_tokens, eos_token_id=[])
            variants.append(Variant(f"{mode} @{n}", engine.generate, (prompts, new_tokens), number=1,
                                    clock="wall" if cuda else "thread"))
    same = len({str(t) for t in tokens.values()}) == 1
    samples = measure(variants, reps=3 if quick else 5, deadline=deadline)
    rows, data = [], {}
    for mode in modes:
        small, big = (f"{mode} @{n}" for n in lens)
        ratios = samples.ratios(big, small)
        data[mode] = statistics.median(ratios)
        rows.append([mode, fmt_time(samples.median(small)), fmt_time(samples.median(big)), fmt_ratio(ratios),
                     verdict(statistics.median(ratios), 1.2)])
    body = table(["mode", "max_model_len 256", "max_model_len 8192", "8192 / 256", "goal <= 1.2x"], rows)
    body += (f"\n\nHFEngine, tiny random deepseek_v32 (indexed attention, index_topk 4), prompts of 12, 30, 7, 21 "
             f"tokens, {new_tokens} new tokens, {device}; tokens identical across every row: {'yes' if same else 'NO'}. "
             "A FULL graph's indexer scores the padded block table (static shape), masked.\n")
    return Section(f"Indexed (DSA) attention generation vs max_model_len ({device})", body,
                   {"ratios": data, "failed": [] if same else ["dsa tokens differ between variants"]})


TABLES = ("op", "engine", "dsa")


def run(quick: bool = False, deadline: float | None = None, device: str = "cpu", threads: int = 1,
        tables: tuple[str, ...] = TABLES, on_update: Callable[[list[Section]], None] | None = None) -> list[Section]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # on a shared CPU, idle intra-op threads only add noise
    sections: list[Section] = []
    try:
        with quiet_logs(), torch.inference_mode():
            if "op" in tables:
                log("attention: op table")
                sections.append(op_table(quick, device, deadline))
                if on_update is not None:
                    on_update(sections)
            if "engine" in tables:
                log("attention: engine table")
                try:
                    sections.append(engine_table(quick, device, deadline))
                except ImportError as e:  # a bare GPU box without transformers still gets the op table
                    sections.append(Section(f"HFEngine generation vs max_model_len ({device})", f"skipped: {e}"))
            if "dsa" in tables:
                log("attention: dsa table")
                try:
                    sections.append(dsa_table(quick, device, deadline))
                except ImportError as e:
                    sections.append(Section(f"Indexed (DSA) attention generation vs max_model_len ({device})", f"skipped: {e}"))
    finally:
        torch.set_num_threads(before)
    return sections


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated subset of {','.join(TABLES)}")
    ap.add_argument("--out", type=Path, help="markdown file rewritten with the tables as each one is done")
    args = ap.parse_args(argv)
    tables = tuple(t.strip() for t in args.tables.split(",") if t.strip())
    if not tables or set(tables) - set(TABLES):
        ap.error(f"--tables takes a comma-separated subset of {','.join(TABLES)}, got {args.tables!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False here; use --device cpu")

    def write(sections: list[Section]) -> None:
        if args.out is not None:
            body = "\n".join(s.markdown() for s in sections)
            args.out.write_text(f"{env_table(environment(args.device))}\n\n{body}")

    sections = run(quick=args.quick, device=args.device, threads=args.threads, tables=tables, on_update=write)
    write(sections)
    for s in sections:
        print(s.markdown(), flush=True)
    failed = [f for s in sections for f in s.data.get("failed", ())]
    if failed:
        print(f"FAILED: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
