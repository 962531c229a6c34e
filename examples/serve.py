"""A tiny serving loop on GraphRunner: prefill and mixed batches replay PIECEWISE graphs,
uniform decode batches replay one FULL graph, and every step is checked against eager.

On a machine without CUDA it runs on the simulated graph platform and says so.
Run: python examples/serve.py
"""

from __future__ import annotations

import argparse

import torch

import piecewise_backend as pb
from piecewise_backend.toy_llama import AttnMetadata, make_model

MAX_REQS, MAX_LEN = 4, 32


def main() -> None:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = pb.CompilationConfig(
        cudagraph_mode="FULL_AND_PIECEWISE",
        capture_sizes=[1, 2, 4, 8, 16, 32],
        platform="cuda" if cuda else "simulated",
        compile_pieces="inductor" if cuda else "eager",  # the simulator records ATen ops, not fused kernels
    )
    print(f"platform: {config.platform}" + ("" if cuda else " (no CUDA device: CUDA graph semantics simulated on the CPU)"))

    model = make_model(num_layers=2, attention="inplace", device=device)
    compiled = torch.compile(model, backend=pb.make_backend(config))
    dummy_slot = MAX_REQS  # padding tokens write their KV into a scratch slot
    kv = model.make_kv_caches(MAX_REQS + 1, MAX_LEN)
    ref_kv = model.make_kv_caches(MAX_REQS + 1, MAX_LEN)

    runner = pb.GraphRunner(
        compiled,
        config,
        inputs=[pb.StaticInput("input_ids"), pb.StaticInput("slot_mapping", pad=dummy_slot), pb.StaticInput("positions")],
        model_args=["input_ids"],
        context_fn=lambda v: {"attn_metadata": AttnMetadata(v["slot_mapping"], v["positions"], kv)},
    )
    with torch.inference_mode():
        report = runner.capture(progress=False)
        print(f"captured {report.graphs} graphs in {report.seconds:.2f} s ({report.stats})")

        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 3, 7, 4)]
        budget = [6, 3, 8, 5]  # new tokens per request: they finish at different steps
        seqs: dict[int, list[int]] = {}
        waiting = list(range(len(prompts)))
        max_diff, step = 0.0, 0
        while waiting or seqs:
            # schedule: up to two new prompts join the running requests (decode: one token each)
            ids, slots, pos, last = [], [], [], []
            for r in list(seqs):
                ids.append(seqs[r][-1]), slots.append(r), pos.append(len(seqs[r]) - 1)
                last.append(len(ids) - 1)
            for r in waiting[:2]:
                seqs[r] = list(prompts[r])
                ids += prompts[r]
                slots += [r] * len(prompts[r])
                pos += list(range(len(prompts[r])))
                last.append(len(ids) - 1)
            prefilling = bool(waiting)
            waiting = waiting[2:]
            order = list(seqs)
            t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
            batch = dict(input_ids=t(ids), slot_mapping=t(slots), positions=t(pos))
            logits = runner.run(uniform_decode=not prefilling, num_reqs=None if prefilling else len(ids), **batch)
            with pb.set_forward_context(attn_metadata=AttnMetadata(batch["slot_mapping"], batch["positions"], ref_kv)):
                ref = model(batch["input_ids"])
            diff = (logits - ref).abs().max().item()
            max_diff = diff if (diff != diff or diff > max_diff) else max_diff  # NaN sticks
            print(f"step {step:2d}: {len(ids):2d} tokens, {len(order)} reqs -> {runner.last_mode.name:9s} max|diff| {diff:.2e}")
            nxt = logits[last].argmax(-1).tolist()
            for r, tok in zip(order, nxt):
                seqs[r].append(tok)
                if len(seqs[r]) - len(prompts[r]) >= budget[r] or len(seqs[r]) >= MAX_LEN:
                    del seqs[r]
            step += 1
    print(f"counters: captures={pb.counters['captures']} replays={pb.counters['replays']} breaks={pb.counters['breaks']}")
    print(f"max |runner - eager| over all steps: {max_diff:.2e}")
    if not max_diff < 1e-3:
        raise SystemExit(f"graph replay diverged from eager: {max_diff}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
