"""Forward context: per-step metadata (runtime mode, batch descriptor, attention data).

Stored in a ``contextvars.ContextVar`` so every thread and asyncio task sees its own.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

from .modes import CUDAGraphMode

# Values, not members: hashing an Enum member and reading ``.value`` run Python code, once per step.
_RUNTIME_VALUES = frozenset(m._value_ for m in CUDAGraphMode.valid_runtime_modes())


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """Key of a captured graph: padded token count, and for uniform decode the request count."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool) or self.num_tokens < 1:
            raise ValueError(f"BatchDescriptor.num_tokens must be a positive int, got {self.num_tokens!r}")
        if self.num_reqs is not None and (
            not isinstance(self.num_reqs, int) or isinstance(self.num_reqs, bool) or self.num_reqs < 1
        ):
            raise ValueError(f"BatchDescriptor.num_reqs must be None or a positive int, got {self.num_reqs!r}")
        if not isinstance(self.uniform, bool):
            raise ValueError(f"BatchDescriptor.uniform must be a bool, got {self.uniform!r}")

    def relax_for_mixed_batch(self) -> BatchDescriptor:
        """The key a mixed (non-uniform) batch of the same token count uses."""
        return BatchDescriptor(self.num_tokens)


class ForwardContext:
    """What one forward step runs under. Extra attributes (attention metadata...) are readable.

    ``mode_index`` (the runtime mode's value) and ``mode_bit`` (``1 << mode_index``) follow
    ``runtime_mode``: plain ints for hot paths (a wrapper's passthrough test), where hashing or
    comparing Enum members would run Python code. They are slots, so an extra attribute of the
    same name cannot hide them; :func:`context_attributes` lists the extra attributes.
    """

    __slots__ = ("__dict__", "_runtime_mode", "mode_bit", "mode_index")

    def __init__(self, runtime_mode: CUDAGraphMode, batch_descriptor: BatchDescriptor | None, **attrs: Any):
        self.runtime_mode = runtime_mode
        self.batch_descriptor = batch_descriptor
        self.__dict__.update(attrs)

    @property
    def runtime_mode(self) -> CUDAGraphMode:
        return self._runtime_mode

    @runtime_mode.setter
    def runtime_mode(self, mode: CUDAGraphMode) -> None:
        if type(mode) is not CUDAGraphMode or mode._value_ not in _RUNTIME_VALUES:
            raise ValueError(f"runtime_mode must be one of NONE, PIECEWISE, FULL; got {getattr(mode, 'name', mode)}")
        self._runtime_mode = mode
        self.mode_index = mode._value_
        self.mode_bit = 1 << mode._value_

    def __repr__(self) -> str:
        shown = [f"runtime_mode={self.runtime_mode!r}"]
        shown += [f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_")]
        return f"ForwardContext({', '.join(shown)})"


def context_attributes(ctx: ForwardContext) -> dict[str, Any]:
    """The extra attributes ``ctx`` was set with (``set_forward_context(mode, desc, **attrs)``'s ``attrs``)."""
    return {k: v for k, v in vars(ctx).items() if not k.startswith("_") and k != "batch_descriptor"}


_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("pb_forward_context", default=None)

#: ``current_forward_context()``: the active :class:`ForwardContext`, or None outside one. The
#: ContextVar's bound ``get`` itself, so a hot path (a wrapper's passthrough, an attention op) pays
#: one C call, as ``_CONTEXT.get()`` did; :func:`get_forward_context` raises instead of returning None.
current_forward_context: Callable[[], ForwardContext | None] = _CONTEXT.get


class set_forward_context:  # noqa: N801 - a context manager used like a function, as torch.no_grad
    """Run a step under ``runtime_mode`` (NONE, PIECEWISE or FULL) keyed by ``batch_descriptor``.

    ``with pb.set_forward_context(mode, desc, **attrs) as ctx:``. A class rather than a
    generator-based context manager: it is entered on every step, and a generator's setup
    and teardown cost several times the checks themselves.
    """

    __slots__ = ("ctx", "_token")

    def __init__(
        self,
        runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
        batch_descriptor: BatchDescriptor | None = None,
        **attrs: Any,
    ) -> None:
        if type(runtime_mode) is not CUDAGraphMode:
            runtime_mode = CUDAGraphMode.parse(runtime_mode)  # ForwardContext checks it is a runtime mode
        if batch_descriptor is not None and not isinstance(batch_descriptor, BatchDescriptor):
            raise TypeError(f"batch_descriptor must be a BatchDescriptor, got {type(batch_descriptor).__name__}")
        self.ctx = ForwardContext(runtime_mode, batch_descriptor, **attrs)

    def __enter__(self) -> ForwardContext:
        self._token = _CONTEXT.set(self.ctx)
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        _CONTEXT.reset(self._token)


def get_forward_context() -> ForwardContext:
    ctx = current_forward_context()
    if ctx is None:
        raise RuntimeError("no forward context is set; run the model inside `with pb.set_forward_context(...)`")
    return ctx


def is_forward_context_available() -> bool:
    return current_forward_context() is not None
