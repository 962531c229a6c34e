"""What a FULL graph baked in of a step's forward context, and the checks that a later step gives it the same.

A FULL graph holds attention, so it replays with the tensors ``context_fn`` returned at capture (the
attention metadata over the runner's views, the KV caches): a later step whose ``context_fn`` returns
other tensors, or a step ``context`` holding tensors outside the runner's buffers, would be silently
ignored by the replay. Both are refused with an error naming the attribute's path:

* :func:`check_full_context`: a step's own ``context`` on a FULL step holds only views of the buffers;
* :class:`ContextPrint`: ``context_fn``'s tensors at a FULL capture, and the check of every later FULL
  step of that descriptor (the hot path: one generated function over the captured structure);
* :func:`context_tensors` and :func:`check_captured_context`: the exact, path-by-path comparison
  (the error's text, and the authority whenever the fast check does not pass at once).

:func:`context_leaves` walks a context value: tuples, lists, dicts and dataclasses, to a depth of 8.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

#: Containers nested deeper than this below an attribute are not walked (their tensors are not checked).
MAX_DEPTH = 8


def context_leaves(value: Any, path: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of a forward-context value, through tuples, lists, dicts, dataclasses."""
    if isinstance(value, (tuple, list)):
        items: Any = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif type(value) is dict:
        items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f"{path}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    else:
        yield path, value
        return
    if depth < MAX_DEPTH:
        for sub_path, sub in items:
            yield from context_leaves(sub, sub_path, depth + 1)


def check_full_context(context: Mapping[str, Any], buffer_storages: frozenset[int] | set[int]) -> None:
    """On a FULL step, refuse per-step tensors the graph never read: it replays its capture-time ones."""
    for key, value in context.items():
        for path, leaf in context_leaves(value, key):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in buffer_storages:
                raise ValueError(
                    f"GraphRunner.run: context {path!r} is a tensor outside the runner's buffers on a FULL step; "
                    "a FULL graph replays the tensors it read at capture and would ignore it. Make it a "
                    "StaticInput and build it in context_fn from the step's views"
                )


def context_tensors(attrs: Mapping[str, Any], prefix: str = "") -> dict[str, tuple]:
    """``path -> (address, shape, dtype, strides)`` of every tensor among ``attrs``' leaves: what a FULL graph
    baked in (a view of the same memory in another layout is another tensor to it)."""
    return {
        prefix + path: (leaf.data_ptr(), tuple(leaf.shape), leaf.dtype, leaf.stride())
        for key, value in attrs.items()
        for path, leaf in context_leaves(value, key)
        if isinstance(leaf, torch.Tensor)
    }


def check_captured_context(captured: Mapping[str, tuple], now: Mapping[str, tuple], desc: Any) -> None:
    """On a FULL replay: ``context_fn`` returned the tensors the graph of ``desc`` captured, or a clear error."""
    if now == captured:
        return
    path = next((p for p in sorted(set(captured) | set(now)) if captured.get(p) != now.get(p)))
    was, got = (f"0x{t[0]:x} {list(t[1])} {t[2]} strides {list(t[3])}" if t else "absent"
                for t in (captured.get(path), now.get(path)))
    raise ValueError(
        f"GraphRunner.run: context_fn's {path!r} is not the tensor the FULL graph of {desc} captured (captured: "
        f"{was}; now: {got}); a FULL replay reads the capture-time tensor and would ignore the new one. Update "
        "context tensors in place (a KV cache too), or call runner.clear_graphs() and capture() again after "
        "replacing them"
    )


class ContextPrint:
    """What a FULL graph baked in of a step's forward-context attributes, and a fast check of a later step's.

    ``tensors`` is :func:`context_tensors` of the capture-time attributes (what the error compares).
    :meth:`check` first runs one function generated from the captured attributes (:func:`same_context`):
    the same structure (container types, dict keys in order, lengths, dataclass types, which leaves are
    tensors) and every tensor at the same address, shape, strides and dtype pass at once. Anything else
    gets the exact path-by-path comparison; when that passes (a same-layout tensor under a leaf whose type
    changed, say), the check is generated again from the new attributes.
    """

    __slots__ = ("tensors", "_same")

    def __init__(self, attrs: Mapping[str, Any]) -> None:
        attrs = dict(attrs)
        self.tensors = context_tensors(attrs)
        self._same = same_context(attrs)

    def check(self, attrs: Mapping[str, Any], desc: Any) -> None:
        """``attrs`` holds the tensors the graph of ``desc`` captured, or a clear error."""
        if type(attrs) is not dict:
            attrs = dict(attrs)
        if self._same(attrs):
            return
        check_captured_context(self.tensors, context_tensors(attrs), desc)
        self._same = same_context(attrs)


def same_context(attrs: dict[str, Any]) -> Callable[[Any], bool]:
    """A function of a step's attributes, True only when they have ``attrs``' structure and tensors.

    Generated once (at a FULL capture) as straight-line code over the structure :func:`context_leaves`
    walks: a type test per container (and its length or keys), each tensor's ``data_ptr``, ``shape``,
    ``stride()`` and ``dtype`` against the captured values. True implies :func:`check_captured_context`
    passes (equal structures give equal paths, equal tensors equal entries); False only sends the step to
    that exact comparison. Captured values reach the code as names in its namespace, never as text.
    """
    lines = ["def same(v0):"]
    names: dict[str, Any] = {}
    counter = itertools.count(1)

    def const(value: Any) -> str:
        name = f"c{len(names)}"
        names[name] = value
        return name

    def test(cond: str) -> None:
        lines.append(f"    if {cond}: return False")

    def node(var: str, value: Any, depth: int) -> None:
        """Code checking ``var`` (a value at context depth ``depth``; the attributes' own dict is -1)."""
        if isinstance(value, torch.Tensor):
            test(f"type({var}) is not {const(type(value))} or {var}.data_ptr() != {value.data_ptr()} or "
                 f"{var}.shape != {const(value.shape)} or {var}.stride() != {const(value.stride())} or "
                 f"{var}.dtype is not {const(value.dtype)}")
            return
        kind = type(value)
        if isinstance(value, (tuple, list)):
            test(f"type({var}) is not {const(kind)} or len({var}) != {len(value)}")
            children: list[Any] = list(value)
            subs = [f"v{next(counter)}" for _ in children]
            if children and depth < MAX_DEPTH:
                lines.append(f"    {', '.join(subs)}, = {var}")
        elif kind is dict:
            test(f"type({var}) is not dict or list({var}) != {const(list(value))}")
            children = list(value.values())
            subs = [f"v{next(counter)}" for _ in children]
            if children and depth < MAX_DEPTH:
                lines.append(f"    {', '.join(subs)}, = {var}.values()")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            test(f"type({var}) is not {const(kind)}")
            fields = [f.name for f in dataclasses.fields(value)]
            children = [getattr(value, f) for f in fields]
            subs = [f"v{next(counter)}" for _ in children]
            if children and depth < MAX_DEPTH:
                lines.append(f"    {', '.join(subs)}, = {', '.join(f'{var}.{f}' for f in fields)},")
        else:  # a leaf that is no tensor: only its type is part of the structure here
            test(f"type({var}) is not {const(kind)}")
            return
        if depth < MAX_DEPTH:
            for sub, child in zip(subs, children):
                node(sub, child, depth + 1)

    node("v0", attrs, -1)
    lines.append("    return True")
    namespace = dict(names)
    exec(compile("\n".join(lines), "<same_context>", "exec"), namespace)  # noqa: S102 - code built above, no user text
    return namespace["same"]
