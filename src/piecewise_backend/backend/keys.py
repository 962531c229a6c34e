"""What decides reuse of compiled code: the keys of in-process piece sharing and of the piece cache.

A compiled piece may serve another piece only when both are the same code. :func:`describe_piece`
describes everything that changes the code Inductor makes for a piece: its graph, recursively
into the bodies of higher-order ops (``torch.cond``, ``checkpoint``, ``wrap``), the identity of
every object it calls or reads (functions, closures, constants, tensor constants by value), its
inputs' metadata and symbolic ranges, and the global state compilation reads (grad mode, autocast,
default dtype, deterministic algorithms, Inductor's and AOTAutograd's configs with their custom
pass hooks).

In one process (``stable=False``) an object is named by its identity, and the caller keeps the
objects alive (``refs``) so that an id cannot be reused. Across processes (``stable=True``, the
``cache_dir`` key) an object must be named by what it is: ops by name, functions by their code,
closure cells and defaults (recursively), custom passes by their ``uuid()``; what cannot be named
that way raises :class:`Uncacheable` and the piece is compiled, not cached.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch
import torch.fx as fx

from .describe import Describer, Uncacheable

__all__ = ["CompileState", "Uncacheable", "describe_piece", "global_state", "stable_digest"]

# Inductor hooks left out of save_config_portable(): they hold callables, keyed by uuid() here.
_PASS_HOOKS = (
    "pre_grad_custom_pass", "post_grad_custom_pre_pass", "post_grad_custom_post_pass", "joint_custom_pre_pass",
    "joint_custom_post_pass", "_pre_fusion_custom_pass", "_post_fusion_custom_pass", "_fuse_ddp_communication_passes",
)
_FUNCTORCH_IGNORED = re.compile(r"cache|force_non_lazy_backward_lowering|graph_format|^debug|joint_custom_pass")


def _passes(value: Any) -> tuple[Any, ...]:
    """The passes a hook holds: none, one, or a list (torch 2.13 accepts lists; 2.11 has no helper for this)."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _hooks(d: Describer) -> list[str]:
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    parts = []
    hooks = [(f"torch._inductor.config.{n}", getattr(config, n, None)) for n in _PASS_HOOKS]
    hooks.append(("torch._functorch.config.joint_custom_pass", getattr(functorch_config, "joint_custom_pass", None)))
    for name, value in hooks:
        for p in _passes(value):
            if isinstance(p, str):
                parts.append(f"{name}={p}")
                continue
            uuid = getattr(p, "uuid", None)
            key = uuid() if callable(uuid) else None
            if d.stable and key is None:
                raise Uncacheable(f"{name} holds {getattr(p, '__qualname__', type(p).__qualname__)}, "
                                  "a pass without a uuid(); make it a CustomGraphPass whose uuid() names its code")
            parts.append(f"{name}=uuid:{key!r}" if d.stable else f"{name}={d.identity(p, name)}")
    return parts


def global_state(d: Describer) -> list[str]:
    """The thread's and process's settings that change what compiling a graph produces."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    parts = [
        f"grad={torch.is_grad_enabled()}",
        f"default_dtype={torch.get_default_dtype()}",
        f"deterministic={torch.are_deterministic_algorithms_enabled()},"
        f"{torch.is_deterministic_algorithms_warn_only_enabled()}",
        f"autocast_cache={torch.is_autocast_cache_enabled()}",
    ]
    for device in ("cpu", "cuda"):
        parts.append(f"autocast[{device}]={torch.is_autocast_enabled(device)},{torch.get_autocast_dtype(device)}")
    # Inductor's config less what its own FX graph cache ignores (thread counts, trace options: no code)
    ignored = tuple(getattr(config, "_cache_config_ignore_prefix", ()))
    parts.append(d.value(sorted((k, v) for k, v in config.save_config_portable().items() if not k.startswith(ignored))))
    # AOTAutograd's settings, less its cache switches (aot_compile flips them; they change no code)
    functorch = functorch_config.save_config_portable()
    parts.append(d.value(sorted((k, v) for k, v in functorch.items() if not _FUNCTORCH_IGNORED.search(k))))
    parts.extend(_hooks(d))
    return parts


class CompileState:
    """The compile-time state part of the keys, described once per Dynamo graph: it cannot change
    while a backend compiles one graph's pieces, and describing it costs milliseconds."""

    def __init__(self) -> None:
        self._parts: dict[bool, tuple[str, list[Any]] | Uncacheable] = {}

    def get(self, stable: bool) -> tuple[str, list[Any]]:
        if stable not in self._parts:
            d = Describer(stable)
            try:
                self._parts[stable] = ("\n".join(global_state(d)), d.refs)
            except Uncacheable as e:
                self._parts[stable] = e
        part = self._parts[stable]
        if isinstance(part, Uncacheable):
            raise Uncacheable(str(part))
        return part


def describe_piece(gm: fx.GraphModule, *, stable: bool, state: CompileState | None = None) -> tuple[str, list[Any]]:
    """(description, objects to keep alive) of everything that changes ``gm``'s compiled code.

    ``stable=False``: in-process identity is allowed. ``stable=True``: raises :class:`Uncacheable`
    for what cannot be named across processes. The environment (versions, device) is the cache's part.
    ``state``: the compile-time state described already for this graph (else described now).
    """
    d = Describer(stable)
    graph = d.graph(gm)
    state_text, state_refs = (state or CompileState()).get(stable)
    return graph + "\n" + state_text, d.refs + state_refs


def stable_digest(gm: fx.GraphModule) -> str:
    """SHA-256 hex of the cross-process description of ``gm`` (raises :class:`Uncacheable`)."""
    return hashlib.sha256(describe_piece(gm, stable=True)[0].encode()).hexdigest()


#: The old name of :func:`describe_piece` (docs/restart.md named it): kept importable. The piece
#: cache's key, a digest, is :func:`piecewise_backend.backend.cache.piece_key`.
piece_key = describe_piece
