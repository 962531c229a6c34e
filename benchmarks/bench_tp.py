"""Decode tokens/s of a Hugging Face llama served by HFEngine at TP=2 (``tp_plan="auto"``) vs TP=1, 2 gloo ranks, CPU.

Both engines run on both ranks of one torchrun group (the TP=1 engine serves the whole model on each rank,
no collectives in its graphs; the TP=2 engine serves each rank's shard, two all-reduces per layer, one for the
vocab-parallel embedding and an all-gather of the logits in every replay). Each sample is one ``generate`` of
4 requests with 2-token prompts and many new tokens (pure decode steps replay FULL graphs), timed as the
slowest rank's wall time; the two engines alternate, in a different order each repetition. On the CPU this
shows what the collectives cost (gloo over loopback, both ranks on the same cores), not a speed-up.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_tp.py --child [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Section, fmt_ratio, fmt_spread, launch_ranks, log, table

ROOT = Path(__file__).resolve().parent.parent
SIZES = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2)
PROMPTS = [[5, 6], [7, 8], [9, 10], [11, 12]]


def child(quick: bool) -> dict:
    import shutil

    import torch
    import torch.distributed as dist

    import piecewise_backend as pb
    from piecewise_backend.hf import HFEngine, tiny_random_model
    from piecewise_backend.parallel import init_tensor_parallel

    torch.set_num_threads(1)
    init_tensor_parallel("gloo", timeout_s=120)
    rank = dist.get_rank()
    folder = [tempfile.mkdtemp(prefix="bench_tp_") if rank == 0 else None]
    dist.broadcast_object_list(folder)
    model = tiny_random_model("llama", **SIZES)  # the same seed on every rank
    if rank == 0:
        model.save_pretrained(folder[0])  # save_pretrained writes on rank 0 only
    dist.barrier()
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 8])
    options = dict(max_num_reqs=4, max_model_len=64, block_size=8)
    engines = {"TP=1": HFEngine(model, config, **options),
               "TP=2": HFEngine.from_pretrained(folder[0], config, tp_plan="auto", **options)}
    for engine in engines.values():
        engine.capture()
    new = 8 if quick else 24
    reps = 2 if quick else 7
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs = {}
    for rep in range(reps + 1):  # one warm-up round
        names = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in names:
            dist.barrier()
            t0 = time.perf_counter()
            outputs[name] = engines[name].generate(PROMPTS, [new] * len(PROMPTS), eos_token_id=None)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep:
                times[name].append(elapsed.item())
    same = outputs["TP=1"] == outputs["TP=2"]
    kv = {name: e.cache.memory_bytes for name, e in engines.items()}
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    dist.destroy_process_group()
    return dict(times=times, tokens=new * len(PROMPTS), same=same, kv_bytes=kv) if rank == 0 else {}


RESULT = "bench_tp result: "  # marks rank 0's JSON line in the launcher's output


def run(quick: bool = False, deadline: float | None = None) -> list[Section]:
    log("  tp: 2 gloo ranks")
    data = launch_ranks("bench_tp.py", ["--quick"] if quick else [], RESULT)
    tokens, times = data["tokens"], data["times"]
    rate = {name: [tokens / t for t in ts] for name, ts in times.items()}
    ratios = [b / a for a, b in zip(rate["TP=1"], rate["TP=2"])]
    rows = [[name, fmt_spread(rate[name], 1.0, 0), f"{data['kv_bytes'][name] / 1024:.0f}"] for name in times]
    body = table(["engine", "decode tokens/s (slowest rank)", "KV cache per rank (KiB)"], rows)
    body += (
        f"\n\nTP=2 / TP=1 tokens/s: {fmt_ratio(ratios)}; the two engines' tokens "
        f"{'are equal' if data['same'] else 'DIFFER'}. A llama of hidden size {SIZES['hidden_size']}, "
        f"{SIZES['num_hidden_layers']} layers, {SIZES['num_attention_heads']} heads ({SIZES['num_key_value_heads']} KV), "
        f"{len(PROMPTS)} requests of 2-token prompts and {tokens // len(PROMPTS)} new tokens each, simulated graphs on "
        "2 gloo ranks sharing this machine's cores. Below 1.0 the collectives (2 per layer, the embedding's and the "
        "logits' gather, every step) cost more than the halved matmuls save: at this size, on loopback gloo, they "
        "do. On GPUs with NCCL inside the CUDA graphs a model too large for one GPU is the point, not this ratio."
    )
    return [Section("Tensor parallel (HF llama, tp_plan='auto'): decode tokens/s on gloo", body,
                    {"median_ratio": statistics.median(ratios), "failed": [] if data["same"] else ["TP=2 tokens differ from TP=1"]})]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.child:
        out = child(a.quick)
        if out:
            print(RESULT + json.dumps(out), flush=True)
    else:
        for section in run(a.quick):
            print(section.markdown())
