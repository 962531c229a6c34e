"""Tensor-parallel serving loop: one GraphRunner per rank, collectives inside the captured graphs.

The toy Llama is sharded with torch's own API (``parallelize_module``: QKV and gate/up
colwise, o/down rowwise, vocab-parallel lm_head), compiled with the piecewise backend and
captured on every rank: mixed batches replay PIECEWISE graphs (attention eager between
segments), uniform decode batches replay one FULL graph; the all-reduces and all-gathers
replay inside them. Every rank draws the same random schedule (one seed), as an engine
whose scheduler broadcasts its batch would. With ``--check`` rank 0 compares every step
with the unsharded model and exits non-zero on a difference.

Run: python -m torch.distributed.run --standalone --nproc-per-node 2 examples/tensor_parallel.py --check
(gloo and the simulated graph platform on the CPU; NCCL and CUDA graphs on GPUs.)
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
import torch.distributed as dist

import piecewise_backend as pb
from piecewise_backend.parallel import init_tensor_parallel, make_kv_caches, shard_toy_llama
from piecewise_backend.toy_llama import AttnMetadata, make_model

MAX_REQS, MAX_LEN, TOLERANCE = 4, 32, 1e-3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="rank 0 compares every step with the unsharded model")
    p.add_argument("--steps", type=int, default=12, help="serving steps to run (default 12)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the toy model (default 2)")
    p.add_argument("--mode", default="FULL_AND_PIECEWISE", help="cudagraph mode (default FULL_AND_PIECEWISE)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the schedule")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait (default 120)")
    p.add_argument("--debug-checks", action="store_true", help="all-gather every step's key to catch rank drift")
    # tests only: shift this rank's shard of one weight, so --check must fail
    p.add_argument("--perturb-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 1 or args.layers < 1:
        p.error(f"--steps and --layers must be >= 1, got {args.steps} and {args.layers}")
    return args


Work = list[tuple[int, list[int]]]  # (slot, new tokens) per request in a step


def schedule(rng: random.Random, running: dict[int, list[int]], admit_left: int) -> tuple[Work, int]:
    """One step: ``[(slot, new tokens)]`` and how many prompts joined (0: a pure decode step).

    Drawn from ``rng`` alone, never from model outputs, so every rank schedules the same batch.
    """
    free = [s for s in range(MAX_REQS) if s not in running]
    admit = min(len(free), admit_left, rng.randint(1, 2)) if free and (not running or rng.random() < 0.4) else 0
    work = [(slot, seq[-1:]) for slot, seq in running.items()]
    for slot in free[:admit]:
        running[slot] = [rng.randrange(128) for _ in range(rng.randint(1, 6))]
        work.append((slot, list(running[slot])))
    return work, admit


def main() -> int:
    args = parse_args()
    mesh = init_tensor_parallel(timeout_s=args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = mesh.device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    config = pb.CompilationConfig(
        cudagraph_mode=args.mode,
        capture_sizes=[1, 2, 4, 8, 16, 32],
        platform="cuda" if cuda else "simulated",
        compile_pieces="inductor" if cuda else "eager",
        debug_checks=args.debug_checks,
    )
    model = make_model(num_layers=args.layers, seed=args.seed, device=device)
    reference = make_model(num_layers=args.layers, seed=args.seed, device=device) if args.check and rank == 0 else None
    shard_toy_llama(model, mesh)
    if args.perturb_rank == rank:
        with torch.no_grad():
            model.layers[0].o_proj.weight.to_local().add_(0.01)
    kv = make_kv_caches(model, MAX_REQS + 1, MAX_LEN)  # slot MAX_REQS: scratch for padding tokens
    ref_kv = make_kv_caches(reference, MAX_REQS + 1, MAX_LEN) if reference is not None else None
    runner = pb.GraphRunner(
        torch.compile(model, backend=pb.make_backend(config)),
        config,
        inputs=[pb.StaticInput("input_ids"), pb.StaticInput("slot_mapping", pad=MAX_REQS), pb.StaticInput("positions")],
        model_args=["input_ids"],
        context_fn=lambda v: {"attn_metadata": AttnMetadata(v["slot_mapping"], v["positions"], kv)},
    )
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} ranks, backend {dist.get_backend()}, platform {config.platform}, mode {runner.mode.name}")
    worst, modes = 0.0, set()
    with torch.inference_mode():
        report = runner.capture(progress=False)
        say(f"captured {report.graphs} graphs per rank in {report.seconds:.2f} s ({report.stats})")
        rng = random.Random(args.seed)
        running: dict[int, list[int]] = {}
        admit_left = 3 * MAX_REQS
        for step in range(args.steps):
            work, admitted = schedule(rng, running, admit_left)
            admit_left -= admitted
            decode = admitted == 0
            ids = [t for _, toks in work for t in toks]
            slots = [s for s, toks in work for _ in toks]
            pos = [len(running[s]) - len(toks) + i for s, toks in work for i in range(len(toks))]
            t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
            batch = dict(input_ids=t(ids), slot_mapping=t(slots), positions=t(pos))
            logits = runner.run(uniform_decode=decode, num_reqs=len(work) if decode else None, **batch)
            modes.add(runner.last_mode.name)
            line = f"step {step:2d}: {len(ids):2d} tokens, {len(work)} reqs -> {runner.last_mode.name:9s}"
            if reference is not None:
                meta = AttnMetadata(batch["slot_mapping"], batch["positions"], ref_kv)
                with pb.set_forward_context(attn_metadata=meta):
                    ref = reference(batch["input_ids"])
                diff = (logits - ref).abs().max().item()
                worst = diff if not diff <= worst else worst  # NaN sticks
                line += f" max|diff| {diff:.2e}"
            say(line)
            # a request's next token is the argmax at its last position (replicated logits: same on every rank)
            last = [i for i in range(len(slots)) if i + 1 == len(slots) or slots[i + 1] != slots[i]]
            for (slot, _), token in zip(work, logits[last].argmax(-1).tolist()):
                running[slot].append(token)
                if len(running[slot]) >= rng.randint(8, MAX_LEN):
                    del running[slot]  # its slot is reused: stale KV beyond a position is masked
    say(f"modes replayed: {sorted(modes)}")
    failed = False
    if reference is not None:
        say(f"max |sharded - unsharded| over {args.steps} steps: {worst:.2e}")
        failed = not worst < TOLERANCE
        if failed:
            print(f"rank 0: sharded logits differ from the unsharded model by {worst} (> {TOLERANCE})", file=sys.stderr)
    dist.barrier()  # every rank done with its collectives before any tears gloo down (an early one aborted a peer)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
