"""Non-owning ("weak") tensors: views of memory that do not keep it allocated.

A captured graph reads and writes fixed addresses in its pool; the pool, not the tensors that
happened to be allocated during the capture, owns that memory. An entry that kept those tensors
alive would pin pool blocks, so no later capture could reuse them and graph memory would grow
with every captured size. Entries keep weak tensors instead: same address, shape, strides and
dtype, but a storage that frees nothing (``torch._C._construct_storage_from_data_pointer``,
as Inductor's CUDA graph trees do; pure PyTorch, no extension).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

if not hasattr(torch._C, "_construct_storage_from_data_pointer"):  # pragma: no cover - torch < 2.1
    raise ImportError(
        f"piecewise_backend needs torch._C._construct_storage_from_data_pointer (torch >= 2.1), "
        f"torch {torch.__version__} lacks it"
    )

_WEAK_ATTR = "_pb_weak"
_keep_strong = [False]


@contextlib.contextmanager
def strong_references() -> Iterator[None]:
    """For benchmarks: entries captured inside keep their capture-time tensors strongly, as
    before they held weak views, so the memory that saves can be measured side by side (the
    graphs themselves still pin nothing, as CUDA graphs do not)."""
    saved, _keep_strong[0] = _keep_strong[0], True
    try:
        yield
    finally:
        _keep_strong[0] = saved


def keep_strong() -> bool:
    return _keep_strong[0]


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``t``'s memory without owning it.

    Reading it after the owner's memory was freed or reused reads whatever is there now, as
    on a GPU: keep the owner (the graph pool) alive as long as the view is used.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"weak_ref_tensor needs a torch.Tensor, got {type(t).__name__}")
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise TypeError(f"weak_ref_tensor needs a plain tensor, got the subclass {type(t).__name__}")
    storage = t.untyped_storage()
    # ``set_`` below is an in-place op on a fresh tensor: keep it out of autograd and of any
    # dispatch mode a capture has open (the result must be exactly this memory, not a copy).
    with torch._C._DisableTorchDispatch(), torch.no_grad():
        weak_storage = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
        with torch.inference_mode(t.is_inference()):
            weak = torch.empty(0, dtype=t.dtype, device=t.device)
            weak.set_(weak_storage, t.storage_offset(), t.size(), t.stride())
    setattr(weak, _WEAK_ATTR, True)
    return weak


def is_weak(t: Any) -> bool:
    """True for a tensor made by :func:`weak_ref_tensor` (or a pool's weak view)."""
    return isinstance(t, torch.Tensor) and getattr(t, _WEAK_ATTR, False)


def mark_weak(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _WEAK_ATTR, True)
    return t


def weak_ref_tensors(tree: Any) -> Any:
    """``tree`` with every tensor leaf replaced by :func:`weak_ref_tensor` of it."""
    return tree_map(lambda x: weak_ref_tensor(x) if isinstance(x, torch.Tensor) else x, tree)
