"""Speculative decoding against plain greedy decoding: target forwards saved, and wall time, on CPU.

Model: a tiny random-weight HF Llama (4 layers, hidden 64, vocab 256) served by ``HFEngine``
(one target forward per token) and by ``SpecEngine`` with three drafters: the target itself
(every draft accepted: the upper bound), and its first 3 or 1 layers (``truncated_drafter``:
early exit, same embeddings and head). Both engines run on the simulated graph platform
(``compile_pieces="eager"``), target FULL_AND_PIECEWISE, 4 prompts of different lengths, 24 new
tokens each, 4 requests at a time.

Read it honestly: on the CPU a simulated graph replays the recorded ATen ops one by one, so it
saves no launch overhead, and verifying k+1 tokens costs more than decoding one. What carries over
to a GPU is the count of target steps: a request's tokens per target step (plain decoding: 1).
Wall time here includes the drafter's k steps per round, which on a GPU replay as graphs too.
"""

from __future__ import annotations

import sys

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import torch

import piecewise_backend as pb
from benchmarks.common import Section, Variant, fmt_ratio, fmt_spread, log, measure, quiet_logs, raise_recompile_limits, table

LAYERS = 4
PROMPT_LENS = (5, 12, 3, 9)
NEW_TOKENS = 24


def run(quick: bool = False, deadline: float | None = None) -> list[Section]:
    from piecewise_backend.hf import HFEngine, SamplingParams, tiny_random_model
    from piecewise_backend.spec import SpecEngine, truncated_drafter

    raise_recompile_limits()
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 8, 16, 32, 64])
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    target = tiny_random_model("llama", num_hidden_layers=LAYERS)
    drafters = {f"{n}/{LAYERS} layers": truncated_drafter(target, n) for n in ((1,) if quick else (3, 1))}
    drafters = {f"target itself ({LAYERS} layers)": target, **drafters}
    ks = (2,) if quick else (1, 2, 4)
    kw = dict(max_num_reqs=4, max_model_len=64, block_size=8)

    with quiet_logs():
        plain = HFEngine(target, config.replace(cudagraph_mode="FULL_AND_PIECEWISE"), **kw)
        plain.capture()
        steps: list = []
        expected = plain.generate(prompts, NEW_TOKENS, on_step=steps.append)
        engines = {}
        for name, drafter in drafters.items():
            for k in ks:
                log(f"  spec: building k={k}, drafter {name}")
                engine = SpecEngine(target, drafter, config, num_speculative_tokens=k, **kw)
                engine.capture()
                if engine.generate(prompts, NEW_TOKENS) != expected:
                    raise AssertionError(f"speculative decoding (k={k}, drafter {name}) differs from greedy decoding")
                engines[(name, k)] = engine
        variants = [Variant("plain", plain.generate, (prompts, NEW_TOKENS), number=1, clock="wall")]
        variants += [Variant(f"{name} k={k}", e.generate, (prompts, NEW_TOKENS), number=1, clock="wall")
                     for (name, k), e in engines.items()]
        samples = measure(variants, reps=3 if quick else 7, deadline=deadline)
        # sampled beside greedy: temperature 0.7, top-p 0.9, a seed per request (rejection sampling)
        sampling = [SamplingParams(temperature=0.7, top_p=0.9, seed=i) for i in range(len(prompts))]
        sampled = {}
        for (name, k), engine in engines.items():
            engine.generate(prompts, NEW_TOKENS, sampling=sampling)
            sampled[(name, k)] = engine.stats

    tokens = len(prompts) * NEW_TOKENS
    rows = [["plain greedy (HFEngine)", "-", "-", "-", len(steps), tokens, "1.000", "-",
             fmt_spread(samples.times["plain"], 1e3, 0), "1.000x"]]
    data = {}
    for (name, k), engine in engines.items():
        generate_stats = engine.stats  # of the last timed call: every call is the same deterministic run
        v = f"{name} k={k}"
        s = sampled[(name, k)]
        rows.append([f"spec, drafter {name}", k, f"{generate_stats.acceptance_rate:.3f}", f"{s.acceptance_rate:.3f}",
                     generate_stats.rounds, generate_stats.request_steps, f"{generate_stats.tokens_per_target_step:.3f}",
                     f"{s.tokens_per_target_step:.3f}", fmt_spread(samples.times[v], 1e3, 0),
                     fmt_ratio(samples.ratios(v, "plain"))])
        data[v] = {"tokens_per_target_step": generate_stats.tokens_per_target_step, "target_steps": generate_stats.rounds,
                   "acceptance_rate": generate_stats.acceptance_rate, "sampled_acceptance_rate": s.acceptance_rate,
                   "sampled_tokens_per_target_step": s.tokens_per_target_step}
    body = (
        f"Tiny random Llama ({LAYERS} layers, hidden 64, vocab 256), {len(prompts)} prompts of {PROMPT_LENS} tokens, "
        f"{NEW_TOKENS} new tokens each, 4 requests at a time; simulated graphs on the CPU (no speed-up from graphs "
        "here). Every speculative run's tokens equal plain greedy decoding's (checked before timing). "
        "Target steps: forwards of the target model; request-steps: those summed over the requests in each "
        "(plain decoding: one per token). Wall time: one `generate` call, median [p25, p75] over interleaved "
        "repetitions; the ratio is paired per repetition. *Sampled*: the same prompts at temperature 0.7, top-p "
        "0.9, a seed per request (rejection sampling: the tokens follow the target's distribution).\n\n"
        + table(["engine", "k", "acceptance", "sampled acceptance", "target steps", "request-steps",
                 "tokens / target step", "sampled tokens / target step", "ms per generate", "wall vs plain"], rows)
        + "\n\nWall time here pays every drafter step and the k+1-token verify step in full on the CPU, with "
        "no launch overhead for graphs to remove; it is not the number that carries over to a GPU (not "
        "measured here). Tokens per target step is: it counts target forwards saved."
    )
    return [Section("Speculative decoding: target steps saved and wall time (CPU, simulated graphs)", body, data)]


if __name__ == "__main__":
    for s in run(quick="--quick" in sys.argv):
        print(s.markdown())
