"""Route the state layers of HF models (short convolutions, gated and Kimi delta nets, Mamba2, Mamba1, and the
layers :mod:`.state_swaps` gives forwards of ours: lightning attention, RG-LRU, ZAYA's CCA) onto the ``pb_state`` ops.

transformers' state-layer modules call module-level kernels for everything that keeps state
(``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``, ...: the functions its hub kernels would
replace). Served with ``use_cache=False``, a forward calls the whole-sequence forms only, on the
tokens-first row where several requests sit side by side; left alone, their convolution and
recurrence would run across request boundaries and forget every state between steps.

* :func:`recording` runs a probe with each such kernel call recorded (which layer calls which
  kernel on which shapes: the :class:`~piecewise_backend.state.StateSpec` it needs) and, for the
  probe's row-independence forward, runs every row as its own request;
* :func:`route` gives each state layer a forward whose kernel calls are the ``pb_state`` ops on
  that layer's states: the module's own forward code, its globals bound to those ops.

What a module calls decides (:func:`kernels_called`): the names its forward's code reads from its
module globals. :data:`SERVED_KERNELS` are routed; :data:`KNOWN_UNSERVED` are named in refusals. A
module whose class :data:`~.state_swaps.SWAPS` names (:func:`swapped`) gets that forward instead, its state
calls recorded and routed the same way.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ..state import conv as _conv  # noqa: F401  (registers pb_state::causal_conv1d)
from ..state import delta as _delta  # noqa: F401  (registers pb_state::gated_delta_rule)
from ..state import kda as _kda  # noqa: F401  (registers pb_state::kda_rule)
from ..state import selective as _selective  # noqa: F401  (registers pb_state::selective_scan)
from ..state import ssd as _ssd  # noqa: F401  (registers pb_state::ssd_scan)
from ..state.cache import StateSpec
from ..state.conv import ACTIVATIONS
from .patching import Changes, RefusesNothing, Swap, lookup
from .state_swaps import KINDS, REGISTRY, SWAPS, Kernels  # noqa: F401  (SWAPS: documented here too)

if TYPE_CHECKING:
    from .probe_result import ProbeResult

#: Kernel name -> the state it keeps ("conv", "recurrent", "ssm"). The ``*_update`` / recurrent forms
#: run only with a cache, which a served forward never has, and the fused Mamba2 kernel only in
#: training; they are routed too (to an error, or to "no fused kernel"), so none can run unseen.
SERVED_KERNELS = {
    "causal_conv1d_fn": "conv",
    "causal_conv1d_update": "conv",
    "torch_chunk_gated_delta_rule": "recurrent",
    "torch_recurrent_gated_delta_rule": "recurrent",
    "chunk_kimi_delta_attention": "recurrent",
    "recurrent_kimi_delta_attention": "recurrent",
    "mamba2_chunk_scan": "ssm",
    "mamba2_selective_state_update": "ssm",
    "mamba2_split_conv1d_scan_combined": "ssm",
    "mamba_selective_scan": "ssm",
    "mamba_selective_state_update": "ssm",
    "mamba_inner_fn": "ssm",
}
#: Stateful kernels of families not served, and the family a refusal names (none known in transformers 5.24).
KNOWN_UNSERVED: dict[str, str] = {}


def raw_forward(module: torch.nn.Module) -> Callable[..., Any]:
    """The class's ``forward`` below its decorators (``functools.wraps`` chains)."""
    return inspect.unwrap(type(module).forward)


def swapped(module: torch.nn.Module) -> Swap | None:
    """The forward of ours :data:`~.state_swaps.SWAPS` gives ``module``'s class, or None."""
    return lookup(REGISTRY, module)


def kernels_called(module: torch.nn.Module) -> set[str]:
    """The served and known unserved kernel names ``module``'s forward reads from its globals."""
    fn = raw_forward(module)
    code = getattr(fn, "__code__", None)
    if code is None:
        return set()
    return {n for n in code.co_names if n in SERVED_KERNELS or n in KNOWN_UNSERVED}


@dataclasses.dataclass
class StateLayer:
    """One module that calls served kernels: its layer and, per kernel kind, the calls the probe saw."""

    module: torch.nn.Module
    layer: int
    calls: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)

    def specs(self) -> list[StateSpec]:
        """The states this layer needs, one per kind it keeps."""
        out = []
        for kind, seen in sorted(self.calls.items()):
            out.append(StateSpec(self.layer, kind, seen[0]["shape"], seen[0]["dtype"]))
        return out

    def refusal(self, name: str) -> str | None:
        """Why the ops cannot serve this layer as the probe saw it, or None."""
        path = type(self.module).__name__
        for kind, seen in self.calls.items():
            if len(seen) > 2:  # the probe runs two forwards: one call each
                return f"{name}: {path} (layer {self.layer}) calls its {kind} kernel more than once per forward"
            bad = next((c["why"] for c in seen if c.get("why")), None)
            if bad:
                return f"{name}: {path} (layer {self.layer}) {bad}"
        return None


def _conv_record(x: torch.Tensor, weight: torch.Tensor, activation: Any) -> dict[str, Any]:
    why = None
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        why = f"calls causal_conv1d_fn on x {tuple(x.shape)} with weight {tuple(weight.shape)}, not (batch, channels, tokens) with (channels, K)"
    elif (activation or "") not in ACTIVATIONS:
        why = f"uses convolution activation {activation!r}; pb_state::causal_conv1d applies {sorted(ACTIVATIONS)}"
    shape = (x.shape[1], weight.shape[-1] - 1) if why is None else ()
    return {"shape": shape, "dtype": x.dtype, "why": why}


def _delta_record(key: torch.Tensor, value: torch.Tensor, initial_state: Any, g: torch.Tensor | None = None) -> dict[str, Any]:
    why = None
    if g is not None and g.shape != key.shape:
        why = f"calls the Kimi delta rule with key {tuple(key.shape)} and g {tuple(g.shape)}, not one decay per key channel"
    elif key.dim() != 4 or value.dim() != 4 or value.shape[2] % key.shape[2]:
        why = f"calls the gated delta rule with key {tuple(key.shape)} and value {tuple(value.shape)}, not grouped (batch, tokens, heads, dim)"
    elif initial_state is not None:
        why = "passes its own initial state to the gated delta rule"
    shape = (value.shape[2], key.shape[3], value.shape[3]) if why is None else ()
    return {"shape": shape, "dtype": torch.float32, "why": why}


def _ssm_record(x: torch.Tensor, B: torch.Tensor, initial_states: Any, kw: dict[str, Any]) -> dict[str, Any]:
    why = None
    if x.dim() != 4 or B.dim() != 4 or x.shape[2] % B.shape[2]:
        why = f"calls mamba2_chunk_scan with x {tuple(x.shape)} and B {tuple(B.shape)}, not grouped (batch, tokens, heads, dim)"
    elif initial_states is not None:
        why = "passes its own initial state to mamba2_chunk_scan"
    elif kw.get("z") is not None or kw.get("seq_idx") is not None:
        why = "passes z or seq_idx to mamba2_chunk_scan, which pb_state::ssd_scan does not apply"
    shape = (x.shape[2], x.shape[3], B.shape[3]) if why is None else ()
    return {"shape": shape, "dtype": torch.float32, "why": why}


def _selective_record(u: torch.Tensor, A: torch.Tensor, B: torch.Tensor, kw: dict[str, Any]) -> dict[str, Any]:
    why = None
    if u.dim() != 3 or A.dim() != 2 or B.dim() != 3 or A.shape != (u.shape[1], B.shape[1]):
        why = f"calls mamba_selective_scan with u {tuple(u.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)}, not (batch, channels, tokens)"
    elif kw.get("return_last_state"):
        why = "asks mamba_selective_scan for its last state without a cache"
    shape = tuple(A.shape) if why is None else ()
    return {"shape": shape, "dtype": torch.float32, "why": why}


class _Recorder:
    """The probe's view of every state layer: calls the original kernels, noting each call."""

    def __init__(self) -> None:
        self.layers: dict[int, StateLayer] = {}
        self.rows_independent = False  # the probe's second forward: every row its own request

    def kernels(self, layer: StateLayer, original: dict[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
        rec = self

        def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: Any = None, **kw: Any) -> Any:
            layer.calls.setdefault("conv", []).append(_conv_record(x, weight, activation))
            fn = original["causal_conv1d_fn"]
            if rec.rows_independent and x.dim() == 3:  # (1, C, T) -> T requests of one token
                return fn(x.permute(2, 1, 0), weight, bias, activation=activation, **kw).permute(2, 1, 0)
            return fn(x, weight, bias, activation=activation, **kw)

        def delta(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  *args: Any, initial_state: Any = None, **kw: Any) -> Any:
            layer.calls.setdefault("recurrent", []).append(_delta_record(key, value, initial_state))
            fn = original["torch_chunk_gated_delta_rule"]
            if rec.rows_independent and query.dim() == 4:
                out, state = fn(*(t.transpose(0, 1) for t in (query, key, value, g, beta)), *args,
                                initial_state=initial_state, **kw)
                return out.transpose(0, 1), state
            return fn(query, key, value, g, beta, *args, initial_state=initial_state, **kw)

        def kda(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                *args: Any, initial_state: Any = None, **kw: Any) -> Any:
            layer.calls.setdefault("recurrent", []).append(_delta_record(key, value, initial_state, g))
            fn = original["chunk_kimi_delta_attention"]
            if rec.rows_independent and query.dim() == 4:
                out, state = fn(*(t.transpose(0, 1) for t in (query, key, value, g, beta)), *args,
                                initial_state=initial_state, **kw)
                return out.transpose(0, 1), state
            return fn(query, key, value, g, beta, *args, initial_state=initial_state, **kw)

        def ssm(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *args: Any,
                initial_states: Any = None, **kw: Any) -> Any:
            layer.calls.setdefault("ssm", []).append(_ssm_record(x, B, initial_states, kw))
            fn = original["mamba2_chunk_scan"]
            if rec.rows_independent and x.dim() == 4:
                out = fn(x.transpose(0, 1), dt.transpose(0, 1), A, B.transpose(0, 1), C.transpose(0, 1), *args,
                         initial_states=initial_states, **kw)
                return out.transpose(0, 1) if isinstance(out, torch.Tensor) else (out[0].transpose(0, 1), out[1])
            return fn(x, dt, A, B, C, *args, initial_states=initial_states, **kw)

        def selective(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *args: Any,
                      **kw: Any) -> Any:
            layer.calls.setdefault("ssm", []).append(_selective_record(u, A, B, kw))
            fn = original["mamba_selective_scan"]
            if rec.rows_independent and u.dim() == 3:  # (1, channels, T) -> T requests of one token
                row = lambda t: None if t is None else t.permute(2, 1, 0)  # noqa: E731
                kw = dict(kw, z=row(kw.get("z")))
                return fn(row(u), row(dt), A, row(B), row(C), *args, **kw).permute(2, 1, 0)
            return fn(u, dt, A, B, C, *args, **kw)

        return {"causal_conv1d_fn": conv, "torch_chunk_gated_delta_rule": delta, "chunk_kimi_delta_attention": kda,
                "mamba2_chunk_scan": ssm, "mamba_selective_scan": selective, **_UNUSED_FORMS}

    def swap_kernels(self, layer: StateLayer, swap: Swap) -> Kernels:
        """The probe's state calls of a swapped layer: each recorded, run from a zero state by its reference
        form (every token its own request in the row-independence forward)."""
        rec = self

        def recorder(name: str, kind: str) -> Callable[..., torch.Tensor]:
            spec = KINDS[kind]

            def call(*args: Any) -> torch.Tensor:
                shape, dtype = spec.shape(*args), spec.dtype(*args)
                layer.calls.setdefault(name, []).append({"shape": shape, "dtype": dtype, "why": None})
                tokens = args[0].shape[0]
                if rec.rows_independent:
                    return spec.step(*args, torch.zeros((tokens, *shape), dtype=dtype, device=args[0].device))[0]
                return spec.sequence(*args, torch.zeros(shape, dtype=dtype, device=args[0].device))[0]

            return call

        return {name: recorder(name, kind) for name, kind in swap.states.items()}


def _bind(module: torch.nn.Module, kernels: dict[str, Callable[..., Any]]) -> types.MethodType:
    """``module``'s class's forward code with ``kernels`` in place of the globals of those names, bound to it."""
    fn = raw_forward(module)
    names = {n: k for n, k in kernels.items() if n in fn.__code__.co_names}
    scope = dict(fn.__globals__, **names)
    # Without a module name Dynamo reads this dict itself; with one it would read the module's globals.
    scope.pop("__name__", None)
    bound = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    bound.__kwdefaults__ = fn.__kwdefaults__
    bound.__qualname__ = fn.__qualname__
    return types.MethodType(bound, module)


def _bind_swap(module: torch.nn.Module, swap: Swap, kernels: Kernels) -> types.MethodType:
    """The forward of ours ``swap`` names, its state calls ``kernels``, bound to ``module``."""
    forward = swap.forward

    def bound(self: torch.nn.Module, *args: Any, **kw: Any) -> Any:
        return forward(self, kernels, *args, **kw)

    return types.MethodType(bound, module)


def _layer_of(path: str, module: torch.nn.Module) -> int | None:
    """A module's layer: its ``layer_idx``, else the index of the ``layers.N`` it sits in (RecurrentGemma's block)."""
    layer = getattr(module, "layer_idx", None)
    if isinstance(layer, int):
        return layer
    found = re.findall(r"(?:^|\.)layers\.(\d+)(?:\.|$)", path)
    return int(found[-1]) if found else None


def candidates(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(layer, module)`` of every module whose forward calls a served kernel or that :data:`~.state_swaps.SWAPS` swaps."""
    return [(layer, m) for layer, m, _ in _candidates(model)]


def _candidates(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module, Swap | None]]:
    """:func:`candidates`, each with its swap (None: its kernels are bound)."""
    out = []
    for path, m in model.named_modules():
        swap = swapped(m)
        if swap is not None:
            layer = _layer_of(path, m)
            if layer is None:
                raise ValueError(f"{type(m).__name__} at {path} has no layer_idx and sits in no layers.N: its states cannot be keyed")
            out.append((layer, m, swap))
            continue
        layer = getattr(m, "layer_idx", None)
        if isinstance(layer, int) and kernels_called(m) & SERVED_KERNELS.keys():
            out.append((layer, m, None))
    return out


@contextmanager
def recording(model: torch.nn.Module) -> Iterator[_Recorder]:
    """Within: ``model``'s state layers record their kernel calls (the probe's); restored after."""
    rec = _Recorder()
    found = _candidates(model)
    routed = [m.__dict__.get("forward") for _, m, _ in found]  # a forward an earlier adapt routed: back after
    try:
        for layer, m, swap in found:
            state_layer = rec.layers.setdefault(layer, StateLayer(m, layer))
            if swap is not None:
                m.forward = _bind_swap(m, swap, rec.swap_kernels(state_layer, swap))
            else:
                fn = raw_forward(m)
                original = {n: fn.__globals__[n] for n in SERVED_KERNELS if n in fn.__globals__}
                m.forward = _bind(m, rec.kernels(state_layer, original))
        yield rec
    finally:
        for (_, m, _), forward in zip(found, routed):
            if forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = forward


def _conv_kernel(state: int) -> Callable[..., Any]:
    def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: Any = None, **kw: Any) -> torch.Tensor:
        rows = x[0].transpose(0, 1).contiguous()  # (tokens, channels)
        out = torch.empty_like(rows)
        torch.ops.pb_state.causal_conv1d(rows, weight, bias, out, state, activation or "")
        return out.transpose(0, 1)[None]

    return conv


def _delta_kernel(state: int) -> Callable[..., Any]:
    def delta(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              chunk_size: int = 64, initial_state: Any = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, **kw: Any) -> tuple[torch.Tensor, None]:
        out = torch.empty_like(value[0])
        torch.ops.pb_state.gated_delta_rule(
            query[0], key[0], value[0], g[0], beta[0], out, state, bool(use_qk_l2norm_in_kernel), int(chunk_size)
        )
        return out[None], None

    return delta


def _kda_kernel(state: int) -> Callable[..., Any]:
    def kda(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            chunk_size: int = 64, initial_state: Any = None, output_final_state: bool = False,
            use_qk_l2norm_in_kernel: bool = False, **kw: Any) -> tuple[torch.Tensor, None]:
        out = torch.empty_like(value[0])
        torch.ops.pb_state.kda_rule(
            query[0], key[0], value[0], g[0], beta[0], out, state, bool(use_qk_l2norm_in_kernel), int(chunk_size)
        )
        return out[None], None

    return kda


def _ssm_kernel(state: int) -> Callable[..., Any]:
    def ssm(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int = 256,
            D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, initial_states: Any = None,
            dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
            return_final_states: bool = False, **kw: Any) -> torch.Tensor:
        if return_final_states:
            raise RuntimeError("a served forward has no cache: mamba2_chunk_scan is never asked for its final state")
        out = torch.empty_like(x[0])
        torch.ops.pb_state.ssd_scan(x[0], dt[0], A, B[0], C[0], D, dt_bias, out, state, int(chunk_size),
                                    bool(dt_softplus), float(dt_limit[0]), float(dt_limit[1]))
        return out[None]

    return ssm


def _selective_kernel(state: int) -> Callable[..., Any]:
    def selective(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor | None = None, z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
                  delta_softplus: bool = False, return_last_state: bool = False, **kw: Any) -> torch.Tensor:
        if return_last_state:
            raise RuntimeError("a served forward has no cache: mamba_selective_scan is never asked for its last state")
        rows = lambda t: None if t is None else t[0].transpose(0, 1).contiguous()  # noqa: E731  (tokens, ...)
        out = torch.empty_like(rows(u))
        torch.ops.pb_state.selective_scan(rows(u), rows(dt), A, rows(B), rows(C), D, rows(z), delta_bias, out, state,
                                          bool(delta_softplus))
        return out.transpose(0, 1)[None]

    return selective


def _no_fused(*args: Any, **kw: Any) -> None:
    """The fused Mamba kernels' torch fallback: None, so the mixer takes its unfused path."""
    return None


def _no_cache(*args: Any, **kw: Any) -> Any:
    raise RuntimeError("piecewise_backend serves state layers without a HF cache: a cached kernel was called")


#: The kernel forms a served forward never takes, bound in the probe and when served alike: the
#: single-token cached ones (no HF cache) raise, the fused ones say "none" (the mixer goes unfused).
_UNUSED_FORMS: dict[str, Callable[..., Any]] = {
    "causal_conv1d_update": _no_cache, "torch_recurrent_gated_delta_rule": _no_cache, "recurrent_kimi_delta_attention": _no_cache,
    "mamba2_selective_state_update": _no_cache, "mamba_selective_state_update": _no_cache,
    "mamba2_split_conv1d_scan_combined": _no_fused, "mamba_inner_fn": _no_fused,
}


def _state_call(run: Callable[..., torch.Tensor], state: int) -> Callable[..., torch.Tensor]:
    def call(*args: Any) -> torch.Tensor:
        return run(state, *args)

    return call


def route(layers: dict[int, StateLayer], index: Callable[[int, str], int], changes: Changes | None = None) -> None:
    """Bind every layer's kernels to the ``pb_state`` ops on its states (``index(layer, kind)``: the op's state);
    ``changes``, if given, can undo it."""
    changes = changes if changes is not None else Changes()
    for layer, sl in layers.items():
        swap = swapped(sl.module)
        if swap is not None:
            runs = {name: KINDS[kind].run for name, kind in swap.states.items()}
            calls = {name: _state_call(runs[name], index(layer, name)) for name in swap.states}
            changes.set(sl.module, "forward", _bind_swap(sl.module, swap, calls))
            continue
        kernels: dict[str, Callable[..., Any]] = dict(_UNUSED_FORMS)
        if "conv" in sl.calls:
            kernels["causal_conv1d_fn"] = _conv_kernel(index(layer, "conv"))
        if "recurrent" in sl.calls:
            kernels["torch_chunk_gated_delta_rule"] = _delta_kernel(index(layer, "recurrent"))
            kernels["chunk_kimi_delta_attention"] = _kda_kernel(index(layer, "recurrent"))
        if "ssm" in sl.calls:
            kernels["mamba2_chunk_scan"] = _ssm_kernel(index(layer, "ssm"))
            kernels["mamba_selective_scan"] = _selective_kernel(index(layer, "ssm"))
        changes.set(sl.module, "forward", _bind(sl.module, kernels))


def specs(layers: dict[int, StateLayer]) -> list[StateSpec]:
    """Every state of ``layers``, by layer then kind: the order of the state cache."""
    return [s for layer in sorted(layers) for s in layers[layer].specs()]


class StateKernels(RefusesNothing):
    """The mechanism that routes the probed state layers' kernels to the ``pb_state`` ops, one state per
    ``(layer, kind)`` in :func:`specs` order (each layer's own refusals: :meth:`StateLayer.refusal`, said by
    :func:`~.probe_result.layout_refusal`)."""

    name = "state kernels"

    def install(self, model: torch.nn.Module, probed: ProbeResult | None) -> Callable[[], None]:
        changes = Changes()
        keys = [(s.layer, s.kind) for s in specs(probed.state_layers)]
        route(probed.state_layers, lambda layer, kind: keys.index((layer, kind)), changes)
        return changes.undo


MECHANISM = StateKernels()
