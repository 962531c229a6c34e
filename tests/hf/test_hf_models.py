"""Real Hugging Face models (random tiny configs, nothing downloaded) through the backend and wrappers.

Llama, Qwen3 and GPT-2 with ``attn_implementation="sdpa"`` call
``F.scaled_dot_product_attention``, which is in the default splitting-op registry:
Dynamo's graph splits there (2N+1 pieces for N layers), eager pieces and Inductor
pieces match eager logits, and a simulated PIECEWISE capture replays them exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from pbtest.helpers import SIM, load_file, run, segment_kinds
from torch.testing import assert_close

import piecewise_backend as pb

transformers = pytest.importorskip("transformers")

LAYERS = 2
SEQ = 8
VOCAB = 128
EAGER_PIECES = pb.CompilationConfig(compile_pieces="eager")


def _config(family: str, layers: int = LAYERS):
    common = dict(vocab_size=VOCAB, use_cache=False, attn_implementation="sdpa", bos_token_id=0, eos_token_id=1)
    if family == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **common,
        )
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, **common,
        )
    assert family == "gpt2"
    return transformers.GPT2LMHeadModel, transformers.GPT2Config(
        n_embd=32, n_layer=layers, n_head=4, n_positions=64, **common
    )


class CausalLM(torch.nn.Module):
    """``input_ids (1, T) -> logits (1, T, vocab)``: the HF model without its ModelOutput."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def build(family: str, layers: int = LAYERS, seed: int = 0) -> CausalLM:
    cls, cfg = _config(family, layers)
    torch.manual_seed(seed)
    model = CausalLM(cls(cfg).eval())
    assert model.model.config._attn_implementation == "sdpa"
    return model


def ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(seed))


class Compiled:
    """One HF model compiled once (eager pieces) and shared by the tests of its family."""

    def __init__(self, family: str):
        self.family = family
        self.model = build(family)
        self.backend = pb.make_backend(EAGER_PIECES)
        self.compiled = torch.compile(self.model, backend=self.backend)
        self.first_ids = ids(1)
        counts = dict(graphs=1, pieces=2 * LAYERS + 1, splitting_pieces=LAYERS, compiled_pieces=LAYERS + 1)
        with torch.no_grad(), pb.expect(**counts):
            self.first_out = self.compiled(self.first_ids)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt2"])
def hf(request) -> Compiled:
    return Compiled(request.param)


def test_sdpa_is_a_default_splitting_op():
    assert any(op is F.scaled_dot_product_attention for op in pb.registered_splitting_ops())


def test_dynamo_graph_calls_sdpa_as_registered(hf):
    # The registry matches F.scaled_dot_product_attention by identity: the Dynamo graph of a
    # HF model must hold that very callable (not an ATen overload), once per layer.
    assert len(hf.backend.splits) == 1
    split = hf.backend.splits[0]
    assert len(split.found_ops) == 1 and split.found_ops[0] is F.scaled_dot_product_attention
    targets = [n.target for p in split.pieces for n in p.module.graph.nodes if n.op == "call_function"]
    assert sum(t is F.scaled_dot_product_attention for t in targets) == LAYERS


def test_splits_at_each_attention(hf):
    pieces = hf.backend.splits[0].pieces
    assert [p.index for p in pieces] == list(range(2 * LAYERS + 1))
    assert [p.is_splitting for p in pieces] == [i % 2 == 1 for i in range(2 * LAYERS + 1)]
    for p in pieces:
        calls = [n.target for n in p.module.graph.nodes if n.op == "call_function"]
        if p.is_splitting:
            assert calls == [F.scaled_dot_product_attention], p
        else:
            assert F.scaled_dot_product_attention not in calls, p


def test_eager_pieces_match_eager(hf):
    with torch.no_grad():
        assert_close(hf.first_out, hf.model(hf.first_ids))
        new = ids(2)
        with pb.expect(graphs=0):  # same shape: no recompile
            out = hf.compiled(new)
        expected = hf.model(new)
    assert_close(out, expected)
    assert out.shape == (1, SEQ, VOCAB)
    assert not torch.allclose(out, hf.first_out)  # different ids, different logits: the check has teeth


def test_simulated_piecewise_capture_and_replay(hf):
    wrapper = pb.BreakableCUDAGraphWrapper(hf.compiled, config=SIM)
    desc = pb.BatchDescriptor(SEQ)
    static = torch.zeros(1, SEQ, dtype=torch.long)
    with torch.no_grad():
        static.copy_(ids(3))
        with pb.expect(captures=1, replays=1, breaks=LAYERS, graphs=0):
            captured = run(wrapper, pb.CUDAGraphMode.PIECEWISE, desc, static).clone()
        assert_close(captured, hf.model(ids(3)))
        entry = wrapper.entries[desc]
        assert segment_kinds(entry) == " ".join(["G", "E"] * LAYERS + ["G"])
        assert len(entry.segments) == 2 * LAYERS + 1

        for seed in (4, 5):
            static.copy_(ids(seed))
            with pb.expect(captures=0, replays=1, breaks=0):
                replayed = run(wrapper, pb.CUDAGraphMode.PIECEWISE, desc, static).clone()
            assert_close(replayed, hf.model(ids(seed)))
        assert not torch.allclose(replayed, captured)
    assert list(wrapper.entries) == [desc]


def test_inductor_pieces_match_eager():
    """One model through Inductor (the slow path): 3 layers, so two middle pieces are identical."""
    layers = 3
    model = build("llama", layers=layers, seed=7)
    backend = pb.make_backend(pb.CompilationConfig(compile_pieces="inductor"))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        # pieces: pre-attn 0 | attn | post 0 + pre 1 | attn | post 1 + pre 2 | attn | post 2 + head
        counts = dict(graphs=1, pieces=2 * layers + 1, compiled_pieces=layers + 1, compiles=layers, compile_cache_hits=1)
        with pb.expect(**counts):
            out = compiled(ids(1))
        assert_close(out, model(ids(1)))
        assert_close(compiled(ids(2)), model(ids(2)))
    assert backend.splits[0].num_splitting == layers


class GraphBreakAttention(torch.nn.Module):
    """Two SDPA attention layers with a deliberate Dynamo graph break between them."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(2))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))
        self.head = torch.nn.Linear(dim, VOCAB)

    def attend(self, i: int, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv[i](x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj[i](y.transpose(1, 2).reshape(b, t, d))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.attend(0, self.embed(input_ids))
        torch._dynamo.graph_break()
        return self.head(torch.relu(self.attend(1, x)))


def test_graph_break_model_splits_and_captures_each_graph():
    model = GraphBreakAttention().eval()
    backend = pb.make_backend(EAGER_PIECES)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        with pb.expect(graphs=2, pieces=6, splitting_pieces=2, compiled_pieces=4):
            assert_close(compiled(ids(1)), model(ids(1)))
        assert len(backend.splits) == 2
        for split in backend.splits:
            assert [p.is_splitting for p in split.pieces] == [False, True, False]
            assert split.found_ops == [F.scaled_dot_product_attention]

        wrapper = pb.BreakableCUDAGraphWrapper(compiled, config=SIM)
        desc = pb.BatchDescriptor(SEQ)
        static = ids(2).clone()
        with pb.expect(captures=1, breaks=2, graphs=0):
            captured = run(wrapper, pb.CUDAGraphMode.PIECEWISE, desc, static).clone()
        assert_close(captured, model(ids(2)))
        # The graph break is not a segment boundary: graph 0's tail and graph 1's head
        # (and the Python between them) are recorded into one segment.
        assert segment_kinds(wrapper.entries[desc]) == "G E G E G"
        static.copy_(ids(3))
        with pb.expect(captures=0, replays=1, breaks=0):
            replayed = run(wrapper, pb.CUDAGraphMode.PIECEWISE, desc, static)
        assert_close(replayed, model(ids(3)))
        assert not torch.allclose(replayed, captured)


# --- the HF engine on a fixed sample of architectures ---------------------------------------------------------
# One of each kind the adapter must serve right: MoE (expert routing without host reads), MLA (V narrower
# than K: padded to one cache head dim), multi-query (one KV head, read from the modules), attention sinks,
# logit soft-capping (with sliding windows); examples/hf_generate.py --check's comparison.


def _example():
    return load_file("examples/hf_generate.py")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_bigcode", "gpt_oss", "gemma2", "dots1",
                                  "cohere_compass_text", "dbrx"])
def test_engine_serves_the_architecture_like_generate(arch):
    from piecewise_backend import hf

    model = hf.tiny_random_model(arch, sliding_window=4) if arch == "gemma2" else hf.tiny_random_model(arch)
    reference = copy.deepcopy(model)
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 8])
    engine = hf.HFEngine(model, config, max_num_reqs=2, max_model_len=24, block_size=4)
    engine.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 3, 9)]
    budgets = [5, 7, 3]  # request 2 joins while 0 and 1 decode; the window of 4 is exceeded
    steps: list[hf.StepInfo] = []
    with pb.expect(captures=0):
        outputs = engine.generate(prompts, budgets, on_step=steps.append)
    if arch == "dbrx":  # its experts read the host: break points, so no FULL graph (the mode resolves to PIECEWISE)
        assert engine.runner.mode == pb.CUDAGraphMode.PIECEWISE
        assert {s.mode for s in steps} == {pb.CUDAGraphMode.PIECEWISE}, steps
    else:
        assert {s.mode for s in steps} >= {pb.CUDAGraphMode.PIECEWISE, pb.CUDAGraphMode.FULL}, steps
    assert _example().check(reference, prompts, outputs, budgets, eos=None) == []


def test_engine_refuses_a_model_with_state_it_cannot_hold_up_front(monkeypatch):
    """A state layer computing its state inline, without a forward of ours (hf/state_swaps.py): MiniMax's lightning
    attention with its swap taken away."""
    from piecewise_backend import hf
    from piecewise_backend.hf import state_swaps

    monkeypatch.delitem(state_swaps.REGISTRY, "transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention")
    assert "MiniMaxLightningAttention" not in state_swaps.SWAPS  # the documented view by class name reads the registry
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2])
    with pytest.raises(ValueError, match=r"MiniMaxForCausalLM keeps recurrent or convolution state .* in its own code \(MiniMaxLightningAttention"):
        hf.HFEngine(hf.tiny_random_model("minimax"), config, max_model_len=24)


#: Types whose default config cannot be shrunk by TINY alone (tiny_random_model's per-type sizes), with what
#: each keeps of its family: the layer mix, experts, the sub-configs it is given whole.
BUILT_FROM_TYPE_SIZES = {
    "dbrx": lambda c: c.attn_config.clip_qkv == 8.0 and c.ffn_config.moe_num_experts == 4 and c.ffn_config.moe_top_k == 2,
    "dots1": lambda c: c.n_routed_experts == 4 and c.n_shared_experts == 1 and c.first_k_dense_replace == 1,
    "gpt_neo": lambda c: c.attention_layers == ["global", "local"] and c.window_size == 8,
    "prophetnet": lambda c: c.num_decoder_layers == 2 and c.num_decoder_attention_heads == 4,
    "reformer": lambda c: list(c.attn_layers) == ["local", "lsh"] and c.is_decoder,
    "xlnet": lambda c: c.n_layer == 2 and c.d_head * c.n_head == c.d_model == 64,
    "blt": lambda c: c.global_config.hidden_size == c.encoder_config.hidden_size * c.cross_attn_k,
    "cohere_compass_text": lambda c: set(c.rope_parameters) == {"full_attention", "sliding_attention"},
    # built from the decoder sub-config, the one its causal LM class takes: a row of tokens per audio codebook
    "musicgen": lambda c: c.model_type == "musicgen_decoder" and c.num_codebooks == 4,
    "musicgen_melody": lambda c: c.model_type == "musicgen_melody_decoder" and c.num_codebooks == 4,
}


@pytest.mark.parametrize("arch", sorted(BUILT_FROM_TYPE_SIZES))
def test_tiny_random_model_builds_types_its_generic_sizes_cannot(arch):
    from piecewise_backend import hf
    from piecewise_backend.testing import hf_models

    table = copy.deepcopy(hf_models.TINY_TYPE_SIZES[arch])
    model = hf.tiny_random_model(arch)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert BUILT_FROM_TYPE_SIZES[arch](model.config), model.config
    rows = getattr(model.config, "num_codebooks", 1)
    with torch.no_grad():
        logits = model(input_ids=torch.arange(3, 11).repeat(rows, 1), use_cache=False).logits
    assert logits.shape == (rows, 8, model.config.get_text_config().vocab_size) and bool(logits.isfinite().all())
    assert hf_models.TINY_TYPE_SIZES[arch] == table  # the config was given a copy (configs rewrite their dicts)

