"""The state ops of layers with kernels of their own (Kimi delta rule, lightning attention, RG-LRU's recurrence,
ZAYA's window): exact against transformers' reference implementations, chunked like serving, and in graphs."""

from __future__ import annotations

import pytest
import torch
from pbtest.helpers import compile_model
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend import state as st

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf
from piecewise_backend.hf import state_swaps as swaps

CONFIG = pb.CompilationConfig(
    platform="simulated", compile_pieces="eager", cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8, 16]
)


def _split(fn_seq, fn_step, args_at, n: int, cut: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk, a second chunk, then one-token steps (serving's chunked prefill and decode), chained."""
    outs = []
    for lo, hi in ((0, cut), (cut, cut + 3)):
        out, state = fn_seq(*args_at(slice(lo, hi)), state)
        outs.append(out)
    for t in range(cut + 3, n):
        out, state = fn_step(*args_at(slice(t, t + 1)), state[None])
        outs.append(out)
        state = state[0]
    return torch.cat(outs), state


def test_kda_rule_matches_transformers_chunk_and_recurrent_kda():
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    g = torch.Generator().manual_seed(0)
    n, H, K, V = 29, 2, 8, 6
    q, k, g_, v = (torch.randn(n, H, d, generator=g) for d in (K, K, K, V))
    g_ = -torch.rand(n, H, K, generator=g) * 2
    beta = torch.rand(n, H, generator=g)
    ref, _ = kimi.chunk_kimi_delta_attention(q[None], k[None], v[None], g_[None], beta[None], chunk_size=8,
                                             use_qk_l2norm_in_kernel=True)
    rec, final = kimi.recurrent_kimi_delta_attention(q[None], k[None], v[None], g_[None], beta[None], None, True,
                                                     use_qk_l2norm_in_kernel=True)
    out, state = st.kda_sequence(q, k, v, g_, beta, torch.zeros(H, K, V), True, 8)
    assert_close(out, ref[0], rtol=1e-5, atol=1e-5)
    assert_close(out, rec[0], rtol=1e-5, atol=1e-5)
    assert_close(state, final[0], rtol=1e-5, atol=1e-5)
    split, state2 = _split(lambda *a: st.kda_sequence(*a[:5], a[5], True, 8), st.kda_step,
                           lambda p: (q[p], k[p], v[p], g_[p], beta[p]), n, 11, torch.zeros(H, K, V))
    assert_close(split, ref[0], rtol=1e-5, atol=1e-5)
    assert_close(state2, final[0], rtol=1e-5, atol=1e-5)


def _layer(arch: str, path: str) -> torch.nn.Module:
    model = hf.tiny_random_model(arch)
    return dict(model.named_modules())[path].float()


def _reference_kernels(swap: swaps.Swap, args_cut: int | None = None) -> swaps.Kernels:
    """A swapped forward's state calls on a zero state: whole-sequence forms, or (``args_cut``) a chunk, a second
    chunk, then one-token steps: serving's chunked prefill and decode over the same tokens."""

    def call(kind: str):
        spec = swaps.KINDS[kind]

        def run(*args):
            n, state = args[0].shape[0], torch.zeros(spec.shape(*args), dtype=spec.dtype(*args))
            if args_cut is None:
                return spec.sequence(*args, state)[0]
            tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == n]
            at = lambda p: [a[p] if i in tensors else a for i, a in enumerate(args)]
            return _split(lambda *a: spec.sequence(*a), lambda *a: spec.step(*a), at, n, args_cut, state)[0]

        return run

    return {name: call(kind) for name, kind in swap.states.items()}


@pytest.mark.parametrize("cut", [None, 5], ids=["whole", "chunked-then-decode"])
def test_lightning_attention_matches_minimax(cut):
    layer = _layer("minimax", "model.layers.1.self_attn")
    assert type(layer).__name__ == "MiniMaxLightningAttention"
    layer.block_size = 4  # several blocks in 13 tokens
    query_decay, key_decay, diagonal = layer.decay_factors(layer.slope_rate)
    layer.query_decay, layer.key_decay, layer.diagonal_decay = query_decay, key_decay, diagonal
    h = torch.randn(1, 13, layer.qkv_proj.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = layer(h, None, None)[0]
        ours = swaps.lightning_forward(layer, _reference_kernels(swaps.SWAPS["MiniMaxLightningAttention"], cut), h)[0]
    assert_close(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cut", [None, 5], ids=["whole", "chunked-then-decode"])
def test_rg_lru_block_matches_recurrent_gemma(cut):
    block = _layer("recurrent_gemma", "model.layers.0.temporal_block")
    h = torch.randn(1, 13, block.hidden_size, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(13)[None]
    with torch.no_grad():
        ref = block(h, positions, None, use_cache=False)[0]
        ours = swaps.recurrent_block_forward(block, _reference_kernels(swaps.SWAPS["RecurrentGemmaRecurrentBlock"], cut),
                                             h, positions)[0]
    assert_close(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cut", [None, 5], ids=["whole", "chunked-then-decode"])
def test_causal_window_serves_zaya_cca_projection(cut):
    proj = _layer("zaya", "model.layers.0.self_attn.qkv_proj")
    h = torch.randn(1, 13, proj.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = proj(h, None)
        ours = swaps.cca_forward(proj, _reference_kernels(swaps.SWAPS["ZayaCCAProjection"], cut), h)
    for a, b in zip(ours, ref):
        assert_close(a, b, rtol=1e-4, atol=1e-5)


# --- the four ops in one toy model, through a GraphRunner: FULL decode replays, mixed prefills at breaks ---

D, H, KD = 6, 2, 4


class KernelToy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(D, 4 * H * KD + H + D)
        self.slope = torch.rand(H) + 0.1

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = x.shape[0]
        q, k, v, g, beta, a = self.proj(x).split([H * KD] * 4 + [H, D], dim=-1)
        q, k, v, g = (t.reshape(n, H, KD) for t in (q, k, v, g))
        return q, k, v, -torch.nn.functional.softplus(g), beta.sigmoid(), a.sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v, g, beta, a = self.parts(x)
        kda, light = torch.empty_like(v), torch.empty_like(v)
        torch.ops.pb_state.kda_rule(q, k, v, g, beta, kda, 0, True, 4)
        torch.ops.pb_state.lightning_attention(q, k, v, self.slope, light, 1, 4)
        rec, win = torch.empty_like(x), x.new_empty((*x.shape, 3))
        torch.ops.pb_state.linear_recurrence(a, x, rec, 2)
        torch.ops.pb_state.causal_window(x, win, 3)
        return torch.cat([kda.flatten(1), light.flatten(1), rec, win.flatten(1)], dim=-1)

    def reference(self, x: torch.Tensor, *states: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        q, k, v, g, beta, a = self.parts(x)
        kda, s0 = st.kda_sequence(q, k, v, g, beta, states[0], True, 4)
        light, s1 = st.lightning_sequence(q, k, v, self.slope, states[1], 4)
        rec, s2 = st.recurrence_sequence(a, x, states[2])
        win, s3 = st.window_sequence(x, states[3])
        return torch.cat([kda.flatten(1), light.flatten(1), rec, win.flatten(1)], dim=-1), [s0, s1, s2, s3]


def _specs() -> list[st.StateSpec]:
    return [st.StateSpec(0, "recurrent", (H, KD, KD)), st.StateSpec(0, "linear", (H, KD, KD)),
            st.StateSpec(0, "lru", (D,)), st.StateSpec(0, "window", (D, 2))]


def _step(runner, cache, model, chunks, x):
    """One step through the runner and the per-request reference from the states it read; commits."""
    want, new, at = [], {}, 0
    with torch.no_grad():
        for r, n in chunks:
            cache.step_inputs([(r, 0, 1)])  # a slot for a new request, zeroed
            out, new[r] = model.reference(x[at:at + n], *(cache.state(r, i).clone() for i in range(4)))
            want.append(out)
            at += n
    decode = all(n == 1 for _, n in chunks)
    with torch.inference_mode():
        got = runner.run(uniform_decode=decode, num_reqs=len(chunks) if decode else None, x=x,
                         **cache.step_inputs([(r, 0, n) for r, n in chunks])).clone()
    cache.commit([r for r, _ in chunks])
    assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)
    for r, states in new.items():
        for i, s in enumerate(states):
            assert_close(cache.state(r, i), s.to(cache.states[i].dtype), rtol=1e-5, atol=1e-5)
    return runner.last_mode


@pytest.mark.parametrize("capture_first", [True, False], ids=["captured-at-startup", "captured-mid-serving"])
def test_new_state_ops_prefill_per_request_and_decode_inside_full_graphs(capture_first):
    model = KernelToy()
    cache = st.StateCache(_specs(), num_slots=4)
    compiled, _ = compile_model(model, CONFIG)
    runner = pb.GraphRunner(
        compiled, CONFIG, [pb.StaticInput("x", shape=(D,), dtype=torch.float32), *cache.static_inputs()],
        model_args=["x"], context_fn=cache.context_fn, max_num_reqs=cache.num_slots,
        attention_support=pb.AttentionGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE, device=cache.device,
    )
    if capture_first:
        runner.capture()
    g = torch.Generator().manual_seed(4)
    x = lambda n: torch.randn(n, D, generator=g)
    assert _step(runner, cache, model, [("a", 6), ("b", 3), ("c", 1)], x(10)) == pb.CUDAGraphMode.PIECEWISE
    assert _step(runner, cache, model, [("a", 2), ("b", 5)], x(7)) == pb.CUDAGraphMode.PIECEWISE  # chunked prefill
    for _ in range(2):  # a capture (mid-serving) then a replay: each advances the states once
        assert _step(runner, cache, model, [("c", 1), ("a", 1), ("b", 1)], x(3)) == pb.CUDAGraphMode.FULL
