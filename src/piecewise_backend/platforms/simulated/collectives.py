"""Collectives and tensor subclasses under the simulated platform (the recorder calls in here).

What a CUDA graph does with NCCL: a collective reached during capture is recorded, not
run, into an output buffer of the graph's pool; every replay runs it again, in recorded
order, on the same buffers. The simulator does the same with ``torch.distributed``'s
functional collectives (``_c10d_functional::*``, what DTensor and torch.compile emit):

* at capture the collective does not communicate: its result buffer is allocated from the
  op's meta shape and holds garbage (NaN bits), like any capture-time output;
* at replay the collective runs again, is waited on at once, and its result is copied into
  the capture-time buffer, which is what later ops of the graph read. Each rank replays the
  same op list, so the collectives meet in the same order on every rank;
* ``wait_tensor`` and ``_wrap_tensor_autograd`` (the AsyncCollectiveTensor wrapper, whose
  storage Python cannot read) pass through unrecorded: replay already waits;
* the eager ``c10d`` ops (``dist.all_reduce(t)`` and friends) return a ``Work`` the caller
  waits on from the host, and the in-place functional variants write into a given tensor:
  inside a capture both are refused with a clear error.

Tensor subclasses (DTensor, AsyncCollectiveTensor) are not recorded: the recorder returns
``NotImplemented`` for them so they desugar into the plain ops it does record. Fake and
meta tensors (DTensor's sharding propagation) hold no data and run unrecorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

FUNCTIONAL_NAMESPACE = "_c10d_functional"
NAMESPACES = frozenset({FUNCTIONAL_NAMESPACE, "c10d"})  # the recorder hands ops of these here
_PASS_THROUGH = ("wait_tensor", "_wrap_tensor_autograd")
_FAKE = torch._C._TorchDispatchModeKey.FAKE

# How many collectives the simulator recorded and replayed in this process (tests read it).
stats = {"recorded": 0, "replayed": 0}
_validating = False
Register = Callable[[torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def validating() -> Iterator[None]:
    """While the recorder checks a segment by replaying it, collectives do what capture did: no communication."""
    global _validating
    saved, _validating = _validating, True
    try:
        yield
    finally:
        _validating = saved


def unrecorded(types: Any, args: tuple, kwargs: dict | None) -> bool:
    """True for a dispatch the recorder must not record as it is: tensor subclasses or metadata only.

    DTensor's sharding propagation runs ops on fake and meta tensors: they hold no data.
    """
    if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
        return True
    if kwargs and str(kwargs.get("device")) == "meta":
        return True
    if torch._C._get_dispatch_mode(_FAKE) is not None:  # e.g. DTensor rebuilding tensors from metadata
        return True
    for a in (*args, *kwargs.values()) if kwargs else args:  # cheaper than pytree: this runs for every op
        if isinstance(a, torch.Tensor):
            if a.is_meta:
                return True
        elif isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.is_meta for t in a):
            return True
    return False


def dispatch_unrecorded(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """The recorder's answer when :func:`unrecorded` is true.

    Fake and meta tensors run as they are, outside the recorder. Other subclasses (DTensor,
    AsyncCollectiveTensor) get ``NotImplemented`` and desugar into plain ops, which the
    recorder then sees.
    """
    if all(t is torch.Tensor or t is torch.nn.Parameter or issubclass(t, FakeTensor) for t in types):
        with _disable_current_modes():  # the recorder may sit twice on the stack (inside a custom op)
            return func(*args, **kwargs)
    return NotImplemented


def record(func: Any, args: tuple, kwargs: dict, index: int, register: Register) -> tuple[Any, CollectiveOp | None]:
    """Run ``func`` (of :data:`NAMESPACES`) as a capture would: ``(output, op to replay or None)``.

    ``register`` is the recorder's hook for memory allocated during the segment; it returns
    the tensor the program gets (a pool may hand back its own), which replays write into.
    """
    if func.namespace == "c10d":
        raise RuntimeError(
            f"operation not permitted when stream is capturing: {func} is an eager torch.distributed "
            "collective whose Work the host waits on (a host sync inside a captured collective); inside a "
            "captured region use the functional collectives (torch.distributed._functional_collectives, "
            "DTensor, or let torch.compile trace dist.all_reduce), which the simulator records and replays"
        )
    if func._schema.name.split("::")[1] in _PASS_THROUGH:
        return func(*args, **kwargs), None
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        raise RuntimeError(
            f"{func} writes its result into a tensor it is given; the simulator records the out-of-place "
            "functional collectives (all_reduce, all_gather_into_tensor, ...) that DTensor and "
            "torch._functional_collectives emit: call those inside a simulated capture"
        )
    return CollectiveOp.record(func, args, kwargs, index, register)


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class CollectiveOp:
    """A recorded functional collective: ``replay()`` runs it again into the capture-time outputs."""

    __slots__ = ("func", "args", "kwargs", "outputs", "index")

    def __init__(self, func: Any, args: tuple, kwargs: dict, outputs: list[torch.Tensor], index: int):
        self.func, self.args, self.kwargs, self.outputs, self.index = func, args, kwargs, outputs, index

    @classmethod
    def record(cls, func: Any, args: tuple, kwargs: dict, index: int, register: Register) -> tuple[Any, CollectiveOp]:
        """Allocate the collective's result without communicating (a capture does not execute)."""
        device = next(t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        with _disable_current_modes():  # shape inference and allocation are not part of the graph
            meta = func(*tree_map_only(torch.Tensor, _to_meta, args), **tree_map_only(torch.Tensor, _to_meta, kwargs))
            fresh = tree_map_only(
                torch.Tensor, lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device), meta
            )
        for t in tree_flatten(fresh)[0]:
            t.untyped_storage().fill_(0xFF)  # NaN bits: nothing was communicated yet
        out = tree_map_only(torch.Tensor, register, fresh)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        stats["recorded"] += 1
        return out, cls(func, args, kwargs, outputs, index)

    def replay(self) -> None:
        if _validating:  # the simulator's own check of the segment: redo what the capture did
            for t in self.outputs:
                t.untyped_storage().fill_(0xFF)
            return
        stats["replayed"] += 1
        try:
            fresh = self.func(*self.args, **self.kwargs)
            results = [t for t in tree_flatten(fresh)[0] if isinstance(t, torch.Tensor)]
            for captured, result in zip(self.outputs, results):
                captured.copy_(torch.ops._c10d_functional.wait_tensor(result))
        except RuntimeError as e:
            raise RuntimeError(
                f"simulated replay of collective {self.func} (op #{self.index} of its graph) failed: a peer rank "
                "stopped, timed out, or is replaying a different graph (every rank must replay the same "
                f"descriptor in the same step; CompilationConfig(debug_checks=True) checks it): {e}"
            ) from e

    def __repr__(self) -> str:
        return f"CollectiveOp(#{self.index} {self.func})"
