"""What :func:`piecewise_backend.hf.adapt` checks before serving a HF model, and the probe forward.

A model is served only if the paged attention computes what its own attention computes and its
forward can be replayed by a CUDA graph. :func:`refusal` names the first reason it cannot be
(from the config and the modules); :func:`probe` runs one tiny eager forward with a recording
attention to read every attention layer's head layout from the modules themselves and to find
device-to-host reads (``nonzero``, ``.item()``, boolean-mask indexing) that no graph can replay.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

from ..platforms.simulated import rules as sim_rules
from ..platforms.simulated.platform import OpKind, classify
from . import attention_swaps, indexed, mixers
from .call_sites import CallSites
from .modality import can_set_attention, text_attention
from .patching import Changes, RefusesNothing, Undo
from .probe_result import LayerLayout, ProbeResult, layout_refusal  # noqa: F401  (documented here: hf.layout_refusal)
from .self_assignments import recording_self_assignments, self_assigned
from .transformers_lib import transformers_module

PROBE_IMPLEMENTATION = "pb_probe"
#: ``layer_types`` / ``layers_block_type`` entries served (others are refused): attention by the paged
#: attention (``chunked_attention`` with its chunk mask), ``linear_attention`` and ``conv`` by the state
#: ops where the layer's module calls kernels :mod:`.mixers` routes (its own check refuses the rest).
SERVED_LAYER_TYPES = frozenset({
    "full_attention", "sliding_attention", "attention", "mlp", "moe", "chunked_attention", "linear_attention", "conv",
    "hybrid",  # falcon_h1: a Mamba2 mixer and attention side by side in one layer
    "mamba",  # jamba's layers_block_type
})
#: Why a layer type no mechanism here serves is refused, where more than its name says it.
UNSERVED_LAYER_TYPES = {
    "hybrid_sliding": (
        "inkling's attention layers (hybrid_sliding, and its hybrid ones alike) add a learned relative-position "
        "bias to every score (position_bias, from each query's r_proj over its distance to each key), convolve K and V "
        "over the preceding tokens (state kept between tokens) and scale the full layers' queries by the row index: "
        "the paged attention takes no per-score bias and no K/V convolution state"
    ),
}
# Layer classes that keep a recurrent or convolution state from one token to the next.
_STATEFUL = re.compile(r"Mamba|ShortConv|GatedDeltaNet|LinearAttention|Lightning|Recurrent|Rwkv|SSM|Mixer\b")


#: Attention-interface keyword arguments the paged attention honours or that do not change its result.
UNDERSTOOD_KWARGS = frozenset({
    "attention_mask", "dropout", "scaling", "sliding_window", "softcap", "s_aux", "is_causal", "position_ids",
    "cache_position", "output_attentions", "use_cache", "past_key_values", "cache", "layer_idx", "position_embeddings",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "head_mask", "return_dict", "token_type_ids",
    "indices",  # an indexer's top-k positions (indexed attention): pb_paged attends to those only
    "logits_to_keep",  # which rows the LM head computes (llava_onevision passes its kwargs down): not attention's
})


def _mask_difference(mask: Any, tokens: int, window: int | None) -> str | None:
    """None if ``mask`` (a mask the model built itself, or None) is the causal (sliding) one; else what differs."""
    if not isinstance(mask, torch.Tensor):
        return None
    visible = mask if mask.dtype == torch.bool else mask == 0
    visible = visible.reshape(-1, *visible.shape[-2:])[..., -tokens:, -tokens:]
    pos = torch.arange(tokens, device=mask.device)
    causal = pos[None, :] <= pos[:, None]
    if window:
        causal &= pos[None, :] > pos[:, None] - window
    if bool((visible == causal).all()):  # a CPU bool read of the probe's own tensors, outside any capture
        return None
    return "not the causal mask (bidirectional or custom masking)"


@dataclasses.dataclass
class _Recording:
    """What one probe forward's attention calls and host reads leave, while it runs (a :class:`ProbeResult` after)."""

    layers: dict[int, LayerLayout] = dataclasses.field(default_factory=dict)
    host_reads: list[str] = dataclasses.field(default_factory=list)
    host_read_modules: list[str] = dataclasses.field(default_factory=list)
    masks: dict[int, tuple[torch.Tensor, int, int | None]] = dataclasses.field(default_factory=dict)  # by call site
    qk: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)  # by call site
    sites: list[LayerLayout] = dataclasses.field(default_factory=list)
    calls: dict[int, int] = dataclasses.field(default_factory=dict)  # by layer: how often its module called
    unindexed: list[torch.nn.Module] = dataclasses.field(default_factory=list)


#: The recording of the probe forward in progress (None outside one): read by :func:`probe_attention_forward`.
_RECORDING: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("pb_probe_recording", default=None)


def probe_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry of the probe: records the layer's layout, returns zeros of the output's shape."""
    record = _RECORDING.get()
    if record is None:
        raise RuntimeError(f"the {PROBE_IMPLEMENTATION} attention records the adapter's probe only; no probe is running")
    layer = getattr(module, "layer_idx", None)
    site = len(record.sites)
    record.qk[site] = (query.detach().clone(), key.detach().clone())
    extra = tuple(sorted(k for k, v in kwargs.items() if v is not None and v is not False and k not in UNDERSTOOD_KWARGS))
    mask = args[0] if args else kwargs.get("attention_mask")
    causal = getattr(module, "is_causal", True) is not False and kwargs.get("is_causal", True) is not False
    layout = LayerLayout(
        module, query.shape[1], key.shape[1], key.shape[-1], value.shape[-1], causal=causal, extra=extra, layer=layer
    )
    record.sites.append(layout)
    if isinstance(mask, torch.Tensor):  # compared after the forward: reading it here would count as a host read
        record.masks[site] = (mask.detach().clone(), query.shape[2], kwargs.get("sliding_window"))
    if not isinstance(layer, int) or layer < 0:
        record.unindexed.append(module)
    elif layer in record.layers:
        record.calls[layer] += 1
    else:
        record.layers[layer] = layout
        record.calls[layer] = 1
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


@contextlib.contextmanager
def _as_compiled() -> Iterator[None]:
    """Within: transformers' modules see ``is_torchdynamo_compiling()`` true, as they will under Dynamo (the
    name each loaded ``transformers`` module holds, swapped back after); torch itself is left alone."""
    from transformers.utils import import_utils

    original = import_utils.is_torchdynamo_compiling
    holders = [m for name, m in list(sys.modules.items())
               if (name == "transformers" or name.startswith("transformers.")) and m is not None
               and getattr(m, "__dict__", {}).get("is_torchdynamo_compiling") is original]
    try:
        for m in holders:
            m.__dict__["is_torchdynamo_compiling"] = _compiling
        yield
    finally:
        for m in holders:
            m.__dict__["is_torchdynamo_compiling"] = original


def _compiling() -> bool:
    return True


class _HostReads(TorchDispatchMode):
    """Notes each op that makes the host wait for device data, with the module it ran in."""

    def __init__(self, tracker: ModuleTracker, result: _Recording):
        super().__init__()
        self.tracker, self.result = tracker, result

    def _note(self, what: str) -> None:
        where = max(self.tracker.parents, key=len, default="the model")
        self.result.host_reads.append(f"{what} in {where}")
        self.result.host_read_modules.append(where)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if classify(func, args, kwargs or {}) is OpKind.HOST_SYNC:
            self._note(func._schema.name)
        return func(*args, **(kwargs or {}))

    def on_host_read(self, t: torch.Tensor, method: str, what: str) -> None:
        """``.tolist()``, ``.numpy()``, printing: reads no op dispatches (rules.py's guards report them,
        inside custom ops too, where this mode is popped)."""
        self._note(method)


def probe(model: torch.nn.Module, tokens: int = 3) -> ProbeResult:
    """Eager forwards of ``tokens`` tokens (one request; then one token repeated at one position) with
    the recording attention; restores the model's attention."""
    transformers = transformers_module()
    transformers.AttentionInterface.register(PROBE_IMPLEMENTATION, probe_attention_forward)
    previous = model.config._attn_implementation
    record = _Recording()
    same = _Recording(host_reads=record.host_reads, host_read_modules=record.host_read_modules)
    param = next(model.parameters())
    vocab = model.config.get_text_config().vocab_size
    ids = torch.arange(1, tokens + 1, device=param.device).clamp(max=vocab - 1)[None]
    settable = can_set_attention(model)  # else its attention modules are swapped (attention_swaps)
    if settable:
        model.set_attn_implementation(text_attention(model, PROBE_IMPLEMENTATION))
    recording = _RECORDING.set(record)
    # ModuleTracker's hooks assert on a view of a grad-requiring parameter taken under no_grad (dbrx's
    # experts slice their weights in the forward): the probe runs with the parameters' grads off.
    grads = [p for p in model.parameters() if p.requires_grad]
    for p in grads:
        p.requires_grad_(False)
    try:
        # HF takes other branches under torch.compile (eager-only input checks skipped, MoE fallbacks):
        # the probe follows the ones Dynamo will trace.
        with _as_compiled(), torch.no_grad(), ModuleTracker() as tracker, _HostReads(tracker, record) as reads, \
                sim_rules.watching_host_reads(reads), mixers.recording(model) as states, \
                recording_self_assignments() as assigned, attention_swaps.using(model, PROBE_IMPLEMENTATION):
            positions = torch.arange(tokens, device=param.device)[None]
            model(input_ids=ids, position_ids=positions, use_cache=False)
            # One token repeated at one position: every row's q/k must be equal (attention gives zeros here),
            # unless the model takes positions from the row index instead of position_ids. State layers
            # run each row as its own request here, as the engine would.
            _RECORDING.set(same)
            states.rows_independent = True
            model(input_ids=ids[:, :1].expand(1, tokens), position_ids=torch.zeros_like(positions), use_cache=False)
    finally:
        for p in grads:
            p.requires_grad_(True)
        _RECORDING.reset(recording)
        if settable:
            model.set_attn_implementation(previous)
    return _result(model, tokens, settable, record, same, states.layers, self_assigned(assigned))


def _result(model: torch.nn.Module, tokens: int, settable: bool, record: _Recording, same: _Recording,
            state_layers: dict[int, mixers.StateLayer], assigned: list[tuple[torch.nn.Module, str]]) -> ProbeResult:
    """The frozen :class:`ProbeResult` of a probe's two recordings."""
    # masks compared after the forward: each call's mask, against the causal (sliding) one; a layer's
    # layout is its first call's, with the count of its calls
    index = {id(l): i for i, l in enumerate(record.sites)}
    counts = {index[id(l)]: record.calls[layer] for layer, l in record.layers.items()}
    sites = [dataclasses.replace(l, mask=_mask_difference(*record.masks[i]) if i in record.masks else None,
                                 calls=counts.get(i, 1)) for i, l in enumerate(record.sites)]
    if settable and any(not l.causal for l in sites) and causal_in_effect(model, tokens + 1):
        # causal through the mask the model builds (bigbird_pegasus's decoder)
        sites = [dataclasses.replace(l, causal=True) for l in sites]
    layers = {layer: sites[index[id(l)]] for layer, l in record.layers.items()}
    call_sites = bool(sites) and CallSites.needed([(l.module, l.layer) for l in sites])
    if call_sites:  # keyed by call site where the modules do not name one K/V history each
        layers = dict(enumerate(sites))
    # Close, not equal: a kernel may round one row differently from another.
    ignores_positions = any(
        not all(torch.allclose(t.float(), t[:, :, :1].expand_as(t).float(), rtol=1e-4, atol=1e-5) for t in qk)
        for qk in same.qk.values()
    )
    return ProbeResult(
        layers, tuple(record.host_reads), tuple(record.host_read_modules), tuple(sites), call_sites=call_sites,
        ignores_positions=ignores_positions, unindexed=tuple(record.unindexed), self_assigned=tuple(assigned),
        state_layers={i: l for i, l in state_layers.items() if l.calls},
    )


def causal_in_effect(model: torch.nn.Module, tokens: int) -> bool:
    """Whether ``model``'s own forward (its own attention implementation) keeps every prefix's logits when a
    later token changes: attention modules that say ``is_causal=False`` may still be causal through the
    mask the model builds for them (bigbird_pegasus's decoder self-attention), which the probe's
    attention never sees. False where a plain token-id forward fails."""
    param = next(model.parameters())
    vocab = model.config.get_text_config().vocab_size
    ids = torch.arange(3, 3 + tokens, device=param.device).clamp(max=vocab - 1)[None]
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    positions = torch.arange(tokens, device=param.device)[None]
    try:
        with torch.no_grad():
            a, b = (model(input_ids=i, position_ids=positions, use_cache=False).logits[0, :-1].float() for i in (ids, changed))
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError, NotImplementedError):
        return False
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def transformers_pretrained() -> type:
    return transformers_module().PreTrainedModel


def refusal(model: torch.nn.Module) -> str | None:
    """Why the paged attention would serve ``model`` wrongly (from its config and modules), or None."""
    name = type(model).__name__
    text = model.config.get_text_config()
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk and "chunked_attention" not in (getattr(text, "layer_types", None) or ()):
        return (
            f"{name} sets attention_chunk_size={chunk} without layer_types naming its chunked_attention layers; "
            "the paged attention cannot tell which layers are chunked"
        )
    if getattr(text, "recurrent_kv_cache_mode", None) == "last_loop":
        return (
            f"{name} sets recurrent_kv_cache_mode='last_loop': its earlier recurrent loops attend over the last loop's "
            "cached K/V instead of their own, which the paged cache (one K/V per attention call site) does not hold"
        )
    for field in ("layer_types", "layers_block_type"):
        kinds = getattr(text, field, None)
        other = sorted({str(k) for k in kinds or ()} - SERVED_LAYER_TYPES)
        why = indexed.layer_types_refusal(model, other)  # indexed (sparse) attention is served, compressed not
        if why:
            return why
        known = next((k for k in other if k in UNSERVED_LAYER_TYPES), None)
        if known is not None:
            return f"{name} has layers of type {[known]} ({field}): {UNSERVED_LAYER_TYPES[known]}"
        if other:
            return (
                f"{name} has layers of type {other} ({field}); the paged attention serves "
                f"{sorted(SERVED_LAYER_TYPES)} layers only, and indexed_attention where its indexer is a known one (no other recurrent, convolution or sparse attention state)"
            )
    for path, m in model.named_modules():
        kind = type(m).__name__
        # A layer's own module (it has a layer_idx: it would keep a per-layer cache) named like a state layer or
        # holding a convolution, or a module named like one that holds a convolution (recurrent_gemma's block);
        # an audio or vision encoder's convolutions keep nothing between tokens.
        if isinstance(m, transformers_pretrained()):  # the model and its base model carry the family's name
            continue
        conv = any(isinstance(c, torch.nn.Conv1d) for c in m.children())
        stateful = (hasattr(m, "layer_idx") or conv) and (_STATEFUL.search(kind) or conv and hasattr(m, "layer_idx"))
        # an attention module named like a state layer (KimiLinearAttention, RecurrentGemmaAttention): the paged attention's
        if stateful and not conv and "ALL_ATTENTION_FUNCTIONS" in _names_read(m):
            continue
        if stateful and any(mixers.swapped(d) is not None for d in m.modules()):  # a forward of ours (hf/state_swaps.py)
            continue
        if stateful:
            called = set().union(*(mixers.kernels_called(d) for d in m.modules()))  # a block's mixer calls them
            unserved = sorted(called & mixers.KNOWN_UNSERVED.keys())
            if unserved:
                family = mixers.KNOWN_UNSERVED[unserved[0]]
                return (
                    f"{name} keeps {family} state ({kind} at {path} calls {unserved}); the state cache does not "
                    "serve that family yet"
                )
            if not called:
                return (
                    f"{name} keeps recurrent or convolution state between tokens in its own code ({kind} at {path}, "
                    f"through none of the kernels {sorted(mixers.SERVED_KERNELS)}); neither the paged cache nor the "
                    "state cache can hold it"
                )
    return None


def _names_read(module: torch.nn.Module) -> tuple[str, ...]:
    """The global names ``module``'s forward reads (none for a forward without code)."""
    code = getattr(mixers.raw_forward(module), "__code__", None)
    return code.co_names if code is not None else ()


def length_refusal(model: torch.nn.Module, max_row: int) -> str | None:
    """Why ``model`` would be served wrongly on rows of up to ``max_row`` tokens (or positions), or None.

    llama4's temperature tuning scales the queries of its no-RoPE layers by ``log1p(floor((p + 1) /
    floor_scale))`` with ``p`` the token's row index when there is no HF cache: the tokens-first row
    is not the position, but every scale is 1 (both agree) while rows and positions stay below
    ``floor_scale - 1``.
    """
    text = model.config.get_text_config()
    floor = getattr(text, "floor_scale", None)
    if getattr(text, "attn_temperature_tuning", False) and isinstance(floor, (int, float)) and max_row > floor - 1:
        return (
            f"{type(model).__name__} tunes attention temperature from row indices (floor_scale={floor}); exact only for "
            f"rows and positions below {int(floor) - 1}, but this engine allows {max_row}: use max_model_len and "
            f"capture sizes <= {int(floor) - 1}"
        )
    return None


def graph_safe_experts(model: torch.nn.Module) -> str | None:
    """Switch mixture-of-experts layers to an implementation without host syncs; returns it (None: no experts).

    HF's default ``grouped_mm`` falls back (off CUDA, or without bf16) to a loop over ``offsets.tolist()``
    and ``eager`` loops over ``nonzero()``: a graph would replay the routing seen at capture.
    ``batched_mm`` gathers each token's experts with static shapes; native ``grouped_mm`` (CUDA, bf16,
    sm80+) is kept, as it is sync-free and does not gather weights per token.
    """
    if not model._can_set_experts_implementation():
        return None
    param = next(model.parameters())
    native = (
        param.device.type == "cuda" and param.dtype == torch.bfloat16
        and hasattr(torch.nn.functional, "grouped_mm") and torch.cuda.get_device_capability(param.device) >= (8, 0)
    )
    chosen = "grouped_mm" if native else "batched_mm"
    model.set_experts_implementation(chosen)
    return chosen


class GraphSafeExperts(RefusesNothing):
    """The mechanism that switches mixture-of-experts layers to a sync-free implementation (:func:`graph_safe_experts`)."""

    name = "graph-safe experts"

    def install(self, model: torch.nn.Module, probed: ProbeResult | None) -> Undo:
        changes = Changes()
        if model._can_set_experts_implementation():
            previous = model.config._experts_implementation
            graph_safe_experts(model)
            changes.then(lambda: model.set_experts_implementation(previous))
        return changes.undo


EXPERTS = GraphSafeExperts()


class ServedLayers:
    """The model's own refusals (:func:`refusal`: its layer types and state-keeping modules are ones some
    mechanism serves); it changes nothing."""

    name = "served layers"

    def refusal_of(self, model: torch.nn.Module, probed: ProbeResult | None) -> str | None:
        return refusal(model)

    def install(self, model: torch.nn.Module, probed: ProbeResult | None) -> Undo:
        return Changes().undo


SERVED_LAYERS = ServedLayers()
