"""Buffers a model's forward assigns back to themselves (ctrl's ``self.pos_encoding = self.pos_encoding.to(...)``).

Dynamo cannot trace an assignment to a module buffer (``Module.__setattr__`` re-registers it): the
model compiles as several graphs around each one. Where the probe saw the assignment store the very
tensor the buffer already held (``.to`` of a buffer already on its device and dtype), it is a no-op:
such a module gets a subclass of its class whose ``__setattr__`` drops those assignments while
Dynamo traces, and keeps them otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from .patching import Changes, RefusesNothing, recorded

if TYPE_CHECKING:
    from .probe_result import ProbeResult

#: Attribute of a subclass made here: the buffer names whose assignments it drops while compiling.
_DROPPED = "_pb_dropped_self_assignments"


@contextlib.contextmanager
def recording_self_assignments() -> Iterator[dict[tuple[int, str], tuple[torch.nn.Module, str, bool]]]:
    """Record every buffer (re-)registration while open: ``{(id(module), name): (module, name, same)}``,
    ``same`` telling whether the latest one stored the tensor the buffer already held."""
    seen: dict[tuple[int, str], tuple[torch.nn.Module, str, bool]] = {}

    def hook(module: torch.nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        old = module._buffers.get(name)
        seen[(id(module), name)] = (module, name, tensor is not None and tensor is old)

    handle = torch.nn.modules.module.register_module_buffer_registration_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def self_assigned(seen: dict[tuple[int, str], tuple[torch.nn.Module, str, bool]]) -> list[tuple[torch.nn.Module, str]]:
    """The ``(module, buffer name)`` pairs of a recording whose latest assignment stored the buffer itself."""
    return [(module, name) for module, name, same in seen.values() if same]


def _setattr(self: torch.nn.Module, name: str, value: object) -> None:
    if name in getattr(type(self), _DROPPED) and torch.compiler.is_compiling():
        return  # the probe saw this assignment store the buffer itself: nothing for the graph to do
    super(type(self), self).__setattr__(name, value)


def drop_self_assignments(pairs: list[tuple[torch.nn.Module, str]] | tuple[tuple[torch.nn.Module, str], ...],
                          changes: Changes | None = None) -> None:
    """Give each module of ``pairs`` a subclass (same name) that drops its listed assignments while compiling;
    ``changes``, if given, can undo it."""
    changes = changes if changes is not None else Changes()
    names: dict[int, tuple[torch.nn.Module, set[str]]] = {}
    for module, name in pairs:
        names.setdefault(id(module), (module, set()))[1].add(name)
    for module, dropped in names.values():
        cls = type(module)
        if _DROPPED in vars(cls):  # adapted before: widen its set
            base, dropped = cls.__mro__[1], dropped | getattr(cls, _DROPPED)
        else:
            base = cls
        changes.cls(module, type(base.__name__, (base,), {
            "__setattr__": _setattr, _DROPPED: frozenset(dropped), "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        }))


class SelfAssignments(RefusesNothing):
    """The mechanism that drops the probed self-assignments of buffers while compiling (Dynamo would end a
    graph at each: ctrl's ``pos_encoding``)."""

    name = "self-assignments"

    def install(self, model: torch.nn.Module, probed: ProbeResult | None) -> Callable[[], None]:
        return recorded(drop_self_assignments, probed.self_assigned)


MECHANISM = SelfAssignments()
