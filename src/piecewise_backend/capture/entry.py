"""GraphEntry: what one (mode, descriptor) captured, and how it replays under the replay contract.

A replay returns what eager would return for the same call or raises a clear error;
it never writes into a tensor the caller owns, returns a fresh container every time,
and leaves grad mode as it found it (design.md 4.4).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..inputs import InputSpec, mark_persistent
from ..platforms.base import Graph
from .session import EagerSegment


class _InferenceOnly(torch.autograd.Function):
    """Marks a replay output: its backward raises (a replay records no autograd history)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise RuntimeError(
            "backward() reached the output of a CUDA graph replay: replays are inference-only (the graph "
            "ran captured kernels and recorded no autograd history); compute gradients with an eager call "
            "(no forward context, or runtime mode NONE)"
        )


_ANCHOR = torch.zeros((), requires_grad=True)


def _rebuild_needed(output: Any) -> bool:
    # A bare tensor or a tuple of tensors cannot be mutated by the caller: return it as is.
    if isinstance(output, torch.Tensor) or output is None:
        return False
    return not (type(output) is tuple and all(isinstance(o, torch.Tensor) for o in output))


class GraphEntry:
    """Segments to replay (graphs and breaks), the input spec with its static buffers, the output.

    Stored tensors: ``spec.tensors[i].captured`` (persistent inputs the graph reads in place),
    ``spec.tensors[i].static`` / ``static_inputs`` (wrapper-owned buffers of staged inputs),
    ``output`` / ``output_leaves`` (what a replay returns).
    """

    __slots__ = ("segments", "spec", "output", "output_leaves", "output_spec", "_rebuild", "inference",
                 "requires_grad", "_guard_grad")

    def __init__(self, segments: list[Graph | EagerSegment], spec: InputSpec, output: Any, grad_touched: bool = True):
        self.segments, self.spec = segments, spec
        # Only a break (Python) can change grad mode during a replay: without one that did at capture,
        # the replay skips saving and restoring it.
        self._guard_grad = grad_touched
        leaves, self.output_spec = tree_flatten(output)
        self.requires_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)
        if self.requires_grad:  # the capture's autograd graph describes a run on garbage: drop it
            leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
            output = tree_unflatten(leaves, self.output_spec)
        self.output, self.output_leaves = output, leaves
        self._rebuild = _rebuild_needed(output)
        # Capture-time tensors may be inference tensors: replay under the same mode to write them.
        self.inference = torch.is_inference_mode_enabled()
        # Graph memory stays where it is: a later graph may read these outputs in place.
        mark_persistent(*(t for t in leaves if isinstance(t, torch.Tensor)))

    @property
    def num_graphs(self) -> int:
        return sum(not isinstance(s, EagerSegment) for s in self.segments)

    @property
    def inputs(self) -> list[torch.Tensor]:
        """The tensors the graph reads, in leaf order: static copies of staged inputs, persistent buffers as they are."""
        return [s.static if s.static is not None else s.captured for s in self.spec.tensors]

    @property
    def static_inputs(self) -> list[torch.Tensor]:
        """Wrapper-owned buffers the graph reads for staged inputs."""
        return self.spec.static_inputs

    def check_inputs(self, args: tuple, kwargs: dict) -> None:
        """Validate a call against the capture (no copy). :meth:`replay` does this itself."""
        self.spec.validate(args, kwargs)

    def replay(self, args: tuple, kwargs: dict) -> Any:
        """Validate and stage the inputs, replay every segment, return a fresh output container."""
        written = self.spec.prepare(args, kwargs)
        if self._guard_grad or (self.inference and not torch.is_inference_mode_enabled()):
            self.run()
        else:
            for seg in self.segments:
                seg.replay()
        if written:
            self.spec.copy_back(written)
        if self._rebuild or self.requires_grad:
            return self.result()
        return self.output

    def run(self) -> None:
        """Replay the segments as they are (no input step); grad mode is restored afterwards."""
        grad = torch.is_grad_enabled()
        try:
            if self.inference and not torch.is_inference_mode_enabled():
                with torch.inference_mode():
                    for seg in self.segments:
                        seg.replay()
            else:
                for seg in self.segments:
                    seg.replay()
        finally:
            if torch.is_grad_enabled() is not grad:
                torch._C._set_grad_enabled(grad)

    def result(self) -> Any:
        if self.requires_grad and torch.is_grad_enabled():
            leaves = [_InferenceOnly.apply(t, _ANCHOR) if isinstance(t, torch.Tensor) else t for t in self.output_leaves]
            return tree_unflatten(leaves, self.output_spec)
        if self._rebuild:
            return tree_unflatten(list(self.output_leaves), self.output_spec)
        return self.output
