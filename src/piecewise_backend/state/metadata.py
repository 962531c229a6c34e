"""What the state ops read each step: which copy of which slot every token's request uses.

Every state tensor holds **two copies** of each slot, ``(2 * copies, *shape)`` with ``copies =
num_slots + 1`` (slot ``num_slots`` is scratch). A step reads each request's current copy and
writes the new state into the other one, never into what it read; the engine then flips which
copy is current (:meth:`~piecewise_backend.state.StateCache.commit`). So an op that runs twice in
one step (a warm-up, the capture-time run of a break on garbage, then the replay) computes from
the same old state every time, and only a committed step changes what the next one reads.

The per-token input :data:`STATE_INDEX` holds the flat row (``copy * copies + slot``) each
token's request reads; its write row is :func:`write_rows`. Padding tokens read and write the
scratch slot. The state ops (:mod:`.conv`, :mod:`.delta`, ...) take it from the forward context's
``state_metadata`` (:func:`current_state_metadata`), each through one :class:`StateOpCall`: look up
the state, refuse inputs that do not fit it, run the step (:func:`apply_state_op`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NoReturn

import torch

from ..attention.backends import capturing
from ..context import current_forward_context
from ..modes import CUDAGraphMode

#: Name of the per-token input the state cache adds to a runner.
STATE_INDEX = "state_index"


@dataclasses.dataclass
class StateMetadata:
    """One step's state inputs: a view of the runner's ``state_index`` buffer, and the state tensors.

    Only tensors and lists of tensors: a graph keeps what it read at capture.
    """

    state_index: torch.Tensor  # (tokens,) long: flat row of the copy each token's request reads
    states: list[torch.Tensor]  # per state (StateCache.specs order): (2 * copies, *shape)


def current_state_metadata(op: str) -> StateMetadata:
    """The forward context's ``state_metadata``, or a RuntimeError naming ``op`` and how to provide it."""
    ctx = current_forward_context()
    meta = getattr(ctx, "state_metadata", None)
    if not isinstance(meta, StateMetadata):
        raise RuntimeError(
            f"{op} needs a StateMetadata as `state_metadata` in the forward context (got {type(meta).__name__}); "
            "run the model through a GraphRunner with a StateCache's context_fn, or under "
            "pb.set_forward_context(state_metadata=state_cache.metadata(...))"
        )
    return meta


def one_token_per_request(op: str, device: torch.device) -> bool:
    """Whether the op runs its graph form (one token per request, no host read): inside a FULL step.

    Captured in any other mode, the op sits inside a PIECEWISE segment, where it can neither read the
    step's request boundaries nor assume one token per request: the model was not split at it.
    """
    ctx = current_forward_context()
    if ctx is not None and ctx.runtime_mode == CUDAGraphMode.FULL:
        return True
    if capturing(device):
        raise RuntimeError(
            f"{op} is being captured inside a PIECEWISE graph segment: the model was not split at it (compiled "
            "without the piecewise backend, or Dynamo fell back to running it uncompiled, e.g. at "
            "torch._dynamo.config.recompile_limit); a state op runs per request at a break, or inside FULL graphs"
        )
    return False


def state_tensor(meta: StateMetadata, state: int, op: str) -> torch.Tensor:
    """State tensor number ``state`` of ``meta``, or a ValueError naming how many there are."""
    if not 0 <= state < len(meta.states):
        raise ValueError(f"{op}: state {state} out of range; the state cache holds {len(meta.states)} states")
    return meta.states[state]


def write_rows(read: torch.Tensor, total_rows: int) -> torch.Tensor:
    """The rows a step writes for the rows it reads: the same slot's other copy."""
    half = total_rows // 2
    return torch.remainder(read + half, total_rows)


def runs(index: torch.Tensor, scratch: int) -> list[tuple[int, int, int]]:
    """``(read row, first token, tokens)`` of each request of an eager step (one host read).

    Tokens are laid out request after request and two requests of a step never share a slot,
    so each run of equal rows is one request; runs of the scratch slot (padding) are left out.
    """
    values = index.tolist()
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            if values[start] != scratch:
                out.append((values[start], start, i - start))
            start = i
    return out


#: ``(tokens or None, gathered states) -> (outputs, new states)``: an op's one-token-per-request form on the
#: tokens at ``tokens`` (None: all of them).
StepFn = Callable[[torch.Tensor | None, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
#: ``(one request's tokens, its state) -> (outputs, new state)``: an op's whole-sequence form.
SequenceFn = Callable[[slice, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def pick(t: torch.Tensor | None, tokens: torch.Tensor | None) -> torch.Tensor | None:
    """The rows ``tokens`` of a per-token tensor (all of it for None; None stays None)."""
    return t if t is None or tokens is None else t.index_select(0, tokens)


def apply_state_op(op: str, index: torch.Tensor, states: torch.Tensor, out: torch.Tensor,
                   step: StepFn, sequence: SequenceFn) -> None:
    """Run one state op over a step: read each token's state row (``index``: the metadata's
    ``state_index``), write the other copy, fill ``out`` (``(tokens, ...)``).

    Inside a FULL step every token is one request's: gather, ``step``, scatter, no host read. Otherwise
    (one host read of ``read``) each prefilling request runs ``sequence`` from its own state, so nothing
    flows between the requests of a row, the decoding requests run ``step`` together, and padding
    tokens get zeros.
    """
    tokens = out.shape[0]
    if index.shape[0] < tokens:
        raise ValueError(f"{op}: {tokens} tokens but state metadata for {index.shape[0]}")
    read, rows = index[:tokens], states.shape[0]
    if one_token_per_request(op, out.device):
        y, new = step(None, states.index_select(0, read))
        states.index_copy_(0, write_rows(read, rows), new.to(states.dtype))
        out.copy_(y)
        return
    out.zero_()
    half = rows // 2
    singles: list[tuple[int, int]] = []
    for row, start, count in runs(read, scratch=half - 1):
        if count == 1:
            singles.append((row, start))
            continue
        part = slice(start, start + count)
        y, new = sequence(part, states[row])
        states[(row + half) % rows].copy_(new)
        out[part] = y
    if singles:
        read_rows = torch.tensor([r for r, _ in singles], device=out.device)
        at = torch.tensor([t for _, t in singles], device=out.device)
        y, new = step(at, states.index_select(0, read_rows))
        states.index_copy_(0, write_rows(read_rows, rows), new.to(states.dtype))
        out.index_copy_(0, at, y)


class StateOpCall:
    """One call of a state op in the current step: the op's name, the rows the step reads (the
    metadata's ``state_index``) and the state tensor the op advances, ``(2 * copies, *slot shape)``.

    What every state op does around its kernels, once: :meth:`current` looks the state up,
    :meth:`refuse` and :meth:`require_positive` reject inputs with the op's name in the message,
    :meth:`run` runs the step (:func:`apply_state_op`). A plain slotted class, not a dataclass: it is
    made at every eager call of every state layer (a frozen dataclass cost three times as much).
    """

    __slots__ = ("op", "index", "states")

    def __init__(self, op: str, index: torch.Tensor, states: torch.Tensor):
        self.op, self.index, self.states = op, index, states

    @classmethod
    def current(cls, op: str, state: int) -> StateOpCall:
        """``op``'s call on state number ``state`` of the forward context's ``state_metadata``."""
        meta = current_state_metadata(op)
        return cls(op, meta.state_index, state_tensor(meta, state, op))

    @property
    def slot_shape(self) -> torch.Size:
        """The shape of one slot's state (what the op's inputs must fit)."""
        return self.states.shape[1:]

    def refuse(self, inputs: str, layout: str) -> NoReturn:
        """ValueError: the inputs (``inputs`` says what they are) do not fit the state, which must be ``layout``."""
        raise ValueError(f"{self.op}: {inputs}; the state holds {tuple(self.slot_shape)}, it must be {layout}")

    def require_positive(self, name: str, value: int) -> None:
        """ValueError naming ``name`` unless ``value`` >= 1 (a chunk or block length)."""
        if value < 1:
            raise ValueError(f"{self.op}: {name} must be >= 1, got {value}")

    def run(self, out: torch.Tensor, step: StepFn, sequence: SequenceFn) -> None:
        """Fill ``out`` and advance the state: :func:`apply_state_op` with this call's rows and state."""
        apply_state_op(self.op, self.index, self.states, out, step, sequence)
