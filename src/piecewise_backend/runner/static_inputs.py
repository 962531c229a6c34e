"""StaticInput, and how a step's tensors reach a GraphRunner's persistent buffers.

A graph reads fixed addresses, so every input lives in a buffer allocated once: per-token
inputs have one row per token of the largest capture size, per-request inputs one row per
request (``max_num_reqs``). A step copies its tensors into the buffers' leading corner and
fills everything else with the input's ``pad``: the model sees the declared shape on every
step, graph or eager, and never a previous step's data.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

PER_VALUES = ("token", "request")


@dataclasses.dataclass(frozen=True)
class StaticInput:
    """One model input: ``(rows, *shape)`` of ``dtype``; rows and columns without data hold ``pad``.

    ``per="token"``: one row per token (padded to the captured size). ``per="request"``:
    one row per request, always ``max_num_reqs`` rows. A tensor narrower than ``shape`` is
    padded with ``pad`` in every mode; a wider one cannot fit and the step runs eagerly.

    ``request_row=True`` (per-token integer inputs, ``pad=0``): each value is a row of the
    per-request inputs (a token's request). A micro-batched step gives each half only its own
    requests' rows, so the runner rebases these values per half; ``debug_checks`` checks them.
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.long
    pad: int | float = 0
    per: str = "token"
    request_row: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(
                "StaticInput.name must be a str that is a Python identifier, "
                f"got {self.name!r} ({type(self.name).__name__})"
            )
        shape = self.shape
        if not isinstance(shape, (tuple, list)) or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in shape
        ):
            raise ValueError(
                f"StaticInput {self.name!r}: shape is the dims after the token (or request) dim, a tuple of "
                f"positive ints such as () or (4,); got {shape!r}"
            )
        object.__setattr__(self, "shape", tuple(shape))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"StaticInput {self.name!r}: dtype must be a torch.dtype such as torch.float32, got {self.dtype!r}"
            )
        if self.per not in PER_VALUES:
            raise ValueError(f"StaticInput {self.name!r}: per must be 'token' or 'request', got {self.per!r}")
        _check_pad(self.name, self.pad, self.dtype)
        if not isinstance(self.request_row, bool):
            raise TypeError(f"StaticInput {self.name!r}: request_row must be True or False, got {self.request_row!r}")
        if self.request_row and (
            self.per != "token" or self.dtype.is_floating_point or self.dtype.is_complex or self.dtype == torch.bool
            or self.pad != 0
        ):
            raise ValueError(
                f"StaticInput {self.name!r}: request_row=True marks a per-token integer input holding rows of the "
                f"per-request inputs, padded with row 0 (the first row of every micro-batch half); got "
                f"per={self.per!r}, dtype={self.dtype}, pad={self.pad!r}"
            )
        # What every step's checks read (GraphRunner.run), computed once: not fields (repr, ==, replace skip them).
        object.__setattr__(self, "ndim", len(self.shape) + 1)
        object.__setattr__(self, "floating", self.dtype.is_floating_point)
        object.__setattr__(self, "per_token", self.per == "token")


def check_request_rows(
    spec: StaticInput, value: torch.Tensor, lo: int, hi: int, first: int = 0, where: str = ""
) -> None:
    """Under ``debug_checks``: every value of a ``request_row`` input lies in ``lo..hi-1``, or a clear error.

    ``value`` holds the step's tokens from token ``first``; ``where`` says which tokens those are.
    """
    bad = (value < lo) | (value >= hi)
    if bool(bad.any()):
        token = int(bad.reshape(bad.shape[0], -1).any(-1).nonzero()[0, 0])
        raise IndexError(
            f"GraphRunner.run (debug_checks): input {spec.name!r} (request_row=True) holds request row "
            f"{value[token].tolist()} at token {first + token}{where}; valid rows are {lo}..{hi - 1}. Its values "
            "index the step's per-request inputs (rows 0..R-1 of the whole step; the runner rebases them for "
            "each micro-batch half, which sees only its own requests)"
        )


def _check_pad(name: str, pad: Any, dtype: torch.dtype) -> None:
    where = f"StaticInput {name!r}: pad {pad!r}"
    if not isinstance(pad, (int, float)):
        raise TypeError(f"{where} must be a Python int or float that {dtype} can hold")
    if dtype == torch.bool:
        if pad not in (0, 1):
            raise ValueError(f"{where} does not fit torch.bool: use False/True (0/1)")
    elif dtype.is_floating_point:
        if not math.isfinite(pad) or abs(pad) > torch.finfo(dtype).max:
            raise ValueError(f"{where} must be finite and within +-{torch.finfo(dtype).max:g} for {dtype}")
    elif not dtype.is_complex:
        info = torch.iinfo(dtype)
        if isinstance(pad, float) and not pad.is_integer() or not info.min <= pad <= info.max:
            raise ValueError(f"{where} does not fit {dtype}: use an integer in [{info.min}, {info.max}]")


def check_tensor(spec: StaticInput, value: Any) -> torch.Tensor:
    """``value`` as a step tensor for ``spec``, or a clear error."""
    if (
        not isinstance(value, torch.Tensor)
        or value.dim() != len(spec.shape) + 1
        or value.is_floating_point() != spec.dtype.is_floating_point
    ):
        _bad_tensor(spec, value)
    return value


def _bad_tensor(spec: StaticInput, value: Any) -> None:
    rows = "tokens" if spec.per == "token" else "requests"
    want = f"({rows}{''.join(f', {d}' for d in spec.shape)})"
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"GraphRunner.run: input {spec.name!r} must be a torch.Tensor of shape {want}, got "
            f"{type(value).__name__}; a graph replays tensors at fixed addresses, so opaque objects (lists, "
            "caches) cannot be inputs: keep their tensors in StaticInputs"
        )
    if value.dim() != len(spec.shape) + 1:
        raise ValueError(
            f"GraphRunner.run: input {spec.name!r} has shape {tuple(value.shape)}, its StaticInput wants {want}"
        )
    raise ValueError(f"GraphRunner.run: input {spec.name!r} is {value.dtype}, its StaticInput is {spec.dtype}")


def fits(spec: StaticInput, value: torch.Tensor) -> bool:
    """True when ``value``'s non-leading dims fit the static shape."""
    return all(a <= b for a, b in zip(value.shape[1:], spec.shape))


def fill(buf: torch.Tensor, value: torch.Tensor, rows: int, pad: int | float) -> None:
    """Write ``value`` into the corner of ``buf[:rows]`` and ``pad`` everywhere else in it."""
    n = value.shape[0]
    if value.shape[1:] == buf.shape[1:]:  # the common case: one copy, pad only the padding rows
        buf[:n].copy_(value)
        if rows > n:
            buf[n:rows].fill_(pad)
    else:
        buf[:rows].fill_(pad)
        buf[(slice(0, n), *(slice(0, d) for d in value.shape[1:]))].copy_(value)


def eager_tensor(spec: StaticInput, value: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """What an eager step passes for ``value``: the same dtype, width and row count a graph step sees."""
    if value.shape[0] == rows and value.shape[1:] == spec.shape:
        if value.dtype == spec.dtype and value.device == device:
            return value  # the common case: the caller's tensor as it is, as an eager call would get it
        return value.to(device=device, dtype=spec.dtype)
    shape = tuple(max(a, b) for a, b in zip(value.shape[1:], spec.shape))
    out = torch.empty((rows, *shape), dtype=spec.dtype, device=device)
    fill(out, value, rows, spec.pad)
    return out


_PLAIN = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device, torch.Tensor)


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
    if depth < 8:
        for sub_path, sub in items:
            yield from context_leaves(sub, sub_path, depth + 1)


def check_plain(attrs: Mapping[str, Any], source: str) -> None:
    """Refuse objects a graph replay cannot account for (a transformers ``DynamicCache``, a generator).

    Plain: Python scalars, strings, enums, dtypes, devices, tensors, and tuples, lists,
    dicts and dataclasses of those. Anything else holds state a graph captured once and
    never sees change.
    """
    for key, value in attrs.items():
        for path, leaf in context_leaves(value, key):
            if not isinstance(leaf, _PLAIN):
                raise TypeError(
                    f"GraphRunner: {source} {path!r} is a {type(leaf).__name__}; a graph replays what it read at "
                    "capture and cannot see an object's state change. Pass tensors (persistent ones: StaticInputs "
                    "and context_fn over the step's views), plain Python values, or dataclasses of those"
                )


def step_counts(batch: Mapping[str, torch.Tensor], specs: Mapping[str, StaticInput]) -> tuple[int, int | None]:
    """The token count and the request count (None without per-request inputs) a step's inputs agree on."""
    tokens = reqs = None
    for name, t in batch.items():
        rows = t.shape[0]
        if specs[name].per == "token":
            if tokens is None:
                tokens = rows
            elif rows != tokens:
                _disagree(batch, specs, "token")
        elif reqs is None:
            reqs = rows
        elif rows != reqs:
            _disagree(batch, specs, "request")
    return tokens, reqs  # type: ignore[return-value]  # a runner has at least one per-token input


def _disagree(batch: Mapping[str, torch.Tensor], specs: Mapping[str, StaticInput], per: str) -> None:
    counts = {name: t.shape[0] for name, t in batch.items() if specs[name].per == per}
    raise ValueError(f"GraphRunner.run: per-{per} inputs disagree on the {per} count: {counts}")


def check_context(context: Any, replays: bool) -> dict:
    """A step's extra forward-context attributes; opaque values refused when graphs may replay."""
    if context is None:
        return {}
    if not isinstance(context, Mapping) or not all(isinstance(k, str) for k in context):
        raise TypeError(f"GraphRunner.run: context must be a dict of attribute names to values, got {context!r}")
    if replays:
        check_plain(context, "context")
    return dict(context)


def check_full_context(context: Mapping[str, Any], buffer_storages: set[int]) -> None:
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


class ContextPrint:
    """What a FULL graph baked in of a step's forward-context attributes, and a fast check of a later step's.

    ``tensors`` is :func:`context_tensors` of the capture-time attributes (what the error compares).
    A step's check walks the attributes once without building paths: the same structure (container
    types, keys, lengths, fields) and the same tensor objects at the same address, shape, strides and
    dtype pass at once; anything else gets the exact path-by-path comparison, and when that passes the
    new objects are remembered (a capture's views and a step's are different objects of the same memory).
    """

    __slots__ = ("tensors", "_structure", "_leaves")

    def __init__(self, attrs: Mapping[str, Any]) -> None:
        attrs = dict(attrs)
        self.tensors = context_tensors(attrs)
        self._remember(attrs)

    def _remember(self, attrs: Mapping[str, Any]) -> None:
        structure: list[Any] = []
        leaves: list[torch.Tensor] = []
        _walk(attrs, structure, leaves, 0)
        self._structure = structure
        self._leaves = [(t, t.data_ptr(), t.shape, t.stride(), t.dtype) for t in leaves]

    def check(self, attrs: Mapping[str, Any], desc: Any) -> None:
        """``attrs`` holds the tensors the graph of ``desc`` captured, or a clear error."""
        if type(attrs) is not dict:
            attrs = dict(attrs)
        structure: list[Any] = []
        leaves: list[torch.Tensor] = []
        _walk(attrs, structure, leaves, 0)
        known = self._leaves
        if structure == self._structure and len(leaves) == len(known):
            for t, (was, ptr, shape, stride, dtype) in zip(leaves, known):
                if t is not was or t.data_ptr() != ptr or t.shape != shape or t.stride() != stride or t.dtype != dtype:
                    break
            else:
                return
        check_captured_context(self.tensors, context_tensors(attrs), desc)
        self._remember(attrs)


_FIELDS: dict[type, Callable[[Any], tuple] | None] = {}  # a type -> its dataclass fields' getter (None: not one)
_UNSEEN = object()


def _fields_getter(value: Any) -> Callable[[Any], tuple]:
    """A function returning ``value``'s dataclass fields as a tuple, in field order (one C call)."""
    names = [f.name for f in dataclasses.fields(value)]
    if not names:
        return lambda _: ()
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else lambda v: (get(v),)


def _walk(value: Any, structure: list[Any], leaves: list[torch.Tensor], depth: int) -> None:
    """What :func:`context_leaves` visits below ``value`` (a container), flat: the tensors in order, and every
    container, key, field and leaf kind in ``structure`` (equal structures give equal paths)."""
    kind = type(value)
    if isinstance(value, (tuple, list)):
        items: Any = value
        structure += (kind, len(value))
    elif kind is dict:
        structure.append(dict)
        structure.extend(value)
        items = value.values()
    else:
        structure.append(kind)
        items = _FIELDS[kind](value)  # type: ignore[misc]
    if depth >= 8 + 1:  # context_leaves' depth limit, counted from the attributes' own dict
        return
    for v in items:  # leaves inline: a call per leaf would cost more than the check itself
        if isinstance(v, torch.Tensor):
            structure.append(True)
            leaves.append(v)
            continue
        if isinstance(v, (tuple, list)) or type(v) is dict:
            _walk(v, structure, leaves, depth + 1)
            continue
        names = _FIELDS.get(type(v), _UNSEEN)
        if names is _UNSEEN:
            is_instance = dataclasses.is_dataclass(v) and not isinstance(v, type)
            names = _FIELDS[type(v)] = _fields_getter(v) if is_instance else None
        if names is None:
            structure.append(None)  # a leaf that is not a tensor
        else:
            _walk(v, structure, leaves, depth + 1)


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


def input_names(field: str, given: Sequence[str] | None, names: list[str], default: list[str]) -> list[str]:
    """The input names a GraphRunner passes as ``field`` (model_args or model_kwargs), checked."""
    if given is None:
        return list(default)
    if isinstance(given, str) or not all(isinstance(a, str) for a in given):
        raise TypeError(f"{field} must be a list of input names, got {given!r}")
    unknown = [a for a in given if a not in names]
    if unknown:
        raise ValueError(f"{field} {unknown} are not among the inputs {names}")
    return list(given)
