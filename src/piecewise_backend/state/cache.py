"""The per-request state cache of state-space and linear-attention layers, beside the paged KV cache.

A request holds one **slot** for its whole life; every state layer keeps that slot's conv state
and recurrent / SSM state (:class:`StateSpec`: the shapes the model declares). Slots come from a
:class:`SlotAllocator`, exact and atomic like :class:`~piecewise_backend.kv.BlockAllocator`.
Each slot has two copies (:mod:`.metadata`): a step reads the current one and writes the other,
and :meth:`StateCache.commit` makes the written copy current once the step has succeeded, so a
state op that runs more than once in a step (warm-up, capture, replay) cannot apply its update
twice, and a failed step changes nothing.

The cache adds one per-token input, :data:`~.metadata.STATE_INDEX`, to a
:class:`~piecewise_backend.GraphRunner` (:meth:`StateCache.static_inputs`): graphs read the slots
in place through it, and padding tokens read and write the scratch slot, never a request's.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..runner.static_inputs import StaticInput
from .metadata import STATE_INDEX, StateMetadata


class SlotAllocator:
    """A free list of ``num_slots`` state slots: exact (every slot free or handed out, never both)."""

    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
            raise ValueError(f"SlotAllocator.num_slots must be a positive int, got {num_slots!r}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """One free slot; RuntimeError (nothing changed) when none is left."""
        if not self._free:
            raise RuntimeError(f"out of state slots: all {self.num_slots} are held by requests")
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Take ``slot`` back; ValueError (nothing changed) if it is not handed out."""
        is_id = isinstance(slot, int) and not isinstance(slot, bool)
        if not is_id or slot not in self._used:
            why = ("already free (double free)" if is_id and 0 <= slot < self.num_slots
                   else f"not a slot of this allocator (0..{self.num_slots - 1})")
            raise ValueError(f"SlotAllocator.free: slot {slot!r} is {why}; only slots allocate() handed out can be freed")
        self._used.discard(slot)
        self._free.append(slot)


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One state of one layer: ``shape`` per request (``conv``: (channels, kernel - 1); ``recurrent``:
    (heads, key_dim, value_dim), ...), kept in ``dtype``."""

    layer: int
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"StateSpec.layer must be an int >= 0, got {self.layer!r}")
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"StateSpec.kind must be a non-empty str such as 'conv', got {self.kind!r}")
        if not isinstance(self.shape, tuple) or any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"StateSpec {self.kind!r} of layer {self.layer}: shape must be a tuple of ints >= 0, got {self.shape!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"StateSpec {self.kind!r} of layer {self.layer}: dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def bytes_per_slot(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class StateCache:
    """The states of every state layer for ``num_slots`` requests (plus a scratch slot), two copies each.

    ``specs`` fix the order of :attr:`states` (the ops name a state by its index there). Requests
    are any hashable ids: :meth:`allocate` gives one a zeroed slot, :meth:`free` takes it back.
    """

    def __init__(self, specs: Sequence[StateSpec], *, num_slots: int, device: torch.device | str = "cpu"):
        specs = list(specs)
        bad = [s for s in specs if not isinstance(s, StateSpec)]
        if bad:
            raise TypeError(f"StateCache specs must be StateSpecs, got {bad[0]!r}")
        keys = [(s.layer, s.kind) for s in specs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"StateCache: each (layer, kind) once; got {keys}")
        self.allocator = SlotAllocator(num_slots)
        self.specs = specs
        self.num_slots = num_slots
        self.copies = num_slots + 1  # rows per copy: the slots and the scratch slot
        self.scratch = num_slots
        self._device = torch.device(device)
        self.states = [torch.zeros((2 * self.copies, *s.shape), dtype=s.dtype, device=device) for s in specs]
        self.slots: dict[Hashable, int] = {}
        self._current = [0] * num_slots  # which copy of each slot is current

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def memory_bytes(self) -> int:
        """Bytes of every state tensor (both copies of every slot and of the scratch slot)."""
        return sum(t.numel() * t.element_size() for t in self.states)

    @property
    def bytes_per_request(self) -> int:
        """Bytes one request's slot holds in one copy (what a request's context costs, at any length)."""
        return sum(s.bytes_per_slot for s in self.specs)

    def index(self, layer: int, kind: str) -> int:
        """Position of ``(layer, kind)`` in :attr:`specs` (the ``state`` argument of its op)."""
        for i, s in enumerate(self.specs):
            if (s.layer, s.kind) == (layer, kind):
                return i
        raise KeyError(f"no {kind!r} state for layer {layer}; the cache holds {[(s.layer, s.kind) for s in self.specs]}")

    def allocate(self, request: Hashable) -> int:
        """Give ``request`` a slot whose current copy is zeros (a new request's state); returns it."""
        if request in self.slots:
            raise ValueError(f"request {request!r} already holds state slot {self.slots[request]}")
        slot = self.allocator.allocate()
        self._current[slot] = 0
        for t in self.states:
            t[slot].zero_()
        self.slots[request] = slot
        return slot

    def free(self, request: Hashable) -> None:
        """Return ``request``'s slot; KeyError naming the live requests when it holds none."""
        if request not in self.slots:
            raise KeyError(f"request {request!r} holds no state slot; live requests: {list(self.slots)}")
        self.allocator.free(self.slots.pop(request))

    def read_row(self, request: Hashable) -> int:
        """The flat row ``request``'s current state is at (in every tensor of :attr:`states`)."""
        slot = self.slots[request]
        return self._current[slot] * self.copies + slot

    def state(self, request: Hashable, i: int) -> torch.Tensor:
        """``request``'s current copy of state ``i`` (a view)."""
        return self.states[i][self.read_row(request)]

    def static_inputs(self) -> list[StaticInput]:
        """The per-token input for a GraphRunner: padding tokens read the scratch slot's first copy."""
        return [StaticInput(STATE_INDEX, pad=self.scratch)]

    def step_inputs(self, chunks: Sequence[tuple[Hashable, int, int]]) -> dict[str, torch.Tensor]:
        """The state inputs of one step from ``(request, first position, number of tokens)`` per request.

        Requests without a slot get one (a new request, zeroed): all of them or, when slots run out,
        none (RuntimeError, nothing allocated).
        """
        requests = [c[0] for c in chunks]
        new = [r for r in dict.fromkeys(requests) if r not in self.slots]
        if len(new) > self.allocator.num_free:
            raise RuntimeError(
                f"out of state slots: {len(new)} new requests {new}, {self.allocator.num_free} of "
                f"{self.num_slots} free; nothing was allocated"
            )
        for r in new:
            self.allocate(r)
        rows: list[int] = []
        for request, _, count in chunks:
            rows += [self.read_row(request)] * count
        return {STATE_INDEX: torch.tensor(rows, dtype=torch.long, device=self.device)}

    def commit(self, requests: Iterable[Hashable]) -> None:
        """After a successful step: the copies it wrote become current for ``requests`` (its requests)."""
        requests = list(requests)
        missing = [r for r in requests if r not in self.slots]
        if missing:
            raise KeyError(f"commit: requests {missing} hold no state slot; live requests: {list(self.slots)}")
        for r in requests:
            slot = self.slots[r]
            self._current[slot] ^= 1

    def poison_free(self, value: float = float("nan")) -> None:
        """Fill both copies of every free slot with ``value`` (tests: prove nothing reads them)."""
        free = [s for s in range(self.num_slots) if s not in self.slots.values()]
        for t in self.states:
            for s in free:
                t[s].fill_(value)
                t[s + self.copies].fill_(value)

    def metadata(self, views: Mapping[str, torch.Tensor]) -> StateMetadata:
        """The state metadata over ``views`` (a runner's views, or :meth:`step_inputs` for eager use)."""
        return StateMetadata(views[STATE_INDEX], self.states)

    def context_fn(self, views: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """A GraphRunner ``context_fn``: the step's forward-context attributes."""
        return {"state_metadata": self.metadata(views)}
