"""CUDA's capture rules on the simulated platform: what a real capture refuses, and what it allows.

* Host reads. While a stream captures, CUDA refuses every copy of device memory to the host
  ("operation not permitted when stream is capturing"). ``.item()``, ``bool(t)``, ``int(t)``
  reach the dispatcher (``aten._local_scalar_dense``) and the recorder refuses them there. Other
  reads never reach it: ``.tolist()`` and ``.numpy()`` read memory from C++, printing a tensor
  even hides from dispatch modes. So, while a segment records on a thread, those Tensor methods
  are guarded, for that thread only.
* Data-dependent shapes are host syncs too, except where CUDA's kernel takes the size from the
  caller: ``repeat_interleave(..., output_size=)``.
* Ops whose CPU kernel reads data on the host where CUDA's does not (``one_hot`` checks its
  values with ``.item()`` on the CPU only) are recorded as CUDA's kernel computes them.
* Random ops: a CUDA graph advances the default generator's state on every replay; a
  ``torch.Generator`` the graph was not given raises at capture time (CUDAGeneratorImpl.cpp
  of torch 2.11; 2.13 still registers only the default generator in ``capture_begin``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

aten = torch.ops.aten

HOST_SYNC = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
}
_DATA_DEPENDENT_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
_REPEAT_INTERLEAVE = {
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
    aten.repeat_interleave.Tensor_out,
}


def raise_host_sync(what: str) -> NoReturn:
    raise RuntimeError(
        f"operation not permitted when stream is capturing: {what} needs the host to read device "
        "data (a sync or a data-dependent shape); move it out of the captured region, "
        "or into a break (a pb.eager_break function runs eagerly between graph segments)"
    )


def is_host_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` makes the host wait for device data under CUDA, as called here."""
    if func in HOST_SYNC:
        return True
    if func in _REPEAT_INTERLEAVE:  # CUDA sums the repeats on the host unless the caller gives the output size
        return kwargs.get("output_size") is None
    if func is aten.one_hot.default:
        return _num_classes(args, kwargs) < 0  # CUDA reads max() on the host to count the classes
    if not any(tag in func.tags for tag in _DATA_DEPENDENT_TAGS):
        return False
    if func._schema.name in _INDEX_OPS:
        # Indexing with integer tensors has a static output shape (fine under CUDA capture); with masks it does not.
        masks = (torch.bool, torch.uint8)
        return any(isinstance(i, torch.Tensor) and i.dtype in masks for i in args[1] if i is not None)
    return True


def _num_classes(args: tuple, kwargs: dict) -> int:
    return args[1] if len(args) > 1 else kwargs.get("num_classes", -1)


def _one_hot(t: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    # CUDA's kernel (aten/src/ATen/native/Onehot.cpp): no value checks on the host, the
    # scatter asserts on the device instead.
    if t.dtype != torch.long:
        raise RuntimeError(f"one_hot is only applicable to index tensor of type LongTensor, got {t.dtype}")
    if num_classes < 1:
        raise RuntimeError(f"num_classes should be positive, got {num_classes}")
    out = torch.zeros((*t.shape, num_classes), dtype=t.dtype, device=t.device)
    if t.numel():
        out.scatter_(-1, t.unsqueeze(-1), 1)
    return out


CUDA_KERNELS: dict[Any, Callable[..., Any]] = {aten.one_hot.default: _one_hot}
"""Ops whose CPU kernel reads data on the host where CUDA's does not: run CUDA's algorithm instead."""


# ---------------------------------------------------------------- random ops


@functools.cache
def _generator_args(func: Any) -> tuple[tuple[int, str], ...]:
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments) if "Generator" in str(a.type))


def check_generator(func: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a random op drawing from a generator other than the default one, as CUDA does."""
    for i, name in _generator_args(func):
        g = kwargs.get(name) if name in kwargs or i >= len(args) else args[i]
        if g is not None and g._cdata != torch.default_generator._cdata:
            raise RuntimeError(
                f"Attempt to increase offset for a CUDA generator not in capture mode: {func} draws from a "
                "torch.Generator that the graph does not own. A CUDA graph advances only the default "
                "generator on each replay (others must be registered with the graph, and the platform "
                "registers none); draw from the default generator (seed it with torch.manual_seed), or "
                "draw outside the captured region (before the forward or in a break point)"
            )


# ---------------------------------------------------------------- reads that bypass the dispatcher


_watching = threading.local()


def _watcher() -> Any:
    watcher = getattr(_watching, "watcher", None)
    if watcher is not None:
        return watcher
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if hasattr(mode, "on_host_read"):
            return mode
    return None


@contextlib.contextmanager
def watching_host_reads(watcher: Any) -> Iterator[None]:
    """Report this thread's guarded reads to ``watcher.on_host_read`` for the duration, wherever
    they happen: also inside an op a dispatch mode runs with itself popped (hf's adapter probe)."""
    guard_host_reads()
    previous, _watching.watcher = getattr(_watching, "watcher", None), watcher
    try:
        yield
    finally:
        _watching.watcher = previous
        unguard_host_reads()


def _guarded(method: str, what: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        mode = _watcher()
        if mode is not None:
            mode.on_host_read(self, method, what)  # the recorder raises; hf's adapter probe takes note
        return original(self, *args, **kwargs)

    return torch.compiler.disable(guarded)  # never traced: Dynamo keeps its own handling of these methods


# (class, attribute, the read as code names it, the read as an error message says it)
_GUARDED = (
    (torch.Tensor, "tolist", "Tensor.tolist", "Tensor.tolist()"),
    (torch.Tensor, "numpy", "Tensor.numpy", "Tensor.numpy() (or numpy.asarray(tensor))"),
    (torch.Tensor, "__repr__", "Tensor.__repr__", "printing a tensor (repr/str/format)"),
)
_MISSING = object()
_lock = threading.Lock()
_users = 0
_saved: list[tuple[type, str, Any]] = []


def guard_host_reads() -> None:
    """Guard the reads that bypass the dispatcher; balanced by :func:`unguard_host_reads`.

    The guards are installed while anyone watches (a segment records, in any thread; hf's adapter
    probes a model) and tell the calling thread's watcher (:func:`watching_host_reads`), else the
    innermost dispatch mode with an ``on_host_read(tensor, method, what)`` method; other threads
    and code outside read as usual.
    """
    global _users
    with _lock:
        _users += 1
        if _users == 1:
            for cls, attr, method, what in _GUARDED:
                original = cls.__dict__.get(attr, _MISSING)
                _saved.append((cls, attr, original))
                setattr(cls, attr, _guarded(method, what, getattr(cls, attr)))


def unguard_host_reads() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            for cls, attr, original in reversed(_saved):
                if original is _MISSING:
                    delattr(cls, attr)
                else:
                    setattr(cls, attr, original)
            _saved.clear()
