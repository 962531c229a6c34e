"""Replay inputs: match a call's inputs against what a graph captured, leaf by leaf.

A graph reads fixed addresses and bakes in every non-tensor value it saw. An
:class:`InputSpec` records, at capture, the tree structure of the inputs (keyword
names, not positions), each tensor's layout and address, each Python value, and
which inputs shared memory; at replay it validates **all** inputs before any copy.

Tensors are read in one of two ways:

* *in place*: persistent buffers (parameters, buffers marked with
  :func:`mark_persistent`, :class:`GraphRunner` buffers, earlier graphs' outputs) are
  read where they are; such an input must come back at the same address;
* *staged*: any other tensor is copied into a wrapper-owned static buffer before the
  capture (the graph reads that buffer) and before every replay, so a moved input
  works and the wrapper never writes into a tensor the caller owns. If the model
  writes into a staged input, the write is copied back, as eager would have done it.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from .weak import is_weak

# Values a graph bakes in that compare by value; anything else non-tensor compares by identity.
VALUE_TYPES = (
    bool, int, float, complex, str, bytes, type(None), type(Ellipsis), enum.Enum,
    torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size,
)
_VALUE_TYPES = VALUE_TYPES
_LEAF_TYPES = (torch.Tensor, *VALUE_TYPES)

_persistent: dict[int, StorageWeakRef] = {}  # storage data_ptr -> weak ref of that storage


def mark_persistent(*tensors: torch.Tensor) -> None:
    """Declare ``tensors`` (and every view of their storage) persistent buffers.

    A graph captured on a persistent buffer reads it in place: no staging copy per
    replay. The buffer must stay at its address for as long as the graphs live (the
    replay checks the address and raises if it moved). ``GraphRunner`` marks its own
    input buffers; parameters and graph outputs count as persistent without marking.
    """
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mark_persistent takes tensors, got {type(t).__name__}")
        if is_traceable_wrapper_subclass(t):  # DTensor, AsyncCollectiveTensor: no storage of their own
            mark_persistent(*(getattr(t, name) for name in t.__tensor_flatten__()[0]))
            continue
        storage = t.untyped_storage()
        _persistent[storage.data_ptr()] = StorageWeakRef(storage)


def is_persistent(t: torch.Tensor) -> bool:
    """True for parameters, Dynamo static addresses, and storages passed to :func:`mark_persistent`."""
    if isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) or is_weak(t):
        return True  # a weak tensor is graph memory: a replay's output, read in place by later graphs
    storage = t.untyped_storage()
    ref = _persistent.get(storage.data_ptr())
    if ref is None:
        return False
    if ref.expired() or ref.cdata != storage._cdata:  # freed and the address reused
        del _persistent[storage.data_ptr()]
        return False
    return True


def _arg_name(path: tuple) -> str:
    head, rest = path[0], keystr(path[1:])
    return ("args" if getattr(head, "idx", 0) == 0 else "kwargs") + rest


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor {tuple(v.shape)} {v.dtype} on {v.device}"
    return f"{type(v).__name__} {v!r}" if isinstance(v, _VALUE_TYPES) else f"a {type(v).__name__} object"


def same_value(a: Any, b: Any) -> bool:
    """The one rule for "did a value a graph baked in change": a value of :data:`VALUE_TYPES` by type
    and value (NaN equals NaN, ``-0.0`` is not ``0.0``, ``1`` is not ``1.0`` nor ``True``), anything
    else by identity. Replay inputs and the Python values breaks return use it."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (float, complex)):  # NaN equals NaN here (it did not change); -0.0 is not 0.0 (1 / x differs)
        return all(x == y and math.copysign(1.0, x) == math.copysign(1.0, y) or (x != x and y != y)
                   for x, y in ((a.real, b.real), (a.imag, b.imag)))
    if isinstance(a, _VALUE_TYPES):
        return a == b
    return False  # opaque objects: the same object or nothing


class _Tensor:
    """One tensor leaf: its captured layout, and the static buffer the graph reads when staged."""

    __slots__ = ("index", "name", "ptr", "shape", "stride", "dtype", "device", "captured", "static", "written")

    def __init__(self, index: int, name: str, t: torch.Tensor, static: torch.Tensor | None):
        self.index, self.name = index, name
        self.ptr, self.shape, self.stride = t.data_ptr(), t.shape, t.stride()
        self.dtype, self.device = t.dtype, t.device
        # what the graph reads: the caller's buffer in place (``captured``), or a wrapper-owned copy (``static``)
        self.captured: torch.Tensor | None = t
        self.static = static
        self.written = False  # set when the capture showed that the model writes into this input


def _storage_groups(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """For each tensor, the index of the first one sharing its storage (aliasing pattern)."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(t.untyped_storage().data_ptr(), i) for i, t in enumerate(tensors))


def _static_copy(t: torch.Tensor) -> torch.Tensor:
    # A normal (non-inference) tensor: replays under no_grad may copy into it (PITFALLS: inference tensors).
    with torch.inference_mode(False), torch.no_grad():
        static = torch.empty_like(t, memory_format=torch.preserve_format)
    with torch._C._AutoDispatchBelowADInplaceOrView():
        static.copy_(t)
    return static


class InputSpec:
    """What a graph captured of its inputs; ``bind`` makes the capture read static buffers."""

    def __init__(self, args: tuple, kwargs: dict):
        self.nargs, self.kw_names = len(args), tuple(kwargs)
        self.kw_set = frozenset(kwargs)
        # Leaves only, no containers (the common case): matched without pytree on every replay.
        self.flat = all(isinstance(a, _LEAF_TYPES) for a in (*args, *kwargs.values()))
        self._positional = self.flat and not kwargs
        named = [(_arg_name(p), v) for p, v in tree_flatten_with_path((args, kwargs))[0]]
        self.treespec = None if self.flat else tree_flatten((args, kwargs))[1]
        self.num_leaves = len(named)
        tensors = [(i, n, v) for i, (n, v) in enumerate(named) if isinstance(v, torch.Tensor)]
        self.groups = _storage_groups([v for _, _, v in tensors])
        self.tensors: list[_Tensor] = []
        for k, (i, name, t) in enumerate(tensors):
            root = self.groups[k]
            if root == k:
                static = None if is_persistent(t) else _static_copy(t)
            elif self.tensors[root].static is not None and _same_view(t, self.tensors[root].captured):
                static = self.tensors[root].static  # the same tensor passed twice: one static buffer
            else:  # overlapping views cannot be staged apart: the whole group is read in place
                static = None
                for j in range(root, k):
                    if self.groups[j] == root:
                        self.tensors[j].static = None
            self.tensors.append(_Tensor(i, name, t, static))
        for slot in self.tensors:
            if slot.static is not None:
                slot.captured = None  # the graph reads the static copy: do not keep the caller's tensor alive
        self.values = [(i, n, v) for i, (n, v) in enumerate(named) if not isinstance(v, torch.Tensor)]
        # every (index, name, ptr, shape) for the cheap check of an unmoved call
        self._fast = [(s.index, s.ptr, s.shape, s.stride, s.dtype) for s in self.tensors]
        self._staged = [s for s in self.tensors if s.static is not None]
        self._written: list[_Tensor] = []  # staged inputs the model writes into (see note_writes)

    @property
    def static_inputs(self) -> list[torch.Tensor]:
        """The wrapper-owned buffers staged inputs are copied into (what the graph reads), once each."""
        return list({id(s.static): s.static for s in self._staged}.values())

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with every staged tensor replaced by its static buffer (for the capture)."""
        if not self._staged:
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        for s in self._staged:
            leaves[s.index] = s.static
        return tree_unflatten(leaves, spec)

    def note_writes(self, leaves: Any) -> list[tuple[_Tensor, torch.Tensor]]:
        """After the capture's replay on the call's ``leaves``: mark staged inputs the model wrote into
        (from then on their writes are copied back to the caller, as eager makes them). Returns the
        (slot, caller tensor) pairs of those, for :meth:`copy_back`."""
        for s in self._staged:
            t, static = leaves[s.index], s.static
            same = torch.equal(t, static) if not t.is_floating_point() else bool(
                torch.isclose(t, static, rtol=0, atol=0, equal_nan=True).all()
            )
            s.written = not same
        self._written = [s for s in self._staged if s.written]
        return [(s, leaves[s.index]) for s in self._written]

    def leaves(self, args: tuple, kwargs: dict) -> Any:
        """The call's leaves, in capture order; raises when the structure differs from the capture."""
        if (kwargs or self.kw_names) and kwargs.keys() != self.kw_set or len(args) != self.nargs:
            missing = sorted(self.kw_set - kwargs.keys())
            extra = sorted(kwargs.keys() - self.kw_set)
            raise ValueError(
                f"replay got {len(args)} positional inputs and keywords {sorted(kwargs)}, the capture had "
                f"{self.nargs} positional and {sorted(self.kw_set)} (missing {missing}, unexpected {extra}); "
                "call with the captured signature or clear_graphs()"
            )
        if self.flat:  # keywords match by name, not by position
            return (*args, *[kwargs[k] for k in self.kw_names]) if self.kw_names else args
        if self.kw_names:
            kwargs = {k: kwargs[k] for k in self.kw_names}
        leaves, spec = tree_flatten((args, kwargs))
        if spec != self.treespec:
            raise ValueError(
                f"replay inputs have another structure than at capture (container types, lengths or dict keys "
                f"and their order): captured {self.treespec}, got {spec}; pass the captured structure or clear_graphs()"
            )
        return leaves

    def prepare(self, args: tuple, kwargs: dict) -> list[tuple[_Tensor, torch.Tensor]] | tuple[()]:
        """Validate every input, then copy staged ones into their static buffers.

        Returns the (slot, caller tensor) pairs whose static buffer the model writes
        into: :meth:`copy_back` brings those writes to the caller after the replay.
        """
        # the replay hot path: written out flat (every call level costs on every step)
        if self._positional and not kwargs and len(args) == self.nargs:
            leaves: Any = args  # the common call: positional leaves only
        else:
            leaves = self.leaves(args, kwargs)
        try:  # fast path: every tensor where and as it was at capture
            for i, ptr, shape, stride, dtype in self._fast:
                t = leaves[i]
                if t.data_ptr() != ptr or t.shape != shape or t.stride() != stride or t.dtype != dtype:
                    self._check_moved(leaves)
                    break
        except AttributeError:  # a tensor leaf is no tensor now
            self._check_moved(leaves)
        if self.values:
            self._check_values(leaves)
        if self._staged:
            # below autograd: a static buffer is the wrapper's, never part of the caller's autograd graph
            with torch._C._AutoDispatchBelowADInplaceOrView():
                for s in self._staged:
                    s.static.copy_(leaves[s.index])
            if self._written:
                return [(s, leaves[s.index]) for s in self._written]
        return ()

    def validate(self, args: tuple, kwargs: dict) -> Any:
        """Check every input against the capture (no copy); returns the call's leaves."""
        leaves = self.leaves(args, kwargs)
        for s in self.tensors:
            t = leaves[s.index]
            if not isinstance(t, torch.Tensor) or (t.data_ptr(), t.shape, t.stride(), t.dtype) != (
                s.ptr, s.shape, s.stride, s.dtype
            ):
                self._check_moved(leaves)
                break
        self._check_values(leaves)
        return leaves

    def _check_values(self, leaves: Any) -> None:
        for i, name, value in self.values:
            new = leaves[i]
            if new is not value and not same_value(new, value):
                same_type = type(new) is type(value) and isinstance(value, _VALUE_TYPES)
                was, now = (repr(value), repr(new)) if same_type else (_describe(value), _describe(new))
                raise ValueError(
                    f"input {name} was {was} at capture and is {now} now; a graph replays "
                    "what it captured, so pass changing values as tensors, key them into the BatchDescriptor, "
                    "or clear_graphs()"
                )

    @staticmethod
    def copy_back(written: list[tuple[_Tensor, torch.Tensor]]) -> None:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            for s, t in written:
                t.copy_(s.static)

    def _check_moved(self, leaves: Any) -> None:
        new_tensors = []
        for s in self.tensors:
            t = leaves[s.index]
            if not isinstance(t, torch.Tensor):
                raise ValueError(
                    f"input {s.name} was a tensor {tuple(s.shape)} {s.dtype} at capture and is {_describe(t)} now; "
                    "pass a tensor of the captured shape or clear_graphs()"
                )
            new_tensors.append(t)
            if t.shape != s.shape or t.dtype != s.dtype or t.device != s.device:
                raise ValueError(
                    f"input {s.name} moved and no longer fits what the graph captured: captured {tuple(s.shape)} {s.dtype} on "
                    f"{s.device}, got {tuple(t.shape)} {t.dtype} on {t.device}; pass a tensor of the captured shape, "
                    "dtype and device, or clear_graphs() and capture again"
                )
            if s.static is None and (t.data_ptr() != s.ptr or t.stride() != s.stride):
                raise ValueError(
                    f"input {s.name} is a persistent buffer the graph reads in place, and it moved: captured at "
                    f"{s.ptr:#x} with strides {s.stride}, got {t.data_ptr():#x} with strides {t.stride()}; pass the "
                    "captured buffer, or clear_graphs() and capture again"
                )
        groups = _storage_groups(new_tensors)
        if groups != self.groups:
            k = next(k for k, (a, b) in enumerate(zip(groups, self.groups)) if a != b)
            now, then = groups[k] != k, self.groups[k] != k
            other = self.tensors[groups[k] if now else self.groups[k]].name
            raise ValueError(
                f"inputs {other} and {self.tensors[k].name} "
                + ("share memory now but did not at capture" if now and not then else
                   "shared memory at capture but do not now" if then and not now else
                   "share memory in another pattern than at capture")
                + "; a graph replays the captured aliasing: pass inputs aliased as at capture or clear_graphs()"
            )


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
