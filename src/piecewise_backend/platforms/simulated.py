"""Simulated platform: CUDA graph semantics on the CPU, for tests and CI.

A segment records the ATen ops run while it is open (a TorchDispatchMode) and replays
them into the same tensors. Like a real capture, recording does not count as running:
when a segment ends, in-place writes to tensors that existed before it are undone and
tensors it allocated are filled with garbage (NaN bits), so only a replay produces values.
Host syncs raise as CUDA does while a stream is capturing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import fresh_outputs, sim_collectives

_HOST_SYNC = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}
_DATA_DEPENDENT_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_NO_REPLAY = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided"}


_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _data_dependent(func: Any, args: tuple) -> bool:
    # Indexing with integer tensors has a static output shape (fine under CUDA capture); with masks it does not.
    if func._schema.name in _INDEX_OPS:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)
    return True


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Op:
    __slots__ = ("func", "args", "kwargs", "fresh")

    def __init__(self, func: Any, args: tuple, kwargs: dict, fresh: list[tuple[int, torch.Tensor]]):
        self.func, self.args, self.kwargs, self.fresh = func, args, kwargs, fresh


class SimulatedGraph:
    def __init__(self, ops: list[_Op]):
        self.ops = ops

    def replay(self) -> None:
        # The ops were recorded below autograd; replay them there too, as a CUDA graph replay
        # never touches autograd (in grad mode, autograd's view checks reject the replayed writes).
        with torch._C._AutoDispatchBelowADInplaceOrView():
            for op in self.ops:
                out = op.func(*op.args, **op.kwargs)
                if op.fresh:
                    outs = out if isinstance(out, (tuple, list)) else (out,)
                    for i, captured in op.fresh:
                        captured.copy_(outs[i])

    def __len__(self) -> int:
        return len(self.ops)


class _RecordingMode(TorchDispatchMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile trace and compile under an open segment, as it can under a CUDA capture.
        return True

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.allocated: dict[int, torch.Tensor] = {}  # storage key -> a tensor on it
        self.snapshots: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if sim_collectives.has_subclass(types):  # DTensor & co: record the plain ops they desugar into
            return sim_collectives.dispatch_subclass(func, types, args, kwargs or {})
        kwargs = kwargs or {}
        if func.namespace in sim_collectives.NAMESPACES:
            out, collective = sim_collectives.record(func, args, kwargs, len(self.ops))
            if collective is not None:
                self.ops.append(_Op(collective.replay, (), {}, []))
                for t in collective.outputs:
                    self.allocated.setdefault(_storage_key(t), t)
            return out
        if func in _HOST_SYNC or (any(tag in func.tags for tag in _DATA_DEPENDENT_TAGS) and _data_dependent(func, args)):
            raise RuntimeError(
                f"operation not permitted when stream is capturing: {func} needs the host to read device "
                "data (a sync or a data-dependent shape); move it out of the captured region"
            )
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
                for t in tree_leaves(value):
                    if isinstance(t, torch.Tensor):
                        self._snapshot(t)
        out = func(*args, **kwargs)
        fresh = fresh_outputs(args, kwargs, out if isinstance(out, (tuple, list)) else [out])
        for _, t in fresh:
            self.allocated.setdefault(_storage_key(t), t)
        # Decide by real storage, not the schema: under inference_mode composite ops such as
        # contiguous/reshape reach the mode whole, and their "alias" result may be a copy.
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if (writes or fresh) and schema.name not in _NO_REPLAY:
            self.ops.append(_Op(func, args, kwargs, fresh))
        return out

    def _snapshot(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key not in self.allocated and key not in self.snapshots:
            storage = t.untyped_storage()
            self.snapshots[key] = (storage, storage.clone())


class _SimRecorder:
    def __init__(self, platform: SimulatedPlatform) -> None:
        self.platform = platform
        self.mode = _RecordingMode()
        self.mode.__enter__()
        self.open = True

    def end(self) -> SimulatedGraph:
        self._close()
        for storage, saved in self.mode.snapshots.values():
            storage.copy_(saved)  # a capture does not execute: undo writes to older tensors
        for t in self.mode.allocated.values():
            t.untyped_storage().fill_(0xFF)  # NaN for floats, -1 for ints: memory holds garbage
        graph = SimulatedGraph(self.mode.ops)
        self.platform.recorded_ops += len(graph)
        return graph

    def abort(self) -> None:
        self._close()
        for storage, saved in self.mode.snapshots.values():
            storage.copy_(saved)

    def _close(self) -> None:
        if self.open:
            self.open = False
            self.mode.__exit__(None, None, None)


class SimulatedPlatform:
    name = "simulated"

    def __init__(self) -> None:
        self.recorded_ops = 0

    @contextlib.contextmanager
    def capture_scope(self) -> Iterator[None]:
        yield

    def begin(self) -> _SimRecorder:
        return _SimRecorder(self)

    def memory(self) -> int:
        return self.recorded_ops

    def describe(self, amount: int) -> str:
        return f"{amount} ATen ops recorded"
