"""Simulated platform: CUDA graph semantics on the CPU, for tests and CI.

A segment records the ATen ops run while it is open (a TorchDispatchMode) and replays
them into the same tensors. One mode stays on the thread's mode stack for the whole capture
(:class:`_Slot`) and the segments switch inside it, so state restores that put a saved mode
stack back (the autograd engine's, around every backward node) keep recording into the
segment the capture has open. An op implemented in Python (a ``torch.library`` custom op
such as an attention kernel, or a composite decomposition) is not recorded as a whole: its
implementation runs with the recorder active, so the ATen ops inside it are recorded,
recursively, and a replay runs no Python at all, as a CUDA graph replays kernels, not the
code that launched them. Ops with C++ kernels are recorded whole, like ATen ops. Like a
real capture, recording does not count as running: when a segment ends,
in-place writes to tensors that existed before it are undone and tensors it allocated are
filled with garbage (NaN bits), so only a replay produces values. Host reads raise as CUDA
does while a stream is capturing, inside custom ops too, and random ops follow CUDA's
generator rules (:mod:`.rules`). Work the recorder cannot see
(fused Inductor kernels, anything that bypasses the dispatcher) is refused at capture
time by the checks in :mod:`.checks`.
Tensors created during a capture come from one shared pool (:mod:`.pool`); a finished
graph holds them only weakly. What the recorder does with each op (record it, run it inside,
refuse a host read) is decided in :mod:`.classify` (``OpKind``, ``classify``, re-exported here).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

from ...observability import timed_phase
from ..base import fresh_outputs
from . import checks
from . import collectives as sim_collectives
from . import rules as sim_rules
from .checks import FIX_HIDDEN, refuse, validate_segment
from .classify import OpKind, classify, is_composite
from .pool import PoolMode, SimPool

_HOST_FROM_DATA = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_BELOW_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _kernel_keys(args: tuple, kwargs: dict) -> torch._C.DispatchKeySet:
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            keys = keys | torch._C._dispatch_keys(t)
    return keys & _BELOW_PYTHON


class _Op:
    __slots__ = ("func", "args", "kwargs", "fresh")

    def __init__(self, func: Any, args: tuple, kwargs: dict, fresh: list[tuple[int, torch.Tensor]]):
        self.func, self.args, self.kwargs, self.fresh = func, args, kwargs, fresh


class SimulatedGraph:
    """The ATen ops of one segment, replayed in order on the capture-time tensors."""

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


class _Slot(TorchDispatchMode):
    """The one dispatch mode a simulated capture keeps on its thread's mode stack, from the
    capture's start to its end; segments come and go inside it (``current``: the open segment's
    recorder; None between segments, in a break, where ops pass through unrecorded).

    One object for the whole capture, because code that restores the thread's dispatch state
    puts back the stack it saved: the autograd engine runs each backward node under the state
    of the ``backward()`` call and restores the caller's when the node returns. A break inside a
    node (a custom ``autograd.Function.backward`` calling an ``eager_break`` function) ends one
    segment and opens the next; with a recorder pushed per segment, the restore would drop the
    new recorder and put the ended one back on top. The slot survives every restore, and the
    segment it points to is the one the capture has open, as a CUDA stream's capture is.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.current: _RecordingMode | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        current = self.current
        if current is None:
            return func(*args, **(kwargs or {}))
        return current.__torch_dispatch__(func, types, args, kwargs)

    def on_host_read(self, t: torch.Tensor, method: str, what: str) -> None:
        if self.current is not None:
            self.current.on_host_read(t, method, what)


class _RecordingMode(TorchDispatchMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile trace and compile under an open segment, as it can under a CUDA capture.
        return True

    def __init__(self, platform: SimulatedPlatform) -> None:
        super().__init__()
        self.platform = platform
        self.record_inside_ops, self.check = platform.record_inside_ops, platform.validate
        self.ops: list[_Op] = []
        self.allocated: dict[int, torch.Tensor] = {}  # storage key -> a tensor on it
        self.snapshots: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        # A capture does not advance the default generator: CUDA's graph-safe generator moves on replays only.
        self.rng = torch.get_rng_state()

    def on_host_read(self, t: torch.Tensor, method: str, what: str) -> None:
        """A read that bypasses the dispatcher (``.tolist()``, printing; rules.py guards them):
        refused like ``.item()`` where it copies device memory."""
        if not t.is_meta and not is_fake(t) and not self.platform.is_host_scalar(t):
            sim_rules.raise_host_sync(what)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if sim_collectives.unrecorded(types, args, kwargs):  # DTensor desugars first; fake/meta: no data
            return sim_collectives.dispatch_unrecorded(func, types, args, kwargs or {})
        kwargs = kwargs or {}
        kind = classify(func, args, kwargs)
        if kind is OpKind.HOST_SYNC:
            if not self.platform.is_host_scalar(args[0]):
                sim_rules.raise_host_sync(str(func))
            return func(*args, **kwargs)
        if self.check:
            checks.check_caller(func)  # looked up here: a test may patch it
        if kind is OpKind.CUDA_KERNEL:
            with self:
                return sim_rules.CUDA_KERNELS[func](*args, **kwargs)
        sim_rules.check_generator(func, args, kwargs)
        if func.namespace in sim_collectives.NAMESPACES:  # recorded, not run: replays communicate
            out, collective = sim_collectives.record(func, args, kwargs, len(self.ops), self.register_fresh)
            if collective is not None:
                self.ops.append(_Op(collective.replay, (), {}, []))
            return out
        if func in _HOST_FROM_DATA:
            self.platform.mark_host(args[0])
        self._snapshot_writes(func, args, kwargs)
        if kind is OpKind.OPAQUE and self.record_inside_ops:
            return self._run_inside(func, args, kwargs)
        out = func(*args, **kwargs)
        if kind is OpKind.ALLOCATION:
            out = self.register_fresh(out)
            _garbage(out)  # fresh memory holds garbage, for eager and replay alike
            return out
        single = not isinstance(out, (tuple, list))
        outs = [out] if single else list(out)
        fresh = fresh_outputs(args, kwargs, outs)
        if fresh:
            fresh = [(i, self.register_fresh(t)) for i, t in fresh]
            for i, t in fresh:
                outs[i] = t
            out = outs[0] if single else type(out)(outs)
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        # Decide by real storage, not the schema: under inference_mode composite ops such as
        # contiguous/reshape reach the mode whole, and their "alias" result may be a copy.
        if writes or fresh:
            self.ops.append(_Op(func, args, kwargs, fresh))
        return out

    def register_fresh(self, t: torch.Tensor) -> torch.Tensor:
        """The one place a tensor allocated during the segment is registered.

        Returns the tensor the program gets from now on (and a replay writes into); a
        memory pool may hand back its own tensor holding the same values.
        """
        self.allocated.setdefault(_storage_key(t), t)
        return t

    def _run_inside(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # Run the op's implementation with this mode active again (dispatch popped it), so
        # the ATen ops it runs, and those of any op it calls, are recorded one by one.
        with self:
            if is_composite(func.name()):
                out = func.decompose(*args, **kwargs)
            else:
                out = func.redispatch(_kernel_keys(args, kwargs), *args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else [out]
        for _, t in fresh_outputs(args, kwargs, outs):
            if _storage_key(t) not in self.allocated:
                refuse(
                    f"{func} returned a tensor that no recorded ATen op produced (its kernel allocates or "
                    "writes behind the dispatcher, or it returns a tensor made outside the op)",
                    FIX_HIDDEN + ", and return only tensors the op computes",
                )
        return out

    def _snapshot_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
                for t in tree_leaves(value):
                    if isinstance(t, torch.Tensor):
                        self._snapshot(t)

    def _snapshot(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key not in self.allocated and key not in self.snapshots:
            storage = t.untyped_storage()
            self.snapshots[key] = (storage, storage.clone())

    def restore(self) -> None:
        """Tensors that existed before the segment, and the default generator, as they were."""
        with torch._C._DisableTorchDispatch():  # the simulator's own writes: no mode (the pool's) sees them
            for storage, saved in self.snapshots.values():
                storage.copy_(saved)
        torch.set_rng_state(self.rng)

    def undo(self) -> None:
        """Back to what a capture leaves: older tensors as they were, new ones garbage."""
        self.restore()
        for t in self.allocated.values():
            _garbage(t)


def _garbage(t: torch.Tensor) -> None:
    """NaN bits for floats, -1 for ints: what memory a capture did not execute holds. In place, with no
    dispatch mode seeing it: the simulator's own write, not the program's (a pool mode around the capture
    would only pass it through, at the cost of a mode call per tensor)."""
    with torch._C._DisableTorchDispatch():
        t.untyped_storage().fill_(0xFF)


def is_recording() -> bool:
    """True while the simulated platform records a segment on this thread (an op then runs inside
    a simulated capture, where reading device values on the host is illegal)."""
    return any(
        isinstance(m, _RecordingMode) or (isinstance(m, _Slot) and m.current is not None)
        for m in _get_current_dispatch_mode_stack()
    )


class _SimRecorder:
    def __init__(self, platform: SimulatedPlatform) -> None:
        self.platform = platform
        self.mode = _RecordingMode(platform)
        # The slot of this thread's capture scope; a segment begun outside one gets a slot of its own.
        self.slot, self._own_slot = platform._scope_slot(), False
        if self.slot is None:
            self.slot, self._own_slot = _Slot(), True
            self.slot.__enter__()
        self._previous, self.slot.current = self.slot.current, self.mode
        sim_rules.guard_host_reads()
        self.open = True

    def end(self) -> SimulatedGraph:
        self._close()
        graph = SimulatedGraph(self.mode.ops)
        if self.platform.validate:
            # The check's replay neither allocates from the pool nor communicates.
            with self.platform.pool_paused(), sim_collectives.validating(), timed_phase("checks"):
                validate_segment(self.mode, graph)  # raises, leaving the capture undone, if unfaithful
        self.mode.undo()  # a capture does not execute
        self.platform.pool.weaken_ops(graph.ops)  # the graph pins no pool memory
        self.platform.recorded_ops += len(graph)
        return graph

    def abort(self) -> None:
        self._close()
        self.mode.restore()

    def _close(self) -> None:
        if self.open:
            self.open = False
            sim_rules.unguard_host_reads()
            self.slot.current = self._previous
            if self._own_slot:
                self.slot.__exit__(None, None, None)


class SimulatedPlatform:
    name = "simulated"

    def __init__(self) -> None:
        self.recorded_ops = 0
        self.pool = SimPool()  # every graph shares it, as on CUDA
        self._pool_mode: PoolMode | None = None  # set while a capture scope is open
        # Knobs for benchmarks and debugging only: the defaults are what makes the simulator faithful.
        self.record_inside_ops = True  # False: record a custom op whole and re-run its Python on replay
        self.validate = True  # False: skip the checks that refuse unrecordable work (checks.py)
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> tensor (weak: never keep it alive)
        self._slots = threading.local()  # .slot: the recording slot of this thread's open capture scope

    @contextlib.contextmanager
    def capture_scope(self) -> Iterator[None]:
        self._pool_mode = PoolMode(self.pool)
        previous = getattr(self._slots, "slot", None)
        try:
            with self._pool_mode:  # segments and the breaks between them allocate in the pool
                with _Slot() as slot:  # every segment of the capture records through it (see _Slot)
                    self._slots.slot = slot
                    yield
        finally:
            self._slots.slot = previous
            self._pool_mode = None

    def _scope_slot(self) -> _Slot | None:
        return getattr(self._slots, "slot", None)

    @contextlib.contextmanager
    def pool_paused(self) -> Iterator[None]:
        mode = self._pool_mode
        if mode is None:
            yield
            return
        paused, mode.paused = mode.paused, True
        try:
            yield
        finally:
            mode.paused = paused

    def owns(self, t: torch.Tensor) -> bool:
        return self.pool.owns(t)

    def owner_test(self, pool: SimPool | None = None) -> Callable[[torch.Tensor], bool]:
        """A test "was this tensor allocated in the shared pool (or ``pool``)?": the pool's own bookkeeping."""
        return self.owns if pool is None else pool.owns

    def weak_ref(self, t: torch.Tensor, pool: SimPool | None = None) -> torch.Tensor:
        """A weak view of the pool tensor ``t`` (:meth:`SimPool.weak`): it keeps no block alive."""
        return (self.pool if pool is None else pool).weak(t)

    def release_cached(self) -> int:
        """Give back the shared pool's wholly free segments; returns the bytes."""
        return self.pool.release_cached()

    @contextlib.contextmanager
    def fresh_pool(self) -> Iterator[SimPool]:
        """Captures allocate from a new shared pool meanwhile; yields it. The pool before is shared again
        afterwards; the scratch pool keeps only the memory still viewed."""
        saved, self.pool = self.pool, SimPool()
        try:
            yield self.pool
        finally:
            self.pool = saved

    def warmup_scope(self) -> contextlib.AbstractContextManager[None]:
        """Warm-ups run where they are (no streams, no per-stream state on the CPU)."""
        return contextlib.nullcontext()

    def warmed_step(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def warm_up(self, fn: Callable[..., Any], args: tuple, kwargs: dict, times: int) -> None:
        """Nothing to warm: a simulated capture needs no per-stream state (CUDA's does)."""

    def new_pool(self) -> SimPool:
        """A private graph pool (a ``pb.BreakableGraph`` of its own): captures use it inside :meth:`capturing_into`."""
        return SimPool()

    @contextlib.contextmanager
    def capturing_into(self, pool: SimPool, stream: Any = None, capture_error_mode: str = "global") -> Iterator[None]:
        """Around one capture: it allocates from ``pool`` instead of the shared one. No streams on the CPU:
        ``stream`` must be None; ``capture_error_mode`` changes nothing (one capture runs at a time)."""
        if not isinstance(pool, SimPool):
            raise TypeError(f"the simulated platform captures into a SimPool, got {type(pool).__name__}")
        if stream is not None:
            raise ValueError(f"the simulated platform has no CUDA streams: capture with stream=None, got {stream!r}")
        shared, self.pool = self.pool, pool
        try:
            with self.capture_scope():
                yield
        finally:
            self.pool = shared

    def pool_memory(self, pool: SimPool) -> int:
        """Bytes ``pool`` holds."""
        return pool.reserved()

    def begin(self) -> _SimRecorder:
        return _SimRecorder(self)

    def memory(self) -> int:
        return self.pool.reserved()

    def describe(self, amount: int) -> str:
        return f"{amount / 2**20:.2f} MiB of simulated graph pool ({self.recorded_ops} ATen ops recorded in all)"

    def mark_host(self, t: torch.Tensor) -> None:
        """``t`` was made from Python data (``torch.tensor(x)``): on a GPU machine it lives on the host."""
        if t.dim() == 0:
            key = id(t)
            self._host[key] = weakref.ref(t, lambda _: self._host.pop(key, None))

    def is_host_scalar(self, t: Any) -> bool:
        # Dynamo (dynamic=True) lifts float attributes such as RMSNorm.eps to 0-d CPU tensors and
        # reads them with .item() inside the graph: a host read under a real capture, not a sync.
        ref = self._host.get(id(t))
        return ref is not None and ref() is t
