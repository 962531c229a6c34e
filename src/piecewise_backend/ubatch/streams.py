"""Micro-batch streams on CUDA: one compute stream, one communication stream, events at the hand-overs.

Both micro-batch threads compute on the launching thread's stream (the capture stream under a
capture) and run their :func:`~piecewise_backend.dbo_comm` regions on a communication stream of
the wrapper's threads. Entering a region, the communication stream waits for the compute stream
(an event recorded on it: under a capture this forks the communication stream into the capture);
leaving it records an event on the communication stream that this micro-batch's compute waits
for when it next resumes (``dbo_yield`` returning, its turn ending, or a receive hook of it run by
the other micro-batch). That wait is what joins the communication stream back into the capture
stream before ``capture_end``; the launching thread joins it once more after the step.

The wait is deferred to the hand-over on purpose: the compute stream is shared, so waiting at the
region's end would stall the other micro-batch's compute behind this one's communication.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..platforms.cuda.streams import new_comm_stream, warm_blas, workspaces_cleared


class StepStreams:
    """The streams of one micro-batched CUDA step and the hand-over events not yet waited for."""

    def __init__(self, compute: Any, comm: Any, num_ubatches: int) -> None:
        self.compute, self.comm = compute, comm
        self.lock = threading.Lock()
        # per micro-batch: (event recorded at the end of a comm region, tensors kept alive until it is waited for)
        self.pending: list[list[tuple[Any, tuple]]] = [[] for _ in range(num_ubatches)]
        self.used = False

    @contextlib.contextmanager
    def comm_region(self, index: int, keep: tuple) -> Iterator[None]:
        with self.lock:
            self.used = True
        self.comm.wait_stream(self.compute)  # the comm work reads what compute produced so far
        with torch.cuda.stream(self.comm):
            yield
        event = torch.cuda.Event()
        event.record(self.comm)  # only this region's work: the other micro-batch's comm comes later on the stream
        with self.lock:
            self.pending[index].append((event, keep))

    def join(self, index: int) -> None:
        """The compute stream waits for micro-batch ``index``'s finished comm regions (a hand-over point).

        Tensors a region read (``keep``) stay referenced until here: freed earlier, their block could
        be reused by compute-stream work that runs while the communication still reads it. Blocks
        the comm stream allocated are safe without it: each region starts by waiting for all compute
        work launched before it, which includes every read of a comm result freed before it."""
        with self.lock:
            todo, self.pending[index] = self.pending[index], []
        for event, _ in todo:
            self.compute.wait_event(event)

    def join_all(self) -> None:
        """On the launching thread after the step: nothing on the comm stream is left unjoined."""
        if self.used:
            self.compute.wait_stream(self.comm)


class CommStreams:
    """A wrapper's communication streams (one per device) and which of its threads are ready to capture.

    Under a capture in global mode (the platform's, kept on purpose) a thread's first cuBLAS call
    creates its handle with a plain cudaMalloc, which CUDA refuses and which invalidates the capture;
    the first GEMM on a stream allocates that (handle, stream)'s workspace, which inside a capture
    lands in the graph pool, and on torch 2.11 the first cuBLASLt GEMM (addmm with a bias, bf16) makes
    a second workspace of its own. :meth:`prepare` makes all of them on each thread, for both streams,
    whenever a step runs eagerly (the warm-ups before a capture), so the capture finds them made.

    What is ready is keyed by the thread object (a thread that replaced a timed-out one is not ready,
    even under a reused ident), the raw streams (pooled: two stream objects can be one stream), and how
    often each stream's workspaces were freed since (a generation of graphs ending frees them on
    torch >= 2.12, and its stream can come back as a later generation's).
    """

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._ready: weakref.WeakKeyDictionary[threading.Thread, set[tuple[int, ...]]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def for_step(self, compute: Any, num_ubatches: int) -> StepStreams:
        device = compute.device_index
        comm = self._streams.get(device)
        if comm is None or comm.cuda_stream == compute.cuda_stream:
            comm = self._streams[device] = new_comm_stream(device, compute)
        return StepStreams(compute, comm, num_ubatches)

    @staticmethod
    def _key(streams: StepStreams) -> tuple[int, ...]:
        c, m = streams.compute, streams.comm
        return c.cuda_stream, m.cuda_stream, workspaces_cleared(c), workspaces_cleared(m)

    def prepare(self, streams: StepStreams) -> None:
        """On a micro-batch thread, outside any capture: its cuBLAS handle and its cuBLAS and cuBLASLt
        workspaces on both streams."""
        key, me = self._key(streams), threading.current_thread()
        with self._lock:
            if key in self._ready.get(me, ()):
                return
        for stream in (streams.compute, streams.comm):
            warm_blas(stream)
        with self._lock:
            self._ready.setdefault(me, set()).add(key)

    def check_ready(self, streams: StepStreams, threads: list[threading.Thread]) -> None:
        """Before a captured step: every thread prepared for these streams, else a clear error."""
        key = self._key(streams)
        with self._lock:
            missing = [i for i, t in enumerate(threads) if key not in self._ready.get(t, ())]
        if missing:
            raise RuntimeError(
                f"micro-batch thread(s) {missing} never ran a step eagerly on the capture stream {streams.compute} "
                "since their cuBLAS workspaces there were made (or freed with a generation of graphs): they would be "
                "created inside the capture, which CUDA refuses. Capture micro-batched steps with num_warmups >= 1 "
                "(the default)"
            )
