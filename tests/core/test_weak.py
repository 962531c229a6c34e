"""Weak (non-owning) tensors: same memory, no ownership."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from piecewise_backend.weak import is_weak, weak_ref_tensor, weak_ref_tensors


def test_weak_tensor_views_the_same_memory_without_owning_it():
    owner = torch.arange(24, dtype=torch.float32).reshape(4, 6)[1:, 2:]  # offset and strides kept
    weak = weak_ref_tensor(owner)
    assert is_weak(weak) and not is_weak(owner)
    assert weak.data_ptr() == owner.data_ptr()
    assert (weak.shape, weak.stride(), weak.dtype) == (owner.shape, owner.stride(), owner.dtype)
    owner.add_(1)
    assert torch.equal(weak, owner)  # writes through the owner are seen: one memory
    ref = StorageWeakRef(owner.untyped_storage())
    keep = owner.untyped_storage()  # keep the memory while checking the weak view does not own it
    del owner
    assert not ref.expired()
    del keep
    assert ref.expired(), "the weak view must not keep the owner's storage alive"


def test_weak_tensors_of_a_tree_and_errors():
    a, b = torch.ones(2), torch.zeros(3, dtype=torch.long)
    out = weak_ref_tensors({"a": a, "rest": (b, 3, None)})
    assert is_weak(out["a"]) and is_weak(out["rest"][0]) and out["rest"][1:] == (3, None)
    with torch.inference_mode():
        inf = torch.ones(2)
    assert weak_ref_tensor(inf).is_inference()
    with pytest.raises(TypeError, match="needs a torch.Tensor, got list"):
        weak_ref_tensor([1])
