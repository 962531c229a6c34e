"""Serve your own decoder (not a Hugging Face model) with piecewise_backend.serve.Engine.

The model follows the engine's protocol (docs/engine.md#the-model-protocol):
``model(input_ids=(T,) long, position_ids=(T,) long) -> logits (T, vocab)`` for one flat step (every
request's tokens one after the other), with attention through ``torch.ops.pb_kv.paged_attention``.
The engine compiles it, captures FULL graphs for uniform decode steps and PIECEWISE graphs for mixed
ones, and serves requests: chunked prefill, preemption, streaming, the online API, lazy capture.
Every completion is checked against a full recompute of the sequence with dense causal attention.

    python examples/own_model.py [--check]    # --check: exit 1 on any difference
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import piecewise_backend as pb
import piecewise_backend.kv  # noqa: F401  (registers pb_kv::paged_attention as a splitting op)
from piecewise_backend import serve

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 97, 32, 4, 2, 8, 2


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (tokens, heads, head_dim) at each token's own position."""
    angles = positions[:, None].float() * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer  # the KV cache's layer this attention writes and reads
        self.qkv = nn.Linear(DIM, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, dense: bool) -> torch.Tensor:
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q = rotate(q.view(-1, HEADS, HEAD_DIM), positions, self.inv_freq)
        k = rotate(k.view(-1, KV_HEADS, HEAD_DIM), positions, self.inv_freq)
        v = v.view(-1, KV_HEADS, HEAD_DIM)
        if dense:  # the reference: one sequence, causal, no cache
            rep = HEADS // KV_HEADS
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1),
                is_causal=True,
            ).transpose(0, 1)
        else:  # the engine's paged cache: the op reads the step's metadata from the forward context
            out = torch.empty_like(q)
            torch.ops.pb_kv.paged_attention(q, k, v, out, self.layer, HEAD_DIM**-0.5, -1)
        return self.o(out.reshape(-1, HEADS * HEAD_DIM))


class Block(nn.Module):
    def __init__(self, layer: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM, eps=1e-6), nn.RMSNorm(DIM, eps=1e-6)
        self.attn = Attention(layer)
        self.up = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, dense: bool) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), positions, dense)
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Decoder(nn.Module):
    """A 2-layer decoder with grouped-query attention and rotary positions, written against the protocol."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(i) for i in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=1e-6)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, dense: bool = False) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids, dense)
        return self.head(self.norm(x))


KV_LAYOUT = serve.KVLayout(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def make_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder().eval()


@torch.no_grad()
def reference(model: Decoder, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens by full recompute: the whole sequence through dense causal attention, every token."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        ids = torch.tensor(seq)
        seq.append(int(model(ids, torch.arange(len(seq)), dense=True)[-1].argmax()))
    return seq[len(prompt):]


def make_config() -> pb.CompilationConfig:
    """FULL_AND_PIECEWISE on CUDA; on a machine without one, the same graphs on the simulated platform."""
    if torch.cuda.is_available():
        return pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8])
    return pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8], platform="simulated",
                                compile_pieces="eager")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on any difference from the full recompute")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model().to(device)
    reference_model = make_model()
    prompts = [[5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [42]]
    budget = 12
    expected = [reference(reference_model, p, budget) for p in prompts]
    ok = True

    # 8 tokens a step: the 11-token prompt is prefilled in two chunks; 14 blocks of 4 tokens cannot hold
    # four requests of up to 22 tokens at once: the newest are preempted and recomputed.
    engine = serve.Engine(model, make_config(), kv_layout=KV_LAYOUT, vocab_size=VOCAB, max_num_reqs=4, max_model_len=32,
                          block_size=4, num_blocks=14, max_num_batched_tokens=8)
    report = engine.capture()
    print(f"captured {report.graphs} graphs ({report.stats})")
    streamed: dict[int, list[int]] = {}
    steps: list[serve.StepInfo] = []
    out = engine.generate(prompts, budget, on_token=lambda i, t: streamed.setdefault(i, []).append(t),
                          on_step=steps.append)
    modes = sorted({s.mode.name for s in steps})
    chunked = any(s.num_tokens == 8 and not s.uniform_decode for s in steps)
    preempted = sum(len(s.preempted) for s in steps)
    for i, (got, want) in enumerate(zip(out, expected)):
        same = got == want and streamed[i] == got
        ok &= same
        print(f"prompt {i}: {got} {'==' if same else '!='} full recompute")
    print(f"{len(steps)} steps, modes {modes}, chunked prefill: {chunked}, preemptions: {preempted}")
    ok &= {"FULL", "PIECEWISE"} <= set(modes) and chunked and preempted > 0

    # the online API: requests join and leave while others run
    first = engine.add_request(prompts[0], budget)
    cancelled = engine.add_request(prompts[1], budget)
    engine.step()
    engine.cancel_request(cancelled)
    late = engine.add_request(prompts[2], budget)
    finished = {r.request_id: r for r in engine.results()}
    ok &= finished[first].token_ids == expected[0] and finished[late].token_ids == expected[2]
    ok &= finished[cancelled].finish_reason == "cancelled"
    print(f"online: {len(finished)} requests, {finished[cancelled].request_id} cancelled, the others == full recompute")

    # lazy capture: serve at once, capture what traffic asked for when idle
    # step_capture_budget_s=0: only capture_idle captures (by default a lazy engine also catches up inside steps)
    lazy = serve.Engine(make_model().to(device), make_config(), kv_layout=KV_LAYOUT, vocab_size=VOCAB, max_num_reqs=4,
                        max_model_len=32, block_size=4, lazy_capture=True, step_capture_budget_s=0)
    before = lazy.generate(prompts, budget)
    captured = lazy.capture_idle(60.0)
    after = lazy.generate(prompts, budget)
    ok &= before == after == expected and len(captured) > 0
    print(f"lazy: served before capturing, then captured {len(captured)} graphs in idle time; both == full recompute")
    print("PASS" if ok else "FAIL")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
