"""Splitting ops as run-time breaks: breakable capture of an uncompiled model (``compile_pieces="none"``).

With Dynamo the backend splits the FX graph at each splitting op and makes the splitting piece a
break point. Without Dynamo there is no graph to split: :class:`OpBreaks`, a ``TorchFunctionMode``
pushed around a breakable capture, sees every call of a torch op from Python (``torch.ops.ns.name``
or one overload, a ``torch.library`` custom op, a function torch dispatches through
``__torch_function__`` such as ``F.scaled_dot_product_attention``) and runs the registered ones as
breaks (:func:`~.session.call_break`: end the segment, run eagerly, record for replay, begin the
next). A function mode, not a dispatch mode: it sees a custom op once, before any dispatch mode
(the simulator's recorder) would record what the op runs. Replays run the recorded breaks between
graph segments as any break. A splitting op that is a plain Python callable reaches no mode:
:func:`op_breaks` refuses it, naming it (one decorated with :func:`~.session.eager_break` breaks on
its own and is accepted).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from torch.overrides import TorchFunctionMode, get_overridable_functions

from ..ops import OpMatcher, OpSpec, canonicalize_op
from .session import call_break, is_in_breakable_graph

__all__ = ["OpBreaks", "op_breaks", "uninterceptable"]

_MISS = object()


@functools.cache
def _overridable() -> frozenset[Any]:
    """The Python-level torch functions a TorchFunctionMode sees (F.scaled_dot_product_attention, ...)."""
    found = set()
    for funcs in get_overridable_functions().values():
        for f in funcs:
            try:
                found.add(f)
            except TypeError:  # an unhashable entry is never a registered splitting op
                pass
    return frozenset(found)


def _interceptable(spec: OpSpec) -> bool:
    """A torch op by name, a torch function a mode sees, or a function that is a break point itself."""
    if isinstance(spec, str) or getattr(spec, "__pb_break_point__", None) is not None:
        return True
    try:
        return spec in _overridable()
    except TypeError:
        return False


def uninterceptable(ops: Iterable[Any]) -> list[OpSpec]:
    """The splitting ops among ``ops`` no run-time interception can break at: plain Python callables."""
    return [spec for spec in (canonicalize_op(op) for op in ops) if not _interceptable(spec)]


def _name(spec: OpSpec) -> str:
    if isinstance(spec, str):
        return spec
    return f"{getattr(spec, '__module__', None) or '?'}.{getattr(spec, '__qualname__', repr(spec))}"


class OpBreaks(TorchFunctionMode):
    """Run each call of the given torch ops as a break while a breakable capture is open on this
    thread; every other call (and every call outside such a capture, or inside a break) passes through."""

    def __init__(self, ops: Iterable[Any]):
        super().__init__()
        self.matcher = OpMatcher(ops)
        self._seen: dict[Any, OpSpec | None] = {}  # func -> the spec it matched (None: no splitting op)

    def match(self, func: Any) -> OpSpec | None:
        """The splitting op ``func`` is (a packet matches its overloads' names too), or None."""
        try:
            hit = self._seen.get(func, _MISS)
        except TypeError:  # unhashable: match without the memo
            return self.matcher.match(func)
        if hit is _MISS:
            hit = self._seen[func] = self.matcher.match(func)
        return hit  # type: ignore[return-value]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        spec = self.match(func)
        if spec is None or not is_in_breakable_graph():
            return func(*args, **kwargs)
        return call_break(func, args, kwargs, name=_name(spec))  # inline inside another break, or a FULL capture


def op_breaks(ops: Iterable[Any]) -> OpBreaks:
    """An :class:`OpBreaks` for ``ops`` (splitting-op specs); ValueError naming every one that is a plain Python
    callable, which nothing intercepts without Dynamo (an ``eager_break`` function is left to break on its own)."""
    ops = list(ops)
    bad = uninterceptable(ops)
    if bad:
        names = ", ".join(_name(op) for op in bad)
        raise ValueError(
            f"CompilationConfig(compile_pieces=\"none\") is refused: the splitting op(s) {names} are plain Python "
            "callables. Without Dynamo a splitting op becomes a break at run time only when a TorchFunctionMode "
            "sees its call: a torch op ('ns::name', torch.library.custom_op) or a torch function such as "
            "F.scaled_dot_product_attention. Register a torch.library custom op instead, decorate the function "
            "with pb.eager_break (it then breaks on its own), drop it from splitting_ops, or compile the model "
            "with compile_pieces='eager' or 'inductor' (Dynamo splits at any callable)"
        )
    return OpBreaks(op for op in ops if not callable(getattr(op, "__pb_break_point__", None)))
