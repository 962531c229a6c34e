"""Tiny models, ops and configs shared by the tests."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch

import piecewise_backend as pb
from piecewise_backend.toy_llama import ToyConfig, ToyLlama, make_model  # noqa: F401

SIM = pb.CompilationConfig(platform="simulated", compile_pieces="eager")
#: The repository root (examples/, scripts/, benchmarks/ are not packages: :func:`load_file` loads them).
ROOT = Path(__file__).resolve().parents[3]


def load_file(relative: str) -> types.ModuleType:
    """The repository file ``relative`` (e.g. ``"examples/hf_generate.py"``) loaded as a fresh module, registered
    in ``sys.modules`` under its stem (a dataclass there looks its module up)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
CUDA = dict(platform="cuda", compile_pieces="inductor")


@torch.library.custom_op("pb_test::double_into", mutates_args=("out",))
def double_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2)


@torch.library.custom_op("pb_test::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pb_test::host_scale", mutates_args=())
def host_scale(x: torch.Tensor) -> torch.Tensor:
    """An op that reads device data on the host (``float(t)``), as an attention with host metadata does."""
    return x * float(x.abs().max())


@host_scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class HostReading(torch.nn.Module):
    """embedding -> ``pb_test::host_scale`` -> linear; ``outside=True`` reads the host outside the op too."""

    def __init__(self, outside: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lin, self.outside = torch.nn.Embedding(16, 4), torch.nn.Linear(4, 4), outside

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        if self.outside:
            h = h * h.sum().item()
        return self.lin(torch.ops.pb_test.host_scale(h))


def compile_model(model: torch.nn.Module, config: pb.CompilationConfig = SIM) -> tuple[torch.nn.Module, pb.PiecewiseBackend]:
    backend = pb.make_backend(config)
    return torch.compile(model, backend=backend), backend


def nudged(model: torch.nn.Module, scale: float, seed: int = 7) -> torch.nn.Module:
    """``model`` with noise of ``scale`` times each parameter's std added in place: as a drafter of the model it
    was, it agrees often, not always (drafts get rejected)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return model


def token_ids(n: int, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    torch._dynamo.mark_dynamic(ids, 0)
    return ids


def run(wrapper, mode: pb.CUDAGraphMode, desc: pb.BatchDescriptor | None, *args, **attrs):
    """Call ``wrapper(*args)`` under a forward context."""
    with pb.set_forward_context(mode, desc, **attrs):
        return wrapper(*args)


# --- capture-layer helpers (wrappers, capture, simulated and CUDA tests) ---

BREAK_CALLS: dict[str, int] = {"fresh": 0, "into": 0}


@pb.eager_break
def fresh_break(x: torch.Tensor) -> torch.Tensor:
    """A break point returning a new tensor that later segments read."""
    BREAK_CALLS["fresh"] += 1
    return x * 3 + 1


@pb.eager_break
def into_break(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A break point writing into a caller-provided buffer."""
    BREAK_CALLS["into"] += 1
    out.copy_(x * 3 + 1)
    return out


class CountingMLP(torch.nn.Module):
    """Counts Python-level forward calls (replays must not run them)."""

    def __init__(self, dim: int = 8, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.l1, self.l2 = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.l2(torch.relu(self.l1(x))) * 2


class TwoBreakModel(torch.nn.Module):
    """linear -> break -> linear -> break -> linear: segments G E G E G under a breakable capture."""

    def __init__(self, dim: int = 8, fresh: bool = True, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.l1, self.l2, self.l3 = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.fresh = fresh
        self.calls = 0

    def brk(self, h: torch.Tensor) -> torch.Tensor:
        if self.fresh:
            return fresh_break(h)
        out = torch.empty_like(h)
        into_break(h, out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.brk(self.l1(x))
        h = self.brk(torch.relu(self.l2(h)))
        return self.l3(h)


def segment_kinds(entry: pb.GraphEntry) -> str:
    """'G E G ...': graph segments and eager (break) segments of a captured entry."""
    from piecewise_backend.capture import EagerSegment

    return " ".join("E" if isinstance(s, EagerSegment) else "G" for s in entry.segments)


def dynamo_graphs(fn, *args, reset: bool = True) -> list[torch.fx.GraphModule]:
    """The Dynamo-level FX graphs of ``fn(*args)``, captured by a pass-through backend under no_grad.

    ``reset`` clears Dynamo's caches first, so the capture really traces (a cached entry for the
    same code object would skip the backend) and repeated captures do not hit recompile_limit.
    """
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    if reset:
        torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=capture)(*args)
    return graphs


class saved_splitting_ops:
    """Context manager: restore the splitting-op registry (contents and order) on exit."""

    def __enter__(self):
        self.saved = pb.registered_splitting_ops()
        return self

    def __exit__(self, *exc):
        for op in pb.registered_splitting_ops():
            pb.unregister_splitting_op(op)
        for op in self.saved:
            pb.register_splitting_op(op)
        assert pb.registered_splitting_ops() == self.saved
        return False


# --- assembly/runtime-layer helpers (dispatch, assembly, runner, property tests) ---


class torch_threads:
    """Context manager: run with ``n`` intra-op threads, restore the previous count on exit.

    The toy models are tiny: on a small shared machine OpenMP's thread hand-off costs far
    more than it saves (a 32-wide linear took milliseconds with 2 threads under load).
    """

    def __init__(self, n: int = 1):
        self.n = n

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)
        return False


class StepCounter(torch.nn.Module):
    """Increments a step buffer in place inside the captured region: 1 after the first call, 2 after the second."""

    def __init__(self):
        super().__init__()
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)
        return x * 2 + self.step


class FlakyBreakModel(torch.nn.Module):
    """linear -> break -> linear, where the break raises while ``self.fail`` is set."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.fail = True

        @pb.eager_break
        def flaky(h: torch.Tensor) -> torch.Tensor:
            if self.fail:
                raise ValueError("break failed")
            return h.sigmoid()

        self.flaky = flaky

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.flaky(self.l1(x)))


# --- simulator fidelity helpers (test_fidelity.py and its CUDA twins in test_cuda.py) ---

OP_CALLS: dict[str, int] = {"scale": 0}


@torch.library.custom_op("pb_test::scale_from_context", mutates_args=("out",))
def scale_from_context(x: torch.Tensor, out: torch.Tensor) -> None:
    """Attention-like: reads per-step metadata (``scale``, a tensor) from the forward context."""
    OP_CALLS["scale"] += 1
    out.copy_(x * pb.get_forward_context().scale)


@torch.library.custom_op("pb_test::sync_inside", mutates_args=())
def sync_inside(x: torch.Tensor) -> torch.Tensor:
    """A host sync hidden inside a custom op."""
    return x * int(x.sum().item())


@sync_inside.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class ContextScale(torch.nn.Module):
    """The issue-9 repro: ``x`` scaled by the context's ``scale`` tensor inside a custom op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.pb_test.scale_from_context(x, out)
        return out


@pb.eager_break
def scale_break(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops.pb_test.scale_from_context(x, out)
    return out


class ContextScaleBreak(torch.nn.Module):
    """Like :class:`ContextScale`, with the scaling op as a break point."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale_break(x + 1) * 2


@torch.library.custom_op("pb_test::raw_double", mutates_args=("out",))
def raw_double(x: torch.Tensor, out: torch.Tensor) -> None:
    """Stands for a C++ kernel writing through raw pointers: the write never reaches the dispatcher."""
    with torch._C._DisableTorchDispatch():
        out.copy_(x * 2)


def tiny_mlp(device: str = "cpu") -> torch.nn.Module:
    """Linear -> ReLU -> Linear (8 wide): Inductor fuses the ReLU into a C++ kernel on the CPU."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).to(device).eval()
# --- compile cache and AOT restart helpers (test_compile_cache, test_aot, test_shapes) ---

TINY_LLAMA = dict(hidden_size=16, num_heads=2, intermediate_size=32, vocab_size=64)


def tiny_llama(num_layers: int = 3) -> torch.nn.Module:
    """The smallest ToyLlama: pieces first / middle / last, so Inductor compiles 3 whatever the depth."""
    return make_model(num_layers, "inplace", **TINY_LLAMA)


def piece_fn(x: torch.Tensor) -> torch.Tensor:
    """One compiled piece (compile with splitting_ops=[]): the cheapest Inductor compile."""
    return (x * 2 + 1).relu()


def dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    """The (last) FX graph Dynamo hands a backend for ``fn(*args)``, without compiling it."""
    graphs: list[torch.fx.GraphModule] = []
    torch._dynamo.reset()
    torch.compile(fn, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward, fullgraph=True)(*args)
    return graphs[-1]


# --- grad mode inside a break (test_entry, and its CUDA twin in gpu/test_cuda) ---


@pb.eager_break
def attention_without_grad(h: torch.Tensor) -> torch.Tensor:
    torch._C._set_grad_enabled(False)  # what Dynamo's split puts into the splitting piece of a no_grad region
    return h * 2


class NoGradAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = attention_without_grad(self.l1(x))
        torch._C._set_grad_enabled(True)  # ... and the next compiled piece re-enables it: a replay skips this
        return self.l2(h)


# --- a toy LM on the library's paged KV cache (kv tests, the composition matrix) ---

PAGED_LM = dict(heads=4, kv_heads=2, head_dim=8, layers=2, vocab=64)


class PagedTinyLM(torch.nn.Module):
    """docs/engine.md's TinyLM: input_ids (tokens,) -> logits (tokens, vocab); attention is pb_kv::paged_attention."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, head_dim: int = 8, layers: int = 2, vocab: int = 64):
        super().__init__()
        from piecewise_backend import kv  # noqa: F401  (registers pb_kv::paged_attention)

        torch.manual_seed(0)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        width = heads * head_dim
        self.embed = torch.nn.Embedding(vocab, width)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, (heads + 2 * kv_heads) * head_dim) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        x, n = self.embed(input_ids), input_ids.shape[0]
        for layer, qkv in enumerate(self.qkv):
            q, k, v = qkv(x).split([h * d, kvh * d, kvh * d], dim=-1)
            out = torch.empty(n, h, d, device=x.device)
            torch.ops.pb_kv.paged_attention(q.reshape(n, h, d), k.reshape(n, kvh, d), v.reshape(n, kvh, d), out, layer,
                                            d**-0.5, -1)
            x = x + out.reshape(n, h * d)
        return self.head(x)


def paged_cache(model: PagedTinyLM, **kw) -> "pb.kv.PagedKVCache":
    """A PagedKVCache laid out for ``model`` (16 blocks of 4 tokens, 16 tokens per request unless given)."""
    from piecewise_backend import kv

    kw = dict(dict(num_blocks=16, block_size=4, max_model_len=16), **kw)
    return kv.PagedKVCache(len(model.qkv), model.kv_heads, model.head_dim, **kw)


_FAILED_GRAPHS: list[torch.cuda.CUDAGraph] = []


def end_failed_capture(graph: torch.cuda.CUDAGraph, pool: tuple[int, int], device: int = 0) -> bool:
    """After a capture a test made fail on purpose: what the CUDA platform's recovery does.

    torch 2.11's failed ``capture_end`` leaves the device allocator routing to ``pool`` on (2.12+ ends it):
    end it where it is on, or a later ``~MemPool`` asserts in a destructor and the process aborts. No
    binding ends the host allocator's routing, whose filter points at ``graph``: keep it alive for the
    process. Returns whether the device routing was still on. Works on the CPU double too."""
    _FAILED_GRAPHS.append(graph)
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError as e:
        if "not currently recording" not in str(e):
            raise
        return False
    return True


def serve_requests(model: torch.nn.Module, config: pb.CompilationConfig, capture: bool = True, **engine_kwargs):
    """Serve three requests that join and finish at different steps (a prompt longer than llama4's chunk of 8)
    with an HFEngine over ``model``; returns (prompts, outputs, steps, engine)."""
    from piecewise_backend import hf

    engine = hf.HFEngine(model, config, max_num_reqs=3, max_model_len=32, block_size=4, **engine_kwargs)
    if capture:
        engine.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 3)]
    steps: list = []
    outputs = engine.generate(prompts, [5, 7, 9], on_step=steps.append)
    return prompts, outputs, steps, engine


class NaNLogitsAt(torch.nn.Module):
    """``model`` (the serving protocol) with NaN logits in the row of the token at ``position`` only: the
    K/V stay finite, so a prompt chunk's row there (never sampled) harms nothing."""

    def __init__(self, model: torch.nn.Module, position: int):
        super().__init__()
        self.inner, self.position = model, position

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        logits = self.inner(input_ids, position_ids)
        return logits.masked_fill((position_ids == self.position)[:, None], float("nan"))


#: the image token of :func:`tiny_llava` and :func:`tiny_qwen2_vl` (inside their vocabularies)
LLAVA_IMAGE, QWEN_IMAGE = 100, 150


def tiny_llava(seed: int = 0) -> torch.nn.Module:
    """A random LLaVA: 2-layer Llama text model, 2-layer CLIP tower; a 32x32 image is 16 image tokens."""
    import transformers as T

    torch.manual_seed(seed)
    text = T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    vision = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8)
    config = T.LlavaConfig(text_config=text, vision_config=vision, image_token_index=LLAVA_IMAGE,
                           projector_hidden_act="gelu", vision_feature_layer=-1)
    return T.LlavaForConditionalGeneration(config).eval()


def tiny_qwen2_vl(seed: int = 0) -> torch.nn.Module:
    """A random Qwen2-VL (M-RoPE): an image of grid (1, h, w) is h*w patches of 96 features, h*w/4 image tokens."""
    import transformers as T

    torch.manual_seed(seed)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=160, max_position_embeddings=256, initializer_range=0.2,
                # a small theta: every section of the rotary dims turns (at 1e6 only the temporal one would)
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2], "rope_theta": 10.0})
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    config = T.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=QWEN_IMAGE, video_token_id=151,
                             vision_start_token_id=152, vision_end_token_id=153, bos_token_id=1, eos_token_id=2)
    return T.Qwen2VLForConditionalGeneration(config).eval()


def vlm_reference(model: torch.nn.Module, prompt: list[int], new: int, mm: dict | None) -> list[int]:
    """Greedy ``model.generate`` of ``prompt`` with its images ``mm`` (None: text only), no stop token."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    kwargs = dict(mm or {})
    if mm and "image_grid_thw" in mm:
        kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         eos_token_id=None, **kwargs)
    return out[0, len(prompt):].tolist()


def tiny_qwen2_5_vl(seed: int = 0) -> torch.nn.Module:
    """A random Qwen2.5-VL: as :func:`tiny_qwen2_vl`, its tower attending within windows of 2x2 merged patches
    in layer 0 and over whole images in layer 1."""
    import transformers as T

    torch.manual_seed(seed)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=160, max_position_embeddings=256, initializer_range=0.2,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2], "rope_theta": 10.0})
    vision = dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=16, fullatt_block_indexes=[1])
    config = T.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=QWEN_IMAGE, video_token_id=151,
                                vision_start_token_id=152, vision_end_token_id=153, bos_token_id=1, eos_token_id=2)
    return T.Qwen2_5_VLForConditionalGeneration(config).eval()
