"""Greedy generation with a stock Hugging Face model on GraphRunner and a paged KV cache.

Builds a tiny random-weight model of transformers model type NAME (nothing downloaded), serves
prompts of different lengths that finish at different steps (steps with prompt tokens replay
PIECEWISE graphs, pure decode steps one FULL graph), and with --check compares every request's
tokens with ``model.generate(do_sample=False)``, exiting non-zero on any difference.
Without CUDA it runs on the simulated graph platform and says so.

Run: python examples/hf_generate.py --arch llama --check
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import transformers

import piecewise_backend as pb
from piecewise_backend.hf import HFEngine, StepInfo

VOCAB = 256
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
PROMPT_LENS = (5, 12, 3, 9, 7)
NEW_TOKENS = (6, 3, 9, 4, 7)  # per request: they finish at different steps


def tiny_model(arch: str, device: str) -> torch.nn.Module:
    """A seeded random model of type ``arch``: only the sizing fields its config knows are set."""
    try:
        defaults = transformers.AutoConfig.for_model(arch)
    except ValueError as e:
        raise SystemExit(f"--arch {arch!r} is not a transformers model type: {e}") from None
    config = transformers.AutoConfig.for_model(arch, **{k: v for k, v in TINY.items() if hasattr(defaults, k)})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", help="transformers model type (llama, qwen2, mistral, ...)")
    parser.add_argument("--check", action="store_true", help="compare with model.generate(do_sample=False)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = pb.CompilationConfig(
        cudagraph_mode="FULL_AND_PIECEWISE",
        capture_sizes=[1, 2, 4, 8, 16, 32],
        platform="cuda" if cuda else "simulated",
        compile_pieces="inductor" if cuda else "eager",  # the simulator records ATen ops, not fused kernels
    )
    print(f"arch: {args.arch}, platform: {config.platform}" + ("" if cuda else " (no CUDA device: simulated on the CPU)"))

    model = tiny_model(args.arch, device)
    reference = copy.deepcopy(model) if args.check else None  # keeps HF's own SDPA attention
    engine = HFEngine(model, config, max_num_reqs=4, max_model_len=64, block_size=8)
    report = engine.capture()
    print(f"captured {report.graphs} graphs in {report.seconds:.2f} s ({report.stats})")

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    eos = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else None

    def show(info: StepInfo) -> None:
        kind = "decode" if info.uniform_decode else "mixed "
        print(f"step {info.step:2d}: {info.num_tokens:2d} tokens, {info.num_reqs} reqs, {kind} -> {info.mode.name}")

    outputs = engine.generate(prompts, NEW_TOKENS, eos_token_id=eos, on_step=show)
    for i, out in enumerate(outputs):
        print(f"request {i}: prompt {len(prompts[i]):2d} tokens -> {out}")
    if not args.check:
        return 0
    bad = 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            full = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=NEW_TOKENS[i], eos_token_id=eos, pad_token_id=eos)
        expected = full[0, len(prompt):].tolist()
        if out != expected:
            bad += 1
            print(f"MISMATCH request {i}: engine {out} != generate {expected}")
    print(f"check: {len(prompts) - bad}/{len(prompts)} requests match model.generate")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
