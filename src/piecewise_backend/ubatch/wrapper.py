"""UBatchWrapper: runs a micro-batched step in two threads, or captures it as one FULL graph.

A step is micro-batched when its forward context carries ``ubatch_slices`` (two
:class:`UBatchSlice`, built by the GraphRunner): each half runs the model in its own thread
with its own forward context. Under a FULL runtime mode the whole overlapped step (both
halves, in the order their threads ran, collectives included) is captured as one graph and
replayed without threads. A step without ``ubatch_slices`` runs as it would without
micro-batching: a FULL graph per descriptor (``runtime_mode=FULL``) or eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture.wrappers import CUDAGraphWrapper, GraphWrapper
from ..config import CompilationConfig
from ..context import BatchDescriptor, current_forward_context, set_forward_context
from ..modes import CUDAGraphMode
from ..platforms.registry import config_platform_name
from .threads import DEFAULT_TIMEOUT_S, NUM_UBATCHES, UBatchThreads

_NONE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.FULL


@dataclasses.dataclass(frozen=True)
class UBatchSlice:
    """One half of a micro-batched step: its arguments (views of the step's), its forward
    context (``batch_descriptor`` and attributes such as its attention metadata) and its
    token rows (every per-token output of the half has this many rows)."""

    args: tuple
    kwargs: dict
    batch_descriptor: BatchDescriptor
    attrs: dict
    num_tokens: int


def combine_outputs(outputs: list[Any], slices: list[UBatchSlice]) -> Any:
    """The halves' outputs as one step's: per-token tensors concatenated in half order."""
    flat = [tree_flatten(o) for o in outputs]
    if any(spec != flat[0][1] for _, spec in flat):
        raise ValueError(
            f"micro-batched step: the halves returned different structures ({[str(s) for _, s in flat]}); "
            "the model must return the same structure for any batch"
        )
    leaves = []
    for i, parts in enumerate(zip(*(leaves for leaves, _ in flat))):
        rows = [s.num_tokens for s in slices]
        if not all(isinstance(p, torch.Tensor) and p.dim() and p.shape[0] == r for p, r in zip(parts, rows)):
            raise ValueError(
                f"micro-batched step: output {i} is not one row per token in each half (rows {rows}, got "
                f"{[tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__ for p in parts]}); "
                "a micro-batched model returns per-token tensors only"
            )
        leaves.append(torch.cat(parts))
    return tree_unflatten(leaves, flat[0][1])


class UBatchWrapper(GraphWrapper):
    """Micro-batching wrapper; ``runtime_mode`` FULL (graphs of whole steps) or NONE (eager).

    ``timeout_s``: how long a micro-batched step may take before it fails (nothing waits forever).
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        config: CompilationConfig | None,
        runtime_mode: CUDAGraphMode | str = _NONE,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        super().__init__(runnable, runtime_mode, config)
        self.timeout_s = timeout_s
        self.threads = UBatchThreads()
        self.last_order: list[int] = []  # which half ran each turn of the last threaded run
        full = self.runtime_mode == _FULL
        # Plain (not micro-batched) FULL steps, and micro-batched ones: both keyed by the step's descriptor.
        self.full = CUDAGraphWrapper(runnable, _FULL, config=self.config) if full else None
        self.split = CUDAGraphWrapper(self._run_halves, _FULL, config=self.config) if full else None
        self._split_rows: dict[BatchDescriptor, tuple[int, ...]] = {}

    @property
    def runtime_mode(self) -> CUDAGraphMode:
        return self._runtime_mode

    @runtime_mode.setter
    def runtime_mode(self, mode: CUDAGraphMode | str) -> None:
        mode = CUDAGraphMode.parse(mode) if mode is not None else mode
        if mode not in (_NONE, _FULL):
            raise ValueError(f"UBatchWrapper runtime_mode must be NONE or FULL, got {getattr(mode, 'name', mode)}")
        self._runtime_mode = mode
        self._mode_mask = 1 << _FULL.value if mode == _FULL else 0

    @property
    def ubatch_entries(self) -> dict[BatchDescriptor, Any]:
        """Captured graphs of micro-batched steps (both halves in one graph), by step descriptor."""
        return self.split.entries if self.split is not None else {}

    @property
    def entries(self) -> dict[BatchDescriptor, Any]:
        return self.full.entries if self.full is not None else {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = current_forward_context()
        slices = getattr(ctx, "ubatch_slices", None) if ctx is not None else None
        if slices is None:
            return self.full(*args, **kwargs) if self.full is not None else self.runnable(*args, **kwargs)
        if len(slices) != NUM_UBATCHES or not all(isinstance(s, UBatchSlice) for s in slices):
            raise ValueError(f"ubatch_slices must be {NUM_UBATCHES} UBatchSlice, got {slices!r}")
        if ctx.runtime_mode == _FULL and self.split is not None:
            desc, rows = ctx.batch_descriptor, tuple(s.num_tokens for s in slices)
            known = self._split_rows.get(desc) if desc in self.split.entries else None  # none without a graph
            if known is not None and known != rows:
                raise ValueError(
                    f"UBatchWrapper: {desc} was captured micro-batched with halves of {known} "
                    f"tokens, this step has {rows}; a FULL micro-batched step must split every step of a "
                    "descriptor the same way (GraphRunner splits uniform decode batches in the middle)"
                )
            out = self.split(*args, **kwargs)
            if desc in self.split.entries:  # recorded only once its capture succeeded
                self._split_rows[desc] = rows
            return out
        return self._run_halves(*args, **kwargs)

    def _run_halves(self, *args: Any, **kwargs: Any) -> Any:
        """Both halves in their threads, turn by turn; ``args`` (the whole step's) are not used:
        the halves' are views of them (a graph captured here reads the step's buffers)."""
        ctx = current_forward_context()
        slices = list(ctx.ubatch_slices)
        mode = ctx.runtime_mode if ctx.runtime_mode == _FULL else _NONE
        jobs = [self._job(i, s, mode) for i, s in enumerate(slices)]
        cuda = config_platform_name(self.config) == "cuda"  # the simulator's steps keep no streams
        outputs, self.last_order = self.threads.run(jobs, self.timeout_s, streams=cuda)
        return combine_outputs(outputs, slices)

    def _job(self, index: int, piece: UBatchSlice, mode: CUDAGraphMode) -> Callable[[], Any]:
        def run() -> Any:
            with set_forward_context(mode, piece.batch_descriptor, ubatch_index=index, **piece.attrs):
                return self.runnable(*piece.args, **piece.kwargs)

        return run

    def _count(self) -> int:
        return sum(len(w.captured()) for w in (self.full, self.split) if w is not None)

    def drop(self, mode: CUDAGraphMode | str, descriptor: BatchDescriptor) -> bool:
        """Drop the graphs of ``descriptor`` in ``mode``, the plain and the micro-batched one; True when
        there was one."""
        dropped = [w.drop(mode, descriptor) for w in (self.full, self.split) if w is not None]
        if CUDAGraphMode.parse(mode) == _FULL:
            self._split_rows.pop(descriptor, None)
        return any(dropped)

    def clear_graphs(self) -> None:
        """Drop every captured entry, micro-batched or not."""
        for w in (self.full, self.split):
            if w is not None:
                w.clear_graphs()
        self._split_rows.clear()

    def __repr__(self) -> str:
        return f"UBatchWrapper({self.runtime_mode.name}, entries={self._count()}, runnable={self.runnable!r})"
