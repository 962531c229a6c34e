"""CUDA platform: recording one graph segment, and what an entry holds of it.

An entry holds a :class:`CudaGraphSegment`, never the ``torch.cuda.CUDAGraph`` itself: the graph
is parked in its generation (pools.py), so dropping an entry never runs ``reset()``, which
would free the capture stream's cuBLAS workspace under the other graphs of that stream.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .recovery import RULES, CaptureHost, CaptureInvalidatedError, recover

if TYPE_CHECKING:
    from .pools import Generation

_EMPTY_WARNING = "CUDA Graph is empty"


class CudaGraphSegment:
    """A captured graph as an entry holds it: ``replay()`` and ``pool()``; the graph lives in its generation."""

    __slots__ = ("graph", "replay", "__weakref__")

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph
        self.replay = graph.replay  # the bound method: no extra Python frame per replay

    def pool(self) -> tuple[int, int]:
        return tuple(self.graph.pool())

    def __repr__(self) -> str:
        return f"CudaGraphSegment(pool={self.pool()})"


class EmptyGraph:
    """A segment in which CUDA recorded no work (only views between two breaks)."""

    def replay(self) -> None:
        pass


class CudaRecorder:
    def __init__(self, platform: CaptureHost):
        self.platform = platform
        self.gen: Generation = platform.generations.current
        self.graph = torch.cuda.CUDAGraph()
        self.began = self.done = False
        try:
            self.graph.capture_begin(pool=self.gen.id, capture_error_mode=platform.capture_error_mode())
            self.began = True
        except BaseException as e:
            self.done = True
            recover(platform, self.graph, self.gen, e, began=False)
            raise

    def _capture_end(self) -> None:
        with torch.cuda.stream(self.gen.stream):  # capture must end on the stream it began on
            self.graph.capture_end()

    def end(self) -> CudaGraphSegment | EmptyGraph:
        self.done = True
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self._capture_end()
        except Exception as e:
            unjoined = self.platform.unjoined_streams()
            recover(self.platform, self.graph, self.gen, e, began=True)
            raise CaptureInvalidatedError(
                f"CUDA invalidated this graph capture ({e}){_unjoined_cause(e, unjoined)}. The platform released "
                f"the capture and later captures use a fresh pool: {RULES}, then capture again"
            ) from e
        self.platform.segment_ended()
        self.platform.route_breaks()  # a break may follow: its results come from the pool too
        empty = False
        for w in caught:
            if _EMPTY_WARNING in str(w.message):
                empty = True
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if empty:  # CUDA warns on every capture of an empty graph; nothing to replay, but parked (see module doc)
            placeholder = EmptyGraph()
            self.gen.adopt(self.graph, placeholder)
            return placeholder
        segment = CudaGraphSegment(self.graph)
        self.gen.adopt(self.graph, segment)
        return segment

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            self._capture_end()
        except Exception as e:  # the capture was invalidated (the usual cause of the abort)
            recover(self.platform, self.graph, self.gen, e, began=True)
        else:
            self.gen.adopt(self.graph)  # parked: a reset here would free the stream's cuBLAS workspace


def _unjoined_cause(error: BaseException, unjoined: list[Any]) -> str:
    """Why CUDA refused the capture's end, in words: the side streams not joined back, named."""
    if unjoined:
        names = ", ".join(str(s) for s in unjoined)
        return (
            f": side stream {names} joined the capture and was not joined back before the segment ended; "
            "make the capture stream wait for it (torch.cuda.current_stream().wait_stream(side)) before the break "
            "or the end of the capture"
        )
    text = str(error).lower()
    if "fork" in text or "join" in text:
        return (
            ": a side stream joined the capture and was not joined back (one the platform did not see fork, or one "
            "that launched work after its last join)"
        )
    return "; an illegal operation ran while it was open"


def graph_of(segment: Any) -> Any:
    """The ``torch.cuda.CUDAGraph`` behind an entry's segment (None for breaks and empty segments)."""
    with contextlib.suppress(AttributeError):
        return segment.graph
    return None
