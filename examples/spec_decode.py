"""Speculative decoding of a tiny random HF model: a drafter proposes, the target verifies k+1 tokens per request.

The target is a random-weight model of transformers model type NAME (4 layers, nothing
downloaded); the drafter is its first L layers with the same embeddings and head (L = 4: the
target itself, so every draft is accepted). Prompts of different lengths join and finish at
different rounds. Each round prints the modes the drafter's k steps and the target's verify step
ran (verify steps replay FULL graphs, the drafter breakable PIECEWISE ones), the drafts each
request accepted, and at the end the acceptance rate and tokens per target step. With --check
every request's tokens must equal the target's own ``model.generate(do_sample=False)``; --sample
also samples (rejection sampling: temperature 0.7, top-p 0.9, a seed per request) and, with --check,
runs it twice: the seeds must reproduce the tokens. State-layer types (qwen3_next, nemotron_h,
mamba2, ...) are served too: a rejected draft leaves no state behind. Without CUDA it runs on the simulated graph platform and says so.

Run: python examples/spec_decode.py --arch llama --num-speculative-tokens 2 --check [--sample]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

import piecewise_backend as pb
from piecewise_backend.hf import tiny_random_model
from piecewise_backend.hf import SamplingParams
from piecewise_backend.spec import RoundInfo, SpecEngine, truncated_drafter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_generate import check  # noqa: E402  (the same comparison with model.generate)

TARGET_LAYERS = 4
PROMPT_LENS = (5, 12, 3, 9, 7)
NEW_TOKENS = (9, 4, 12, 6, 10)  # per request: they finish at different rounds, some mid-run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", help="transformers model type (llama, qwen2, mistral, ...)")
    parser.add_argument("--num-speculative-tokens", type=int, default=2, metavar="K", help="drafts per request per round")
    parser.add_argument("--target-mode", default="FULL", choices=["FULL", "FULL_AND_PIECEWISE"],
                        help="the target's cudagraph_mode (the drafter always runs PIECEWISE)")
    parser.add_argument("--draft-layers", type=int, default=3, metavar="L",
                        help=f"drafter layers, 1..{TARGET_LAYERS} ({TARGET_LAYERS}: the target as its own drafter)")
    parser.add_argument("--check", action="store_true", help="compare with the target's model.generate(do_sample=False)")
    parser.add_argument("--sample", action="store_true",
                        help="also sample (temperature 0.7, top-p 0.9, a seed per request: rejection sampling); "
                             "with --check, a second run must give the same tokens")
    args = parser.parse_args(argv)
    k = args.num_speculative_tokens
    if k < 1:
        parser.error(f"--num-speculative-tokens must be >= 1, got {k}")

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = pb.CompilationConfig(
        cudagraph_mode=args.target_mode,
        capture_sizes=[2, 4, 8, 16, 32, 64],  # no size 1: Dynamo would specialize and trace the model a second time
        platform="cuda" if cuda else "simulated",
        compile_pieces="inductor" if cuda else "eager",  # the simulator records ATen ops, not fused kernels
    )
    print(f"arch: {args.arch}, k: {k}, target mode: {args.target_mode}, drafter layers: {args.draft_layers}/"
          f"{TARGET_LAYERS}, platform: {config.platform}" + ("" if cuda else " (no CUDA device: simulated on the CPU)"))
    try:
        target = tiny_random_model(args.arch, device=device, num_hidden_layers=TARGET_LAYERS)
        drafter = target if args.draft_layers == TARGET_LAYERS else truncated_drafter(target, args.draft_layers)
    except ValueError as e:
        parser.error(str(e))
    reference = copy.deepcopy(target) if args.check else None  # keeps HF's own SDPA attention
    try:
        engine = SpecEngine(target, drafter, config, num_speculative_tokens=k, max_num_reqs=4, max_model_len=64, block_size=8)
    except ValueError as e:  # an architecture the paged attention cannot serve, and why
        parser.error(str(e))
    print(f"capture estimate: {engine.estimate_capture_memory()} bytes")
    report = engine.capture()
    print(f"captured {report.graphs} graphs in {report.seconds:.2f} s ({report.stats})")

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, target.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    eos = None  # the target's generation_config.eos_token_id (an int or a list), for the engine and generate alike

    def show(info: RoundInfo) -> None:
        kind = "verify" if info.verify_only else "mixed "
        drafter = ",".join(m.name for m in info.drafter_modes)
        print(f"round {info.round:2d}: {info.target_tokens:2d} tokens, {len(info.requests)} reqs, {kind} -> target "
              f"{info.target_mode.name}, drafter {drafter}, accepted {list(info.accepted)}")

    outputs = engine.generate(prompts, NEW_TOKENS, eos_token_id=eos, on_round=show)
    for i, out in enumerate(outputs):
        print(f"request {i}: prompt {len(prompts[i]):2d} tokens -> {out}")
    s = engine.stats
    print(f"acceptance rate: {s.acceptance_rate:.3f} ({s.accepted}/{s.proposed} drafts)")
    print(f"tokens per target step: {s.tokens_per_target_step:.3f} ({s.emitted} tokens in {s.request_steps} "
          f"request-steps, {s.rounds} target steps; plain greedy decoding: 1.000)")
    bad: set[int] = set()
    if args.check:
        ties: list[int] = []  # hf_generate's check also passes near-ties; here every token must equal generate's
        bad = set(check(reference, prompts, outputs, NEW_TOKENS, eos, ties, rules_applied=False)) | set(ties)
        print(f"check: {len(prompts) - len(bad)}/{len(prompts)} requests match model.generate token for token")
    if args.sample:
        sampling = [SamplingParams(temperature=0.7, top_p=0.9, seed=i) for i in range(len(prompts))]
        sampled = engine.generate(prompts, NEW_TOKENS, eos_token_id=eos, sampling=sampling)
        s = engine.stats
        print(f"sampled (temperature 0.7, top-p 0.9): acceptance rate {s.acceptance_rate:.3f}, tokens per target step "
              f"{s.tokens_per_target_step:.3f}")
        if args.check:
            again = engine.generate(prompts, NEW_TOKENS, eos_token_id=eos, sampling=sampling)
            same = sum(a == b for a, b in zip(sampled, again))
            print(f"check: {same}/{len(prompts)} sampled requests reproduced by their seeds")
            bad |= {i for i, (a, b) in enumerate(zip(sampled, again)) if a != b}
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
