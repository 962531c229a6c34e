"""The per-request state cache and the pb_state ops (state/): exactness, kernels against transformers, graphs."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend import state as st
from piecewise_backend.state.metadata import STATE_INDEX
from pbtest.helpers import compile_model

C, K, HK, HV, DK, DV = 8, 4, 1, 2, 4, 4
SH, SP, SG, SN = 4, 2, 2, 3  # Mamba2: heads, head_dim, groups, state size
MN = 3  # Mamba1: state size (its channels are the conv's C)
CONFIG = pb.CompilationConfig(
    platform="simulated", compile_pieces="eager", cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8, 16]
)


# --- allocator and cache bookkeeping ---

def test_slot_allocator_is_exact_and_atomic():
    a = st.SlotAllocator(2)
    s0, s1 = a.allocate(), a.allocate()
    assert {s0, s1} == {0, 1} and a.num_free == 0
    with pytest.raises(RuntimeError, match="out of state slots"):
        a.allocate()
    a.free(s0)
    with pytest.raises(ValueError, match="double free"):
        a.free(s0)
    with pytest.raises(ValueError, match="not a slot of this allocator"):
        a.free(7)
    with pytest.raises(ValueError, match="not a slot"):
        a.free(True)
    assert a.num_free == 1
    with pytest.raises(ValueError, match="positive int"):
        st.SlotAllocator(0)


def test_cache_allocates_zeroed_slots_commits_and_refuses_out_of_slots_atomically():
    cache = st.StateCache([st.StateSpec(0, "conv", (C, K - 1))], num_slots=2)
    cache.states[0].fill_(5.0)
    inputs = cache.step_inputs([("a", 0, 3)])
    slot = cache.slots["a"]
    assert inputs[STATE_INDEX].tolist() == [slot] * 3
    assert cache.state("a", 0).abs().sum() == 0  # a new request starts from zeros
    cache.commit(["a"])
    assert cache.read_row("a") == cache.copies + slot  # the written copy is current now
    with pytest.raises(RuntimeError, match="out of state slots: 2 new requests"):
        cache.step_inputs([("b", 0, 1), ("c", 0, 1)])
    assert set(cache.slots) == {"a"} and cache.allocator.num_free == 1  # nothing allocated
    with pytest.raises(ValueError, match="already holds"):
        cache.allocate("a")
    cache.free("a")
    with pytest.raises(KeyError, match="holds no state slot"):
        cache.free("a")
    with pytest.raises(KeyError, match="hold no state slot"):
        cache.commit(["a"])
    assert cache.memory_bytes == 2 * 3 * C * (K - 1) * 4  # two copies of 2 slots + scratch
    assert cache.bytes_per_request == C * (K - 1) * 4


def test_state_spec_and_cache_refuse_bad_input():
    with pytest.raises(ValueError, match="kind"):
        st.StateSpec(0, "", (1,))
    with pytest.raises(ValueError, match="shape"):
        st.StateSpec(0, "conv", [1])
    with pytest.raises(ValueError, match="each \\(layer, kind\\) once"):
        st.StateCache([st.StateSpec(0, "conv", (1,)), st.StateSpec(0, "conv", (2,))], num_slots=1)
    with pytest.raises(TypeError, match="StateSpecs"):
        st.StateCache([(0, "conv")], num_slots=1)


def test_ops_need_state_metadata():
    x = torch.randn(3, C)
    with pytest.raises(RuntimeError, match="state_metadata"):
        torch.ops.pb_state.causal_conv1d(x, torch.randn(C, K), None, torch.empty_like(x), 0, "")
    cache = st.StateCache([st.StateSpec(0, "conv", (C, K - 1))], num_slots=2)
    meta = cache.metadata(cache.step_inputs([("a", 0, 2)]))  # state rows for 2 tokens, the op gets 3
    out = torch.zeros_like(x)
    with pb.set_forward_context(pb.CUDAGraphMode.NONE, None, state_metadata=meta):
        with pytest.raises(ValueError, match="3 tokens but state metadata for 2"):
            torch.ops.pb_state.causal_conv1d(x, torch.randn(C, K), None, out, 0, "")
    assert torch.equal(out, torch.zeros_like(x)) and not cache.states[0].any()  # refused before writing anything


def _op_calls(T: int = 2) -> dict[str, tuple]:
    """Each state op with well-formed inputs for ``T`` tokens: (call(out, state, size), out, the slot shape it needs)."""
    r, ops = torch.randn, torch.ops.pb_state
    x, w, a = r(T, C), r(C, K), r(T, C)
    q, k, v, g, beta = r(T, HK, DK), r(T, HK, DK), r(T, HV, DV), -torch.rand(T, HV), torch.rand(T, HV)
    kq, kg = r(T, HV, DK), -torch.rand(T, HV, DK)
    lq, slope = r(T, HV, DV), torch.rand(HV)
    u, dt, A1, B1 = r(T, C), torch.rand(T, C), -torch.rand(C, MN), r(T, MN)
    x2, dt2, A2, B2 = r(T, SH, SP), torch.rand(T, SH), -torch.rand(SH), r(T, SG, SN)
    return {
        "causal_conv1d": (lambda out, i, n: ops.causal_conv1d(x, w, None, out, i, ""), torch.zeros(T, C), (C, K - 1)),
        "gated_delta_rule": (lambda out, i, n: ops.gated_delta_rule(q, k, v, g, beta, out, i, True, n),
                             torch.zeros(T, HV, DV), (HV, DK, DV)),
        "kda_rule": (lambda out, i, n: ops.kda_rule(kq, kq, v, kg, beta, out, i, True, n), torch.zeros(T, HV, DV),
                     (HV, DK, DV)),
        "lightning_attention": (lambda out, i, n: ops.lightning_attention(lq, lq, lq, slope, out, i, n),
                                torch.zeros(T, HV, DV), (HV, DV, DV)),
        "linear_recurrence": (lambda out, i, n: ops.linear_recurrence(a, x, out, i), torch.zeros(T, C), (C,)),
        "selective_scan": (lambda out, i, n: ops.selective_scan(u, dt, A1, B1, B1, None, None, None, out, i, True),
                           torch.zeros(T, C), (C, MN)),
        "ssd_scan": (lambda out, i, n: ops.ssd_scan(x2, dt2, A2, B2, B2, None, None, out, i, n, True, 0.0, float("inf")),
                     torch.zeros(T, SH, SP), (SH, SP, SN)),
        "causal_window": (lambda out, i, n: ops.causal_window(x, out, i), torch.zeros(T, C, K), (C, K - 1)),
    }


@pytest.mark.parametrize("name", sorted(_op_calls()))
def test_every_state_op_refuses_a_state_its_inputs_do_not_fit(name):
    call, out, shape = _op_calls()[name]
    wrong = (*shape[:-1], shape[-1] + 1)
    cache = st.StateCache([st.StateSpec(0, "right", shape), st.StateSpec(0, "wrong", wrong)], num_slots=1)
    meta = cache.metadata(cache.step_inputs([("a", 0, 2)]))
    with pb.set_forward_context(pb.CUDAGraphMode.NONE, None, state_metadata=meta):
        call(out, 0, 4)  # the state it fits: runs
        assert out.abs().sum() > 0
        out.zero_()
        with pytest.raises(ValueError, match=rf"pb_state::{name}: .*; the state holds \({', '.join(map(str, wrong))},?\), "
                                             r"it must be \("):
            call(out, 1, 4)
        with pytest.raises(ValueError, match=rf"pb_state::{name}: state 2 out of range; the state cache holds 2 states"):
            call(out, 2, 4)
    assert not out.any() and not cache.states[1].any()  # refused before writing anything


@pytest.mark.parametrize("name, size", [("gated_delta_rule", "chunk_size"), ("kda_rule", "chunk_size"),
                                        ("lightning_attention", "block_size"), ("ssd_scan", "chunk_size")])
def test_chunked_state_ops_refuse_a_chunk_length_below_one(name, size):
    call, out, shape = _op_calls()[name]
    cache = st.StateCache([st.StateSpec(0, "state", shape)], num_slots=1)
    meta = cache.metadata(cache.step_inputs([("a", 0, 2)]))
    with pb.set_forward_context(pb.CUDAGraphMode.NONE, None, state_metadata=meta):
        with pytest.raises(ValueError, match=rf"pb_state::{name}: {size} must be >= 1, got 0"):
            call(out, 0, 0)
    assert not out.any() and not cache.states[0].any()


# --- kernels against transformers' torch fallbacks ---

def _delta_inputs(n: int, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(batch, n, HK, DK), r(batch, n, HK, DK), r(batch, n, HV, DV), -torch.rand(batch, n, HV, generator=g),
            torch.rand(batch, n, HV, generator=g))


def test_delta_kernels_match_transformers():
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta = _delta_inputs(70)  # more than one chunk of 64
    s0 = torch.randn(1, HV, DK, DV)
    ref, ref_state = qn.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    out, state = st.delta_sequence(q[0], k[0], v[0], g[0], beta[0], s0[0])
    assert_close(out, ref[0], rtol=0, atol=1e-6)
    assert_close(state, ref_state[0], rtol=0, atol=1e-6)
    q, k, v, g, beta = _delta_inputs(1, batch=3)
    states = torch.randn(3, HV, DK, DV)
    ref, ref_state = qn.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=states.clone(),
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, new = st.delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], states)
    assert_close(out, ref[:, 0], rtol=0, atol=0)
    assert_close(new, ref_state, rtol=0, atol=0)


def test_chunked_and_recurrent_delta_rule_agree_and_chain():
    q, k, v, g, beta = (t[0] for t in _delta_inputs(20))
    s = torch.randn(HV, DK, DV)
    whole, end = st.delta_sequence(q, k, v, g, beta, s)
    first, mid = st.delta_sequence(q[:7], k[:7], v[:7], g[:7], beta[:7], s, chunk_size=4)  # a prefill in two chunks
    rest, end2 = st.delta_sequence(q[7:], k[7:], v[7:], g[7:], beta[7:], mid)
    assert_close(torch.cat([first, rest]), whole, rtol=0, atol=1e-5)
    assert_close(end2, end, rtol=0, atol=1e-5)
    steps = []
    for t in range(20):
        o, s1 = st.delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], (s if t == 0 else s1))
        steps.append(o[0])
    assert_close(torch.stack(steps), whole, rtol=0, atol=1e-5)


def _transformers_at_least(version: str) -> bool:
    import transformers

    return tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= tuple(int(p) for p in version.split("."))


def test_ssd_kernels_match_transformers():
    nh = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, dt, B, Cm = r(1, 37, SH, SP), r(1, 37, SH), r(1, 37, SG, SN), r(1, 37, SG, SN)
    A, D, bias, s0 = -torch.rand(SH, generator=g), r(SH), r(SH), r(1, SH, SP, SN)
    ref, ref_state = nh.mamba2_chunk_scan(x, dt, A, B, Cm, 8, D=D, dt_bias=bias, initial_states=s0, dt_softplus=True,
                                          return_final_states=True, dt_limit=(0.0, float("inf")))
    y, state = st.ssd_sequence(x[0], dt[0], A, B[0], Cm[0], D, bias, s0[0], 8)
    # ssd_sequence contracts as 5.24's einsums do, bit for bit; 5.17 broadcasts and sums (its rounding differs)
    atol = 0 if _transformers_at_least("5.24") else 2e-6
    assert_close(y, ref[0], rtol=0, atol=atol)
    assert_close(state, ref_state[0], rtol=0, atol=atol)
    states = r(3, SH, SP, SN)
    x1, dt1, B1, C1 = r(3, SH, SP), r(3, SH), r(3, SG, SN), r(3, SG, SN)
    hf_states = states.clone()
    ref = nh.mamba2_selective_state_update(hf_states, x1, dt1[..., None].expand(-1, -1, SP),
                                           A[:, None, None].expand(-1, SP, SN), B1, C1, D[:, None].expand(-1, SP),
                                           dt_bias=bias[:, None].expand(-1, SP), dt_softplus=True)
    y, new = st.ssd_step(x1, dt1, A, B1, C1, D, bias, states)
    assert_close(y, ref, rtol=0, atol=0)
    assert_close(new, hf_states, rtol=0, atol=0)
    steps, s = [], s0[0]
    for t in range(37):  # the recurrence token by token == the chunked form
        out, s1 = st.ssd_step(x[:, t], dt[:, t], A, B[:, t], Cm[:, t], D, bias, s[None])
        steps.append(out[0])
        s = s1[0]
    assert_close(torch.stack(steps), y_whole := st.ssd_sequence(x[0], dt[0], A, B[0], Cm[0], D, bias, s0[0], 8)[0],
                 rtol=1e-5, atol=1e-5)
    assert y_whole.shape == x[0].shape


def test_selective_scan_kernels_match_transformers():
    mb = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    g = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    u, dt, z, B, Cm = r(1, C, 11), r(1, C, 11), r(1, C, 11), r(1, MN, 11), r(1, MN, 11)
    A, D, bias = -torch.rand(C, MN, generator=g), r(C), r(C)
    ref, ref_state = mb.mamba_selective_scan(u, dt, A, B, Cm, D=D, z=z, delta_bias=bias, delta_softplus=True,
                                             return_last_state=True, use_mambapy=False, use_associative_scan=False)
    y, state = st.selective_sequence(u[0].T, dt[0].T, A, B[0].T, Cm[0].T, D, z[0].T, bias, torch.zeros(C, MN))
    assert_close(y.T, ref[0], rtol=0, atol=0)
    assert_close(state, ref_state[0], rtol=0, atol=0)
    states = r(3, C, MN)
    u1, dt1, z1, B1, C1 = r(3, C), r(3, C), r(3, C), r(3, MN), r(3, MN)
    hf_states = states.clone()
    ref_step = mb.mamba_selective_state_update(hf_states, u1, dt1, A, B1, C1, D, z=z1, dt_bias=bias, dt_softplus=True)
    y, new = st.selective_step(u1, dt1, A, B1, C1, D, z1, bias, states)
    assert_close(y, ref_step, rtol=0, atol=0)
    assert_close(new, hf_states, rtol=0, atol=0)
    first, mid = st.selective_sequence(u[0, :, :4].T, dt[0, :, :4].T, A, B[0, :, :4].T, Cm[0, :, :4].T, D,
                                       z[0, :, :4].T, bias, torch.zeros(C, MN))  # a prefill in two chunks
    rest, end = st.selective_sequence(u[0, :, 4:].T, dt[0, :, 4:].T, A, B[0, :, 4:].T, Cm[0, :, 4:].T, D,
                                      z[0, :, 4:].T, bias, mid)
    assert_close(torch.cat([first, rest]).T, ref[0], rtol=1e-6, atol=1e-6)
    assert_close(end, ref_state[0], rtol=1e-6, atol=1e-6)


def test_conv_kernels_match_transformers():
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, w, b = torch.randn(1, C, 9), torch.randn(C, K), torch.randn(C)
    out, state = st.conv_sequence(x[0].T, torch.zeros(C, K - 1), w, b, "silu")
    assert_close(out.T, qn.causal_conv1d_fn(x, w, b, activation="silu")[0], rtol=0, atol=1e-6)
    assert_close(state, x[0, :, -(K - 1):], rtol=0, atol=0)
    hf_state = torch.randn(3, C, K)  # transformers keeps K columns; the first is never read
    step = torch.randn(3, C, 1)
    ref = qn.causal_conv1d_update(step, hf_state.clone(), w, b, "silu")
    out, new = st.conv_step(step[:, :, 0], hf_state[:, :, 1:], w, b, "silu")
    assert_close(out, ref[:, :, 0], rtol=0, atol=0)
    assert_close(new[:, :, -1], step[:, :, 0], rtol=0, atol=0)
    first, mid = st.conv_sequence(x[0, :, :2].T, torch.zeros(C, K - 1), w, b)  # shorter than the kernel
    rest, _ = st.conv_sequence(x[0, :, 2:].T, mid, w, b)
    assert_close(torch.cat([first, rest]).T, qn.causal_conv1d_fn(x, w, b)[0], rtol=0, atol=1e-6)


# --- the ops under a GraphRunner: eager, PIECEWISE breaks, FULL graphs ---

class StateToy(torch.nn.Module):
    """A short conv, then a gated delta rule, a Mamba2 scan and a Mamba1 scan on per-token features:
    (tokens, C) -> (tokens, C + HV * DV + SH * SP + C)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(C, K))
        self.bias = torch.nn.Parameter(torch.randn(C))
        self.proj = torch.nn.Linear(C, 2 * HK * DK + HV * DV + 2 * HV)
        self.ssm_proj = torch.nn.Linear(C, SH * SP + SH + 2 * SG * SN)
        self.A, self.D, self.dt_bias = (torch.nn.Parameter(t) for t in (-torch.rand(SH) - 0.5, torch.randn(SH), torch.randn(SH)))
        self.sel_proj = torch.nn.Linear(C, 2 * C + 2 * MN)  # dt, z, B, C
        self.A1, self.D1, self.bias1 = (torch.nn.Parameter(t) for t in (-torch.rand(C, MN) - 0.5, torch.randn(C), torch.randn(C)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = torch.empty_like(x)
        torch.ops.pb_state.causal_conv1d(x, self.weight, self.bias, conv, 0, "silu")
        q, k, v, g, beta = self.split(self.proj(conv))
        out = torch.empty(x.shape[0], HV, DV, dtype=x.dtype, device=x.device)
        torch.ops.pb_state.gated_delta_rule(q, k, v, g, beta, out, 1, True, 64)
        xs, dt, B, Cm = self.ssm_split(self.ssm_proj(conv))
        ys = torch.empty_like(xs)
        torch.ops.pb_state.ssd_scan(xs, dt, self.A, B, Cm, self.D, self.dt_bias, ys, 2, 4, True, 0.0, float("inf"))
        dt1, z, B1, C1 = self.sel_proj(conv).split([C, C, MN, MN], dim=-1)
        y1 = torch.empty_like(conv)
        torch.ops.pb_state.selective_scan(conv, dt1, self.A1, B1, C1, self.D1, z, self.bias1, y1, 3, True)
        return torch.cat([conv, out.flatten(1), ys.flatten(1), y1], dim=-1)

    @staticmethod
    def ssm_split(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, dt, B, Cm = h.split([SH * SP, SH, SG * SN, SG * SN], dim=-1)
        t = h.shape[0]
        return x.reshape(t, SH, SP), dt, B.reshape(t, SG, SN), Cm.reshape(t, SG, SN)

    @staticmethod
    def split(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, a, b = h.split([HK * DK, HK * DK, HV * DV, HV, HV], dim=-1)
        t = h.shape[0]
        return q.reshape(t, HK, DK), k.reshape(t, HK, DK), v.reshape(t, HV, DV), -torch.nn.functional.softplus(a), b.sigmoid()

    def reference(
        self, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor, ssm_state: torch.Tensor,
        sel_state: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """One request, eagerly, from its states: (output, new conv state, new recurrent state)."""
        conv, new_conv = st.conv_sequence(x, conv_state, self.weight, self.bias, "silu")
        q, k, v, g, beta = self.split(self.proj(conv))
        out, new_rec = st.delta_sequence(q, k, v, g, beta, rec_state)
        xs, dt, B, Cm = self.ssm_split(self.ssm_proj(conv))
        ys, new_ssm = st.ssd_sequence(xs, dt, self.A, B, Cm, self.D, self.dt_bias, ssm_state, 4)
        dt1, z, B1, C1 = self.sel_proj(conv).split([C, C, MN, MN], dim=-1)
        y1, new_sel = st.selective_sequence(conv, dt1, self.A1, B1, C1, self.D1, z, self.bias1, sel_state)
        return torch.cat([conv, out.flatten(1), ys.flatten(1), y1], dim=-1), new_conv, new_rec, new_ssm, new_sel


def specs() -> list[st.StateSpec]:
    return [st.StateSpec(0, "conv", (C, K - 1)), st.StateSpec(0, "recurrent", (HV, DK, DV)),
            st.StateSpec(0, "ssm", (SH, SP, SN)), st.StateSpec(1, "ssm", (C, MN))]


def make_runner(model: StateToy, cache: st.StateCache, config: pb.CompilationConfig = CONFIG) -> pb.GraphRunner:
    compiled, _ = compile_model(model, config)
    return pb.GraphRunner(
        compiled, config, [pb.StaticInput("x", shape=(C,), dtype=torch.float32), *cache.static_inputs()],
        model_args=["x"], context_fn=cache.context_fn, max_num_reqs=cache.num_slots,
        attention_support=pb.AttentionGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE, device=cache.device,
    )


def seeded_states(cache: st.StateCache, requests: list[str]) -> None:
    """Give every request a slot holding random states; every free slot (both copies) NaN."""
    cache.step_inputs([(r, 0, 1) for r in requests])
    g = torch.Generator().manual_seed(3)
    for r in requests:
        for i in range(len(cache.states)):
            cache.state(r, i).copy_(torch.randn(cache.state(r, i).shape, generator=g))
    cache.poison_free()


def run_step(runner: pb.GraphRunner, cache: st.StateCache, chunks: list[tuple[str, int]], x: torch.Tensor) -> torch.Tensor:
    """One step of ``(request, tokens)`` chunks; commits the states it wrote."""
    decode = all(n == 1 for _, n in chunks)
    with torch.inference_mode():
        out = runner.run(uniform_decode=decode, num_reqs=len(chunks) if decode else None, x=x,
                         **cache.step_inputs([(r, 0, n) for r, n in chunks])).clone()
    cache.commit([r for r, _ in chunks])
    return out


def expected(model: StateToy, cache: st.StateCache, chunks: list[tuple[str, int]], x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Per-request eager reference from the cache's current states (read before the step)."""
    outs, new, at = [], {}, 0
    with torch.no_grad():
        for r, n in chunks:
            out, *states = model.reference(x[at:at + n], *(cache.state(r, i).clone() for i in range(4)))
            outs.append(out)
            new[r] = states
            at += n
    return torch.cat(outs), new


def snapshot(cache: st.StateCache) -> list[torch.Tensor]:
    return [t.clone() for t in cache.states]


def check_only_requests_changed(cache: st.StateCache, before: list[torch.Tensor], new: dict) -> None:
    """The step's requests' current copies equal ``new``; every other row (other requests, free slots, the
    copies the step read) is as before, NaN included; only the scratch slot's written copy may differ."""
    written = {cache.read_row(r) for r in new}
    scratch = {cache.scratch, cache.scratch + cache.copies}
    for i, (t, b) in enumerate(zip(cache.states, before)):
        for r, states in new.items():
            assert_close(t[cache.read_row(r)], states[i].to(t.dtype), rtol=1e-5, atol=1e-5)
        for row in set(range(t.shape[0])) - written - scratch:
            assert torch.equal(t[row].isnan(), b[row].isnan()) and torch.equal(t[row].nan_to_num(), b[row].nan_to_num()), (
                f"state {i} row {row} changed but belongs to no request of the step"
            )


@pytest.mark.parametrize("capture_first", [True, False], ids=["captured-at-startup", "captured-mid-serving"])
def test_full_decode_replay_updates_exactly_the_steps_slots(capture_first):
    model = StateToy()
    cache = st.StateCache(specs(), num_slots=5)
    runner = make_runner(model, cache)
    if capture_first:
        runner.capture()
    seeded_states(cache, ["a", "b", "c", "d"])
    x = torch.randn(3, C)
    chunks = [("c", 1), ("a", 1), ("d", 1)]  # 3 requests padded to 4: the padding row must use the scratch slot
    want, new = expected(model, cache, chunks, x)
    before = snapshot(cache)
    got = run_step(runner, cache, chunks, x)
    assert runner.last_mode == pb.CUDAGraphMode.FULL
    assert torch.isfinite(got).all()
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    check_only_requests_changed(cache, before, new)
    # the next step reads what this one committed: a second decode from the new states (a replay now)
    x2 = torch.randn(3, C)
    want2, new2 = expected(model, cache, chunks, x2)
    before = snapshot(cache)
    assert_close(run_step(runner, cache, chunks, x2), want2, rtol=1e-5, atol=1e-5)
    check_only_requests_changed(cache, before, new2)


@pytest.mark.parametrize("capture_first", [True, False], ids=["captured-at-startup", "captured-mid-serving"])
def test_mixed_step_of_several_prefills_equals_per_request_eager(capture_first):
    model = StateToy()
    cache = st.StateCache(specs(), num_slots=4)
    runner = make_runner(model, cache)
    if capture_first:
        runner.capture()
    seeded_states(cache, ["old", "dec"])  # "old" continues a prefill (a chunk) from its state
    chunks = [("new", 5), ("dec", 1), ("old", 3), ("new2", 2)]
    x = torch.randn(11, C)
    cache.step_inputs([("new", 0, 1), ("new2", 0, 1)])  # new requests: zeroed slots
    cache.poison_free()
    want, new = expected(model, cache, chunks, x)
    before = snapshot(cache)
    got = run_step(runner, cache, chunks, x)
    assert runner.last_mode == pb.CUDAGraphMode.PIECEWISE
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    check_only_requests_changed(cache, before, new)


@pytest.mark.cuda
def test_state_ops_in_real_cuda_graphs_touch_exactly_the_steps_slots(monkeypatch):
    """The CUDA twin of the two tests above (captured at startup): a real FULL graph gathers and scatters by
    slot with no host read (a host read inside a capture raises there), padding uses the scratch slot, and a
    mixed step's per-request breaks run between real PIECEWISE segments."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # full float32 convolutions, as on the CPU (matmuls are by default)
    model = StateToy().cuda()
    cache = st.StateCache(specs(), num_slots=5, device="cuda")
    runner = make_runner(model, cache, CONFIG.replace(platform="cuda"))
    runner.capture()
    seeded_states(cache, ["a", "b", "c", "d"])
    for chunks in ([("c", 1), ("a", 1), ("d", 1)], [("new", 5), ("b", 1), ("a", 3)]):
        x = torch.randn(sum(n for _, n in chunks), C, device="cuda")
        cache.step_inputs([(r, 0, 1) for r, _ in chunks])  # "new": a zeroed slot
        cache.poison_free()
        want, new = expected(model, cache, chunks, x)
        before = snapshot(cache)
        got = run_step(runner, cache, chunks, x)
        decode = all(n == 1 for _, n in chunks)
        assert runner.last_mode == (pb.CUDAGraphMode.FULL if decode else pb.CUDAGraphMode.PIECEWISE)
        assert_close(got, want, rtol=1e-4, atol=1e-4)
        check_only_requests_changed(cache, before, new)


def test_a_step_that_fails_after_its_state_ops_changes_no_state():
    """The ops write only the copies nobody reads; a step that fails before commit() leaves every state as it was."""
    model = StateToy()
    cache = st.StateCache(specs(), num_slots=2)
    seeded_states(cache, ["a"])
    before = snapshot(cache)
    row = cache.read_row("a")
    meta = cache.metadata(cache.step_inputs([("a", 0, 4)]))
    with torch.no_grad(), pb.set_forward_context(state_metadata=meta):
        model(torch.randn(4, C))  # ... and the rest of the step fails: no commit
    assert cache.read_row("a") == row
    for t, b in zip(cache.states, before):
        assert torch.equal(t[row], b[row])


def test_eager_op_runs_a_break_twice_without_applying_the_update_twice():
    """A break runs at capture and again at replay (and a CUDA warm-up runs it once more): out of place, the
    second run computes from the same state as the first."""
    model = StateToy()
    cache = st.StateCache(specs(), num_slots=2)
    seeded_states(cache, ["a"])
    x = torch.randn(4, C)
    meta = cache.metadata(cache.step_inputs([("a", 0, 4)]))
    with torch.no_grad(), pb.set_forward_context(state_metadata=meta):
        first = model(x)
        second = model(x)
    assert_close(first, second, rtol=0, atol=0)


def test_an_op_captured_inside_a_piecewise_segment_refuses():
    """An unsplit model (not compiled with the backend, or run uncompiled by Dynamo) puts the op inside a
    PIECEWISE segment, where it can neither run per request nor assume one token each: a clear error."""
    model = StateToy()
    cache = st.StateCache(specs(), num_slots=2)
    runner = pb.GraphRunner(
        model, CONFIG, [pb.StaticInput("x", shape=(C,), dtype=torch.float32), *cache.static_inputs()],
        model_args=["x"], context_fn=cache.context_fn, max_num_reqs=2,
        attention_support=pb.AttentionGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE,
    )
    with torch.inference_mode(), pytest.raises(RuntimeError, match="captured inside a PIECEWISE graph segment"):
        runner.run(x=torch.randn(3, C), **cache.step_inputs([("a", 0, 3)]))
