"""Splitting-op registry: which calls split a graph into pieces (attention, usually).

An op is stored in a canonical form: ``"ns::name"`` (any overload),
``"ns::name.overload"`` (that overload), or a plain Python callable matched by identity.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch._library.custom_ops import CustomOpDef

OpSpec = Union[str, Callable[..., Any]]
_NAME_RE = re.compile(r"^[A-Za-z_][\w]*::[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)?$")

_lock = threading.Lock()
# SDPA is registered by default so stock models (Hugging Face, torchtune...) split at attention.
_registry: list[OpSpec] = [F.scaled_dot_product_attention]


def canonicalize_op(op: Any) -> OpSpec:
    """Return the canonical registry form of ``op``; TypeError/ValueError for anything else."""
    if isinstance(op, str):
        if not _NAME_RE.match(op):
            raise ValueError(f"splitting op name {op!r} is not of the form 'ns::name' or 'ns::name.overload'")
        return op
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    if isinstance(op, CustomOpDef):
        return op._qualname
    if isinstance(op, torch.nn.Module):
        raise TypeError(
            f"cannot use the nn.Module instance {type(op).__name__} as a splitting op: Dynamo inlines modules, so "
            "no graph node ever calls it; register the function or custom op its forward calls "
            "(e.g. F.scaled_dot_product_attention or 'ns::attention')"
        )
    if callable(op) and not isinstance(op, type):
        return op
    raise TypeError(
        f"cannot use {op!r} (type {type(op).__name__}) as a splitting op; pass 'ns::name', "
        "'ns::name.overload', an OpOverload/OpOverloadPacket, a torch.library custom op, or a Python callable"
    )


def register_splitting_op(op: Any) -> OpSpec:
    """Add ``op`` to the default splitting ops (idempotent). Returns its canonical form."""
    spec = canonicalize_op(op)
    with _lock:
        if not any(_same(spec, s) for s in _registry):
            _registry.append(spec)
    return spec


def unregister_splitting_op(op: Any) -> None:
    """Remove ``op``; KeyError naming the registered ops when it is not registered."""
    spec = canonicalize_op(op)
    with _lock:
        for i, s in enumerate(_registry):
            if _same(spec, s):
                del _registry[i]
                return
    raise KeyError(f"{spec!r} is not a registered splitting op; registered: {registered_splitting_ops()}")


def registered_splitting_ops() -> list[OpSpec]:
    with _lock:
        return list(_registry)


def _same(a: OpSpec, b: OpSpec) -> bool:
    return a == b if isinstance(a, str) and isinstance(b, str) else a is b


def target_names(target: Any) -> tuple[str, ...]:
    """The names a graph node's target answers to: packet name and full overload name."""
    if isinstance(target, torch._ops.OpOverload):
        packet = target._schema.name
        return (packet, f"{packet}.{target._overloadname}")
    if isinstance(target, torch._ops.OpOverloadPacket):
        # A call through the packet resolves to .default for the ops this library cares about.
        return (target._qualified_op_name, f"{target._qualified_op_name}.default")
    return ()


class OpMatcher:
    """Fast membership test of FX node targets against a list of op specs."""

    def __init__(self, ops: Iterable[Any]):
        self.specs = [canonicalize_op(op) for op in ops]
        self._names = {s for s in self.specs if isinstance(s, str)}
        self._callables = [s for s in self.specs if not isinstance(s, str)]

    def match(self, target: Any) -> OpSpec | None:
        """The spec ``target`` matches, or None."""
        for name in target_names(target):
            if name in self._names:
                return name
        for c in self._callables:
            if target is c:
                return c
        return None

    def __bool__(self) -> bool:
        return bool(self.specs)
