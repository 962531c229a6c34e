"""Micro-batching (dual-batch overlap) on an expert-parallel MoE decoder over torch.distributed.

    python -m torch.distributed.run --standalone --nproc-per-node N examples/moe_dbo.py [--check]

Every rank serves its own random batches (data-parallel attention, expert-parallel MoE:
the experts are split over the ranks). Steps are decode steps (one token per request) or
mixed steps (prompts of several tokens), the kind shared by all ranks, the sizes not: the
runner pads every rank to the largest token count, and micro-batches a step on every rank or
on none. Decode steps replay FULL graphs of the whole overlapped step. Per step it prints the
tokens, whether the step was micro-batched and the runtime mode. ``--check`` compares every
step with the same model run without micro-batching and with the unsharded model in this
process, and exits non-zero on any difference.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
import torch.distributed as dist

import piecewise_backend as pb
from piecewise_backend.moe import ToyMoE
from piecewise_backend.parallel import init_tensor_parallel

TOLERANCE = 1e-5  # float32 matmuls over different row counts may round differently


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare every step with no micro-batching and unsharded")
    p.add_argument("--steps", type=int, default=10, help="serving steps to run (default 10)")
    p.add_argument("--mode", default="FULL_AND_PIECEWISE", help="cudagraph mode (default FULL_AND_PIECEWISE)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the batches")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait (default 120)")
    # tests only: shift this rank's experts, so --check must fail
    p.add_argument("--perturb-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def make_batch(kind_rng: random.Random, rng: random.Random) -> tuple[bool, list[int]]:
    """(decode, tokens per request): the kind from the shared generator, the sizes from this rank's."""
    if kind_rng.random() < 0.5:
        return True, [1] * rng.randint(2, 24)
    return False, [rng.randint(1, 8) for _ in range(rng.randint(2, 6))]


def main() -> int:
    args = parse_args()
    mesh = init_tensor_parallel(timeout_s=args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = mesh.device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    base = dict(
        cudagraph_mode=args.mode, capture_sizes=[2, 4, 8, 16, 24, 32, 48], platform="cuda" if cuda else "simulated",
        compile_pieces="eager", use_ubatching=True, dbo_decode_token_threshold=8, dbo_prefill_token_threshold=12,
    )
    config = pb.CompilationConfig(**base)
    plain = pb.CompilationConfig(**dict(base, dbo_decode_token_threshold=1 << 20, dbo_prefill_token_threshold=1 << 20))
    model = ToyMoE(seed=args.seed).to(device)
    if args.perturb_rank == rank:
        with torch.no_grad():
            model.moe[0].w2.add_(0.01)
    inputs = [pb.StaticInput("input_ids"), pb.StaticInput("seq_ids", pad=-1), pb.StaticInput("positions")]
    runner = pb.GraphRunner(model, config, inputs)
    baseline = pb.GraphRunner(model, plain, inputs) if args.check else None  # never micro-batches
    reference = ToyMoE(seed=args.seed, sharded=False).to(device) if args.check else None
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} ranks, backend {dist.get_backend()}, platform {config.platform}, mode {runner.mode.name}")
    kind_rng, rng = random.Random(args.seed), random.Random(args.seed * 1000 + rank + 1)
    worst, seen, failed = 0.0, set(), False
    with torch.inference_mode():
        for r in (runner, baseline):
            if r is not None:
                report = r.capture(progress=False)
                say(f"captured {report.graphs} graphs ({len(r.model.ubatch_entries)} micro-batched) in "
                    f"{report.seconds:.2f} s")
        for step in range(args.steps):
            decode, lens = make_batch(kind_rng, rng)
            n = sum(lens)
            seq = [i for i, length in enumerate(lens) for _ in range(length)]
            pos = [rng.randrange(4) + j if length == 1 else j for length in lens for j in range(length)]
            t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
            batch = dict(input_ids=t([rng.randrange(64) for _ in range(n)]), seq_ids=t(seq), positions=t(pos))
            logits = runner.run(uniform_decode=decode, query_lens=lens, **batch).clone()
            seen.add((runner.last_ubatched, runner.last_mode.name))
            ubatched = "yes" if runner.last_ubatched else "no "
            line = f"step {step:2d}: rank {rank} {n:2d} tokens, micro-batched {ubatched}, {runner.last_mode.name}"
            if args.check:
                unbatched = baseline.run(uniform_decode=decode, query_lens=lens, **batch)
                ref = reference(**batch)
                diff = max((logits - unbatched).abs().max().item(), (logits - ref).abs().max().item())
                worst = diff if not diff <= worst else worst  # NaN sticks
                line += f", max|diff| {diff:.2e}"
            sys.stdout.write(line + "\n")  # one write: ranks share the terminal
            sys.stdout.flush()
    if args.check:
        bad = torch.tensor([0 if worst < TOLERANCE else 1], dtype=torch.long, device=device)
        dist.all_reduce(bad)
        failed = bool(bad.item())
        if not worst < TOLERANCE:
            print(f"rank {rank}: micro-batched logits differ by {worst} (> {TOLERANCE})", file=sys.stderr)
    say(f"steps run as (micro-batched, mode): {sorted(seen)}")
    dist.barrier()  # every rank done with its collectives before any tears gloo down (an early one aborted a peer)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
