"""How adaptation mechanisms change a model: the one swap record, its one key, and the undo journal.

Each mechanism of :func:`~piecewise_backend.hf.adapt` (:class:`.adaptation.Mechanism`) installs
itself and returns the undo of everything it changed. :class:`Changes` is the journal an install writes its changes through (an attribute set, a buffer
registered, a hook added, a class replaced): :meth:`Changes.undo` puts back exactly what was there
before, so undoing an adaptation of an already adapted model returns it to its first adaptation.

Every registry of module classes (:data:`.attention_swaps.SWAPS`, :data:`.position_swaps.SWAPS`,
:data:`.state_swaps.REGISTRY`) maps :func:`class_key` (the class's module and qualified name) to a
:class:`Swap`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

Undo = Callable[[], None]
_MISSING = object()


def class_key(module_or_class: torch.nn.Module | type) -> str:
    """The registry key of a module's class: ``module.qualname`` (``transformers.models.bloom.modeling_bloom.BloomAttention``)."""
    cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclasses.dataclass(frozen=True)
class Swap:
    """What replaces a module class's forward: ``forward``, and what else the mechanism needs of the class.

    ``states``: a state layer's state calls, call name -> kind (:mod:`.state_swaps`); ``slopes``: an
    attention module's ALiBi slopes (None: it uses none; :mod:`.attention_swaps`); ``numbered``: the
    class has no ``layer_idx``, its modules are numbered in model order (openai-gpt).
    """

    forward: Callable[..., Any]
    states: Mapping[str, str] = dataclasses.field(default_factory=dict)
    slopes: Callable[[torch.nn.Module], torch.Tensor | None] | None = None
    numbered: bool = False


def lookup(registry: Mapping[str, Swap], module: torch.nn.Module) -> Swap | None:
    """The swap ``registry`` holds for ``module``'s class, or None."""
    return registry.get(class_key(module))


class ByClassName(Mapping[str, Swap]):
    """A registry read by bare class name (``SWAPS["MiniMaxLightningAttention"]``): a documented view of one
    keyed by :func:`class_key`, which it reads live (a change to the registry shows here)."""

    def __init__(self, registry: Mapping[str, Swap]):
        self._registry = registry

    def _key(self, name: str) -> str | None:
        return next((k for k in self._registry if k.rsplit(".", 1)[-1] == name), None)

    def __getitem__(self, name: str) -> Swap:
        key = self._key(name)
        if key is None:
            raise KeyError(name)
        return self._registry[key]

    def __iter__(self) -> Iterator[str]:
        return (k.rsplit(".", 1)[-1] for k in self._registry)

    def __len__(self) -> int:
        return len(self._registry)

    def __repr__(self) -> str:
        return f"ByClassName({dict(self)!r})"


class Changes:
    """A journal of changes to modules; :meth:`undo` reverts them, newest first."""

    def __init__(self) -> None:
        self._undos: list[Undo] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        """``obj.<name> = value`` as an instance attribute (``obj.__dict__``), the previous one kept."""
        before = obj.__dict__.get(name, _MISSING)

        def undo() -> None:
            if before is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = before

        obj.__dict__[name] = value
        self._undos.append(undo)

    def buffer(self, module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
        """Register ``tensor`` as ``module``'s non-persistent buffer ``name``, the previous one kept."""
        before = module._buffers.get(name, _MISSING)
        persistent = name not in module._non_persistent_buffers_set

        def undo() -> None:
            if before is _MISSING:
                module._buffers.pop(name, None)
                module._non_persistent_buffers_set.discard(name)
            else:
                module.register_buffer(name, before, persistent=persistent)

        module.register_buffer(name, tensor, persistent=False)
        self._undos.append(undo)

    def cls(self, module: torch.nn.Module, cls: type) -> None:
        """Give ``module`` the class ``cls``, its class before kept."""
        before = type(module)
        module.__class__ = cls
        self._undos.append(lambda: setattr(module, "__class__", before))

    def hook(self, handle: Any) -> None:
        """A hook just registered: removed on undo."""
        self._undos.append(handle.remove)

    def then(self, undo: Undo) -> None:
        """Any other change: ``undo`` reverts it."""
        self._undos.append(undo)

    def undo(self) -> None:
        while self._undos:
            self._undos.pop()()


def recorded(change: Callable[..., Any], *args: Any) -> Undo:
    """Run ``change(*args, changes)`` with a fresh journal; returns its undo (a mechanism's install in one line)."""
    changes = Changes()
    change(*args, changes)
    return changes.undo


class RefusesNothing:
    """The base of a mechanism that serves every model it applies to: its ``refusal_of`` is None (the
    protocol: :class:`~.adaptation.Mechanism`)."""

    def refusal_of(self, model: torch.nn.Module, probed: Any) -> str | None:
        return None
