"""Attention backends (attention/backends.py, attention/cuda.py) against the reference, and how a cache picks them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import piecewise_backend as pb
from piecewise_backend import attention, kv
from piecewise_backend.attention import cuda as attention_cuda

DIM = 8


@dataclasses.dataclass
class Step:
    q: torch.Tensor
    meta: kv.PagedAttentionMetadata


def ragged_steps(
    seed: int, kv_heads: int, group: int, block: int, max_model_len: int, pad: int = 2,
    dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> tuple[kv.PagedKVCache, list[Step]]:
    """Three steps of a random ragged batch (chunked prefills, decodes, padding) on a NaN-filled, fragmented cache.

    Every slot not written by a real token holds NaN (scratch, freed blocks, block tails), so a
    backend that multiplies anything it should mask shows NaN.
    """
    g = torch.Generator().manual_seed(seed)
    cache = kv.PagedKVCache(1, kv_heads, DIM, num_blocks=64, block_size=block, max_model_len=max_model_len,
                            dtype=dtype, device=device, attention_backend="reference")
    for c in cache.key_caches + cache.value_caches:
        c.fill_(float("nan"))
    order = torch.randperm(8, generator=g).tolist()
    for r in range(8):
        cache.reserve(("frag", r), int(torch.randint(1, 3 * block, (1,), generator=g)))
    for r in order:
        cache.free(("frag", r))
    lens = [int(n) for n in torch.randint(1, 3 * block + 3, (4,), generator=g)]
    done = [0] * len(lens)
    steps = []
    heads = kv_heads * group
    for _ in range(3):
        chunks = []
        for r, n in enumerate(lens):
            if done[r] < n:
                count = min(n - done[r], int(torch.randint(1, n + 1, (1,), generator=g)))
                chunks.append((r, done[r], count))
                done[r] += count
            elif done[r] < max_model_len:  # decode past the prompt
                chunks.append((r, done[r], 1))
                done[r] += 1
        meta = cache.step_inputs(chunks)
        tokens = sum(c[2] for c in chunks)
        q, k, v = (torch.randn(tokens, h, DIM, generator=g) * 2 for h in (heads, kv_heads, kv_heads))
        meta[kv.POSITIONS] = torch.cat([meta[kv.POSITIONS], torch.zeros(pad, dtype=torch.long)])
        meta[kv.SLOT_MAPPING] = torch.cat([meta[kv.SLOT_MAPPING], torch.full((pad,), kv.PAD_SLOT)])
        meta[kv.REQUEST_INDEX] = torch.cat([meta[kv.REQUEST_INDEX], torch.zeros(pad, dtype=torch.long)])
        q, k, v = (torch.cat([t, torch.full((pad, *t.shape[1:]), float("nan"))]).to(device, dtype) for t in (q, k, v))
        meta = {name: t.to(device) for name, t in meta.items()}
        kv.write_kv(k, v, cache.key_caches[0], cache.value_caches[0], meta[kv.SLOT_MAPPING])
        steps.append(Step(q, cache.metadata(meta)))
    return cache, steps


def run(name: str, cache: kv.PagedKVCache, step: Step, window: int, softcap: float, sinks, captured: bool = False):
    mode = pb.CUDAGraphMode.FULL if captured else pb.CUDAGraphMode.NONE
    with pb.set_forward_context(mode):
        return attention.run_attention(
            (name,), step.q, cache.key_caches[0], cache.value_caches[0], step.meta, 0.4, window, softcap, sinks
        )


CASES = [  # seed, kv_heads, group (GQA ratio), block, window, softcap, sinks
    (0, 2, 2, 4, -1, 0.0, False),
    (1, 1, 4, 4, 3, 0.0, True),
    (2, 2, 1, 2, 5, 1.5, False),
    (3, 4, 2, 8, 1, 0.0, False),
    (4, 1, 2, 4, 9, 1.5, True),
]


@pytest.mark.parametrize("chunks", ["one", "many"])
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("seed, kv_heads, group, block, window, softcap, sinks", CASES)
def test_bounded_matches_reference(seed, kv_heads, group, block, window, softcap, sinks, captured, chunks, monkeypatch):
    """Random block tables, windows, GQA ratios, padding, NaN everywhere unwritten: bounded == reference, finite.

    ``many``: chunks of one block (eager) or two (captured), so the online softmax spans several."""
    monkeypatch.setitem(attention.backends._BACKENDS, "many", attention.AttentionBackend(
        "many", attention.BoundedAttention(eager_chunk_keys=block, graph_chunk_keys=2 * block),
        pb.AttentionGraphSupport.ALWAYS))
    cache, steps = ragged_steps(seed, kv_heads, group, block, max_model_len=64)
    sink_logits = torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(seed)) if sinks else None
    for step in steps:
        expected = run("reference", cache, step, window, softcap, sink_logits)
        got = run("bounded" if chunks == "one" else "many", cache, step, window, softcap, sink_logits, captured)
        real = step.meta.slot_mapping >= 0  # padding rows have NaN queries: their own rows are garbage
        assert torch.isfinite(got[real]).all()
        assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def chunked_reference(step: Step, cache: kv.PagedKVCache, chunk: int, window: int) -> torch.Tensor:
    """Each token over its own request's keys, by hand: causal, within ``window``, same ``chunk`` of positions."""
    meta, q = step.meta, step.q
    keys, values = cache.key_caches[0].flatten(0, 1), cache.value_caches[0].flatten(0, 1)
    out = torch.zeros_like(q)
    for t in range(q.shape[0]):
        if meta.slot_mapping[t] < 0:
            continue
        pos = int(meta.positions[t])
        table = meta.block_tables[meta.request_index[t]]
        visible = [p for p in range(pos + 1) if p // chunk == pos // chunk and (window <= 0 or p > pos - window)]
        rows = torch.tensor([int(table[p // cache.block_size]) * cache.block_size + p % cache.block_size for p in visible])
        k = keys[rows].repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        v = values[rows].repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        weights = (torch.einsum("hd,lhd->hl", q[t], k) * 0.4).softmax(-1)
        out[t] = torch.einsum("hl,lhd->hd", weights, v)
    return out


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("name", ["reference", "bounded", "many"])
@pytest.mark.parametrize("chunk, window", [(4, -1), (3, -1), (8, 5)])
def test_chunked_attention_sees_only_its_chunk(chunk, window, name, captured, monkeypatch):
    """llama4's chunked attention: a token attends to keys of its own chunk of positions only (and its window)."""
    monkeypatch.setitem(attention.backends._BACKENDS, "many", attention.AttentionBackend(
        "many", attention.BoundedAttention(eager_chunk_keys=2, graph_chunk_keys=2),
        pb.AttentionGraphSupport.ALWAYS, chunked=True))
    cache, steps = ragged_steps(5, 2, 2, 2, max_model_len=64)
    for step in steps:
        with pb.set_forward_context(pb.CUDAGraphMode.FULL if captured else pb.CUDAGraphMode.NONE):
            got = attention.run_attention((name,), step.q, cache.key_caches[0], cache.value_caches[0], step.meta, 0.4,
                                          window, 0.0, None, chunk_size=chunk)
        real = step.meta.slot_mapping >= 0
        assert torch.isfinite(got[real]).all()
        assert_close(got[real], chunked_reference(step, cache, chunk, window)[real], atol=1e-5, rtol=1e-5)


def test_a_backend_without_chunking_hands_chunked_layers_on(monkeypatch):
    """A backend that does not declare ``chunked`` never sees ``chunk_size``; alone, it refuses chunked layers."""
    calls = []

    def plain(*args):
        calls.append(len(args))
        return attention.get_attention_backend("reference").fn(*args)

    monkeypatch.setitem(attention.backends._BACKENDS, "plain", attention.AttentionBackend(
        "plain", plain, pb.AttentionGraphSupport.ALWAYS))
    cache, steps = ragged_steps(0, 2, 2, 4, max_model_len=32)
    args = (steps[0].q, cache.key_caches[0], cache.value_caches[0], steps[0].meta, 0.4, -1, 0.0, None)
    attention.run_attention(("plain", "bounded"), *args, chunk_size=4)
    assert calls == []
    attention.run_attention(("plain", "bounded"), *args)
    assert calls == [8]
    with pytest.raises(ValueError, match="'plain' does not support chunked attention"):
        attention.run_attention(("plain",), *args, chunk_size=4)
    assert attention.get_attention_backend("varlen").unsupported(-1, 0.0, None, 8) is not None


class Largest(TorchDispatchMode):
    """The most elements any op's output had, and whether any op read device values on the host."""

    def __init__(self):
        super().__init__()
        self.numel, self.host_reads = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.numel = max(self.numel, out.numel())
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.host_reads += 1
        return out


def largest(name: str, max_model_len: int, captured: bool, backend: attention.AttentionBackend | None = None):
    cache, steps = ragged_steps(7, 2, 2, 4, max_model_len=max_model_len)
    with Largest() as log:
        if backend is None:
            run(name, cache, steps[-1], -1, 0.0, None, captured)
        else:
            with pb.set_forward_context(pb.CUDAGraphMode.FULL if captured else pb.CUDAGraphMode.NONE):
                backend.fn(steps[-1].q, cache.key_caches[0], cache.value_caches[0], steps[-1].meta, 0.4, -1, 0.0, None)
    return log, steps[-1].q.shape[0]


def test_eager_bounded_work_follows_the_context_not_max_model_len():
    small, _ = largest("bounded", 64, captured=False)
    big, _ = largest("bounded", 4096, captured=False)
    assert big.numel == small.numel
    assert big.host_reads >= 1  # eager: it read the step's longest span
    ref_small, ref_big = largest("reference", 64, False)[0], largest("reference", 4096, False)[0]
    assert ref_big.numel >= 32 * ref_small.numel  # what the issue measured: the reference grows with max_model_len


def test_captured_bounded_holds_a_block_per_token_and_never_reads_the_host():
    """Under capture the span is static (max_model_len), but one chunk is live at a time: with
    a chunk of one block, the largest intermediate is a block's worth of keys per token."""
    one_block = attention.AttentionBackend(
        "one_block", attention.BoundedAttention(graph_chunk_keys=4), pb.AttentionGraphSupport.ALWAYS
    )
    log_small, tokens = largest("", 64, True, one_block)
    log_big, _ = largest("", 4096, True, one_block)
    assert log_big.numel == log_small.numel
    assert log_big.host_reads == 0
    heads, kv_heads, block = 4, 2, 4
    assert log_big.numel <= tokens * block * max(kv_heads * DIM, heads), log_big.numel


def test_an_empty_step_attends_to_nothing():
    cache, steps = ragged_steps(0, 2, 2, 4, max_model_len=32)
    empty = Step(steps[0].q[:0], steps[0].meta)
    for name in ("bounded", "reference"):
        assert run(name, cache, empty, -1, 0.0, None).shape == (0, 4, DIM)


def test_capturing_sees_full_steps_and_the_simulator_recording():
    from piecewise_backend.platforms import get_platform

    assert not attention.capturing()
    with pb.set_forward_context(pb.CUDAGraphMode.PIECEWISE):  # a break of a PIECEWISE step: eager
        assert not attention.capturing()
    with pb.set_forward_context(pb.CUDAGraphMode.FULL):
        assert attention.capturing()
    platform = get_platform("simulated")
    with platform.capture_scope():  # recording, whatever the context says
        recorder = platform.begin()
        try:
            assert attention.capturing()
        finally:
            recorder.abort()


def test_selection_per_device_and_by_name():
    assert attention.select_attention_backends("auto", "cpu", 16) == ("bounded",)
    assert attention.select_attention_backends("reference", "cpu", 16) == ("reference",)
    with pytest.raises(ValueError, match=r"'varlen' cannot serve a torch.float32 cache on cpu with block_size=16: it"):
        attention.select_attention_backends("varlen", "cpu", 16)
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; registered: \[.*'bounded'.*'reference'"):
        kv.PagedKVCache(1, 1, DIM, num_blocks=2, max_model_len=8, attention_backend="flash")
    cache = kv.PagedKVCache(1, 1, DIM, num_blocks=2, max_model_len=8, attention_backend="reference")
    assert cache.attention_backend == "reference"
    assert cache.metadata(cache.step_inputs([("a", 0, 1)])).attention_backends == ("reference",)
    assert kv.PagedKVCache(1, 1, DIM, num_blocks=2, max_model_len=8).attention_backend == "bounded"


def test_a_call_runs_the_first_backend_that_supports_it(monkeypatch):
    """A backend without soft-capping hands soft-capped layers to the next one; alone, it refuses them."""
    calls = []

    def plain(*args):
        calls.append("plain")
        return attention.get_attention_backend("reference").fn(*args)

    monkeypatch.setitem(attention.backends._BACKENDS, "plain", attention.AttentionBackend(
        "plain", plain, pb.AttentionGraphSupport.UNIFORM_BATCH, softcap=False, sinks=False))
    cache, steps = ragged_steps(0, 2, 2, 4, max_model_len=32)
    args = (steps[0].q, cache.key_caches[0], cache.value_caches[0], steps[0].meta, 0.4, -1)
    attention.run_attention(("plain", "bounded"), *args, 0.0, None)
    attention.run_attention(("plain", "bounded"), *args, 2.0, None)
    assert calls == ["plain"]
    with pytest.raises(ValueError, match="'plain' does not support logit soft-capping or attention sinks"):
        attention.run_attention(("plain",), *args, 2.0, torch.zeros(4))
    cache = kv.PagedKVCache(1, 1, DIM, num_blocks=2, max_model_len=8, attention_backend="plain")
    assert cache.attention_graph_support == pb.AttentionGraphSupport.UNIFORM_BATCH


def emulated_varlen(
    out, q, k, v, *, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, seqused_k, block_table
):
    """What torch's varlen_attn_out computes with a block table (its documented semantics), by hand on the CPU."""
    assert cu_seq_q.dtype == cu_seq_k.dtype == seqused_k.dtype == block_table.dtype == torch.int32
    block = k.shape[1]
    group = q.shape[1] // k.shape[2]
    for b in range(cu_seq_q.shape[0] - 1):
        rows = slice(int(cu_seq_q[b]), int(cu_seq_q[b + 1]))
        used, n_q = int(seqused_k[b]), rows.stop - rows.start
        assert 1 <= n_q <= max_q and used <= max_k and int(cu_seq_k[b + 1] - cu_seq_k[b]) == used
        keys = k[block_table[b].long()].flatten(0, 1)[:used].repeat_interleave(group, 1).float()
        values = v[block_table[b].long()].flatten(0, 1)[:used].repeat_interleave(group, 1).float()
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys) * scale
        aligned = torch.arange(n_q)[:, None] + used - n_q  # bottom-right alignment of queries to keys
        j = torch.arange(used)[None, :]
        visible = torch.ones(n_q, used, dtype=torch.bool)
        if window_size[0] >= 0:
            visible &= j >= aligned - window_size[0]
        if window_size[1] >= 0:
            visible &= j <= aligned + window_size[1]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)


@pytest.mark.parametrize("seed, kv_heads, group, block, window", [(0, 2, 2, 4, -1), (1, 1, 4, 4, 3), (2, 4, 1, 2, 5)])
def test_varlen_arguments_match_reference_through_an_emulated_kernel(seed, kv_heads, group, block, window):
    """The CPU twin of the CUDA test below: our metadata -> kernel arguments, with the kernel emulated."""
    cache, steps = ragged_steps(seed, kv_heads, group, block, max_model_len=64)
    backend = attention_cuda.VarlenAttention(kernel=emulated_varlen)
    for step in steps:
        got = backend(step.q, cache.key_caches[0], cache.value_caches[0], step.meta, 0.4, window, 0.0, None)
        real = step.meta.slot_mapping >= 0  # padding rows have NaN queries: their own rows are garbage
        assert torch.isfinite(got[real]).all()
        assert_close(got[real], run("reference", cache, step, window, 0.0, None)[real], atol=1e-5, rtol=1e-5)


def test_varlen_declares_what_it_cannot_do():
    varlen = attention.get_attention_backend("varlen")
    reason = varlen.unsupported(-1, 1.0, torch.zeros(2))
    assert reason == "attention backend 'varlen' does not support logit soft-capping or attention sinks"
    assert "float16 or bfloat16" in varlen.accepts(torch.zeros(1, 2, 8), torch.zeros(1, 256, 2, 8))
    cuda = torch.device("cuda")
    if attention_cuda._torch_kernel() is not None:  # this torch has the kernel: the cache's shape decides
        assert "multiple of 256, got 16" in attention_cuda.varlen_unavailable(cuda, 16, torch.bfloat16)
        assert "bfloat16 cache, got torch.float32" in attention_cuda.varlen_unavailable(cuda, 256, torch.float32)
        assert attention_cuda.varlen_unavailable(cuda, 512, torch.float16) is None
    else:
        assert "has no torch.nn.attention.varlen" in attention_cuda.varlen_unavailable(cuda, 256, torch.bfloat16)


@pytest.mark.cuda
def test_varlen_on_cuda_without_the_kernel_auto_picks_bounded_and_says_why(monkeypatch):
    """On a GPU whose torch lacks the kernel (2.11), auto serves with bounded; checked on every torch."""
    monkeypatch.setattr(attention_cuda, "_torch_kernel", lambda: None)
    reason = attention_cuda.varlen_unavailable(torch.device("cuda"), 256, torch.bfloat16)
    assert reason is not None and "torch.nn.attention.varlen" in reason, reason
    assert attention.select_attention_backends("auto", "cuda", 256, torch.bfloat16) == ("bounded",)


@pytest.mark.cuda
def test_varlen_on_cuda_matches_reference():
    """On a GPU: torch's kernel against the reference, where the installed torch has it (2.13)."""
    reason = attention_cuda.varlen_unavailable(torch.device("cuda"), 256, torch.bfloat16)
    if reason is not None:
        pytest.skip(f"varlen cannot run here: {reason}")
    assert attention.select_attention_backends("auto", "cuda", 256, torch.bfloat16) == ("varlen", "bounded")
    assert attention.select_attention_backends("auto", "cuda", 256, torch.float32) == ("bounded",)
    cache, steps = ragged_steps(0, 2, 4, 256, max_model_len=1024, dtype=torch.bfloat16, device="cuda")
    for window in (-1, 100):
        for step in steps:
            got = run("varlen", cache, step, window, 0.0, None)
            real = step.meta.slot_mapping >= 0
            expected = run("reference", cache, step, window, 0.0, None)[real]
            assert_close(got[real].float(), expected, atol=2e-2, rtol=2e-2)


def test_hf_engine_reports_and_forces_its_backend():
    pytest.importorskip("transformers")
    from piecewise_backend import hf

    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", cudagraph_mode="NONE")
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    outputs = {}
    for name in ("auto", "reference"):
        engine = hf.HFEngine(hf.tiny_random_model("llama"), config, max_num_reqs=2, max_model_len=64, block_size=4,
                             attention_backend=name)
        assert engine.attention_backend == engine.runner.attention_backend == ("bounded" if name == "auto" else name)
        outputs[name] = engine.generate(prompts, 3)
    assert outputs["auto"] == outputs["reference"]
    with pytest.raises(ValueError, match="attention backend 'varlen' cannot serve a torch.float32 cache on cpu"):
        hf.HFEngine(hf.tiny_random_model("llama"), config, max_model_len=64, attention_backend="varlen")


def alibi_reference(step: Step, cache: kv.PagedKVCache, slopes: torch.Tensor, window: int) -> torch.Tensor:
    """Each token over its request's keys, by hand, dense: score ``q.k * 0.4 + slope * (key_pos - pos)``."""
    meta, q = step.meta, step.q
    keys, values = cache.key_caches[0].flatten(0, 1), cache.value_caches[0].flatten(0, 1)
    out = torch.zeros_like(q)
    for t in range(q.shape[0]):
        if meta.slot_mapping[t] < 0:
            continue
        pos = int(meta.positions[t])
        table = meta.block_tables[meta.request_index[t]]
        visible = [p for p in range(pos + 1) if window <= 0 or p > pos - window]
        rows = torch.tensor([int(table[p // cache.block_size]) * cache.block_size + p % cache.block_size for p in visible])
        k = keys[rows].repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        v = values[rows].repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        bias = slopes[:, None] * (torch.tensor(visible, dtype=torch.float32) - pos)[None, :]
        weights = (torch.einsum("hd,lhd->hl", q[t], k) * 0.4 + bias).softmax(-1)
        out[t] = torch.einsum("hl,lhd->hd", weights, v)
    return out


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("name", ["reference", "bounded", "many"])
@pytest.mark.parametrize("kv_heads, group, window", [(2, 2, -1), (1, 4, -1), (2, 1, 5)])
def test_alibi_slopes_bias_each_head_by_distance(kv_heads, group, window, name, captured, monkeypatch):
    """ALiBi (bloom, mpt, falcon): ``slope * (key_pos - query_pos)`` joins each head's scores, against a dense
    reference; steep slopes, so a bias dropped, mis-signed or given to the wrong head changes the result."""
    monkeypatch.setitem(attention.backends._BACKENDS, "many", attention.AttentionBackend(
        "many", attention.BoundedAttention(eager_chunk_keys=2, graph_chunk_keys=2),
        pb.AttentionGraphSupport.ALWAYS, alibi=True))
    cache, steps = ragged_steps(6, kv_heads, group, 2, max_model_len=64)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(kv_heads * group)]).flip(0) * 4
    for step in steps:
        with pb.set_forward_context(pb.CUDAGraphMode.FULL if captured else pb.CUDAGraphMode.NONE):
            got = attention.run_attention((name,), step.q, cache.key_caches[0], cache.value_caches[0], step.meta, 0.4,
                                          window, 0.0, None, alibi_slopes=slopes)
        real = step.meta.slot_mapping >= 0
        assert torch.isfinite(got[real]).all()
        expected = alibi_reference(step, cache, slopes, window)
        assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(expected[real], alibi_reference(step, cache, slopes * 0, window)[real], atol=1e-2)


def test_a_backend_without_alibi_hands_alibi_layers_on(monkeypatch):
    """A backend that does not declare ``alibi`` (varlen: torch's kernel takes no slopes) never sees them;
    alone, it refuses the call naming ALiBi."""
    calls = []

    def plain(*args):
        calls.append(len(args))
        return attention.get_attention_backend("reference").fn(*args)

    monkeypatch.setitem(attention.backends._BACKENDS, "plain", attention.AttentionBackend(
        "plain", plain, pb.AttentionGraphSupport.ALWAYS))
    cache, steps = ragged_steps(0, 2, 2, 4, max_model_len=32)
    args = (steps[0].q, cache.key_caches[0], cache.value_caches[0], steps[0].meta, 0.4, -1, 0.0, None)
    slopes = torch.full((4,), 0.5)
    with pb.set_forward_context(pb.CUDAGraphMode.NONE):
        got = attention.run_attention(("plain", "bounded"), *args, alibi_slopes=slopes)
        assert calls == []
        real = steps[0].meta.slot_mapping >= 0
        assert_close(got[real], attention.run_attention(("reference",), *args, alibi_slopes=slopes)[real])
    with pytest.raises(ValueError, match="'plain' does not support ALiBi slopes"):
        attention.run_attention(("plain",), *args, alibi_slopes=slopes)
    assert "ALiBi" in attention.get_attention_backend("varlen").unsupported(-1, 0.0, None, 0, slopes)
