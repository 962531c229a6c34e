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
  waits on from the host: inside a capture they are refused with a clear error.

Tensor subclasses (DTensor, AsyncCollectiveTensor) are not recorded: the recorder returns
``NotImplemented`` for them so they desugar into the plain ops it does record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map_only

FUNCTIONAL_NAMESPACE = "_c10d_functional"
NAMESPACES = frozenset({FUNCTIONAL_NAMESPACE, "c10d"})  # the recorder hands ops of these here
_PASS_THROUGH = ("wait_tensor", "_wrap_tensor_autograd")

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


def dispatch_subclass(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """The recorder's answer for a dispatch that carries tensor subclasses (``types`` not plain).

    Fake tensors (DTensor's sharding propagation runs ops on them) hold no data: run them
    unrecorded. Any other subclass (DTensor, AsyncCollectiveTensor) gets ``NotImplemented``
    and desugars into the plain ops the recorder then sees.
    """
    if any(issubclass(t, FakeTensor) for t in types):
        return func(*args, **kwargs)
    return NotImplemented


def has_subclass(types: Any) -> bool:
    """True when ``types`` holds a tensor subclass (it may list plain ``torch.Tensor`` too)."""
    return any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types)


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
        meta = func(*tree_map_only(torch.Tensor, _to_meta, args), **tree_map_only(torch.Tensor, _to_meta, kwargs))

        def allocate(m: torch.Tensor) -> torch.Tensor:
            t = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device)
            t.untyped_storage().fill_(0xFF)  # NaN bits: nothing was communicated yet
            return register(t)

        out = tree_map_only(torch.Tensor, allocate, meta)
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
