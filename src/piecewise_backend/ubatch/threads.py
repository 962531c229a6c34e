"""Micro-batch threads: two CPU threads per step that hand the CPU to each other at ``dbo_yield()``.

Dual-batch overlap: while one half of a step waits for its communication (an expert-parallel
MoE layer's dispatch or combine), the other half computes. Exactly one micro-batch thread runs
at a time; ``dbo_yield()`` passes the turn to the other one, so the order of every launch (and of
every collective, on every rank) is fixed by the yield points, not by the OS scheduler.
Outside a micro-batched step the ``dbo_*`` functions do nothing (``dbo_register_recv_hook`` runs
its hook at once), so the same model code runs either way. On CUDA, ``dbo_comm()`` regions run on a
communication stream (ubatch_streams); elsewhere they run in place.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .handover import NUM_UBATCHES, Handover, UBatchAborted, UBatchTimeoutError  # noqa: F401 (re-exported)
from .streams import CommStreams

DEFAULT_TIMEOUT_S = 300.0


_local = threading.local()  # .handover, .index: set on micro-batch threads only


def current_ubatch() -> tuple[Handover, int] | None:
    """``(handover, index)`` on a micro-batch thread, else None."""
    handover = getattr(_local, "handover", None)
    return None if handover is None else (handover, _local.index)


def dbo_yield() -> None:
    """Hand the CPU to the other micro-batch thread (a no-op outside micro-batching).

    Place it right after launching communication whose result this half does not need yet
    (the MoE dispatch and combine): the other half computes while the data is in flight.
    """
    handover = getattr(_local, "handover", None)
    if handover is not None:
        handover.yield_(_local.index)


@contextlib.contextmanager
def dbo_comm(*keep: torch.Tensor) -> Iterator[None]:
    """Launch communication inside this region (a no-op outside micro-batching and off CUDA).

    In a micro-batched CUDA step the region runs on the communication stream, after the compute
    launched so far; this micro-batch's compute waits for it at its next hand-over (``dbo_yield``
    returning). Launch the collective in the region, leave it, then ``dbo_yield()``, then use the
    result. ``keep``: tensors the communication reads that the caller may drop before it resumes.
    """
    handover = getattr(_local, "handover", None)
    streams = handover.streams if handover is not None else None
    if streams is None or getattr(_local, "in_comm", False):
        yield
        return
    _local.in_comm = True
    try:
        with streams.comm_region(_local.index, keep):
            yield
    finally:
        _local.in_comm = False


def dbo_register_recv_hook(fn: Callable[[], Any]) -> None:
    """``fn`` completes a receive this micro-batch started (waits for what peers sent it).

    In a micro-batched step the other micro-batch runs it at its next
    :func:`dbo_maybe_run_recv_hook`, or this one does when it resumes, whichever comes first.
    Outside micro-batching there is no other thread: ``fn`` runs at once.
    """
    if not callable(fn):
        raise TypeError(f"dbo_register_recv_hook takes a callable, got {type(fn).__name__}")
    handover = getattr(_local, "handover", None)
    if handover is None:
        fn()
    else:
        handover.register_hook(_local.index, fn)


def dbo_maybe_run_recv_hook() -> None:
    """Run the receive hooks the other micro-batch registered (a no-op outside micro-batching)."""
    handover = getattr(_local, "handover", None)
    if handover is not None:
        handover.run_hooks_for(_local.index)


@contextlib.contextmanager
def inherited_state(state: dict[str, Any]) -> Iterator[None]:
    """On a micro-batch thread: the launching thread's grad mode, dispatch modes and CUDA stream.

    All of these are thread-local in torch; a graph recorder is a dispatch mode (simulator)
    or a capturing stream (CUDA), so both halves land in the same capture.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(state["inference"]))
        stack.enter_context(torch.set_grad_enabled(state["grad"]))
        if state["stream"] is not None:
            torch.cuda.set_device(state["stream"].device)
            stack.enter_context(torch.cuda.stream(state["stream"]))
        for mode in state["modes"]:
            stack.enter_context(mode)
        yield


def capture_state() -> dict[str, Any]:
    """What :func:`inherited_state` gives the micro-batch threads, read on the launching thread."""
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {
        "inference": torch.is_inference_mode_enabled(),
        "grad": torch.is_grad_enabled(),
        "modes": list(_get_current_dispatch_mode_stack()),
        "stream": stream,
    }


class UBatchThreads:
    """Two persistent worker threads (per-thread state such as a cuBLAS handle warms up once).

    ``run(jobs)`` runs ``jobs[i]()`` on thread ``i``, turn by turn, and returns their results.
    A timed-out thread may still be blocked (in a collective): the pair is then replaced.
    """

    def __init__(self, name: str = "ubatch") -> None:
        self.name = name
        self.steps = 0
        self._threads: list[tuple[threading.Thread, queue.Queue]] = []
        self.comm = CommStreams()

    def _spawn(self) -> None:
        self._threads = []
        for i in range(NUM_UBATCHES):
            q: queue.Queue = queue.Queue()
            t = threading.Thread(target=_serve, args=(i, q, self.comm), name=f"{self.name}-{i}", daemon=True)
            t.start()
            self._threads.append((t, q))

    def run(
        self, jobs: list[Callable[[], Any]], timeout_s: float = DEFAULT_TIMEOUT_S, streams: bool = True
    ) -> tuple[list[Any], list[int]]:
        """Results of ``jobs`` in micro-batch order, and the order in which turns ran. ``streams``:
        on CUDA, give ``dbo_comm()`` regions the communication stream (False: the simulator's steps)."""
        if len(jobs) != NUM_UBATCHES:
            raise ValueError(f"UBatchThreads.run takes {NUM_UBATCHES} jobs, got {len(jobs)}")
        if current_ubatch() is not None:
            raise RuntimeError("micro-batching does not nest: a micro-batch thread started another micro-batched step")
        if not self._threads or not all(t.is_alive() for t, _ in self._threads):
            self._spawn()
        state = capture_state()
        step_streams = None
        if streams and state["stream"] is not None:
            step_streams = self.comm.for_step(state["stream"], NUM_UBATCHES)
            state["prepare"] = not torch.cuda.is_current_stream_capturing()
            if not state["prepare"]:
                self.comm.check_ready(step_streams, [t for t, _ in self._threads])
        self.steps += 1
        handover = Handover(self.steps, timeout_s, step_streams)
        for i, (_, q) in enumerate(self._threads):
            q.put((handover, jobs[i], state))
        try:
            results = handover.wait_all()
        except BaseException:
            if not all(handover.stopped):  # a thread may still be blocked: never hand it the next step
                for _, q in self._threads:
                    q.put(None)
                self._threads = []
            raise
        if step_streams is not None:
            step_streams.join_all()
        return results, handover.order


def _serve(index: int, jobs: queue.Queue, comm: CommStreams) -> None:
    while True:
        item = jobs.get()
        if item is None:
            return
        handover, job, state = item
        _local.handover, _local.index = handover, index
        try:
            handover.start(index)
            with inherited_state(state):
                if state.get("prepare") and handover.streams is not None:
                    comm.prepare(handover.streams)
                result = job()
            handover.finish(index, result)
        except UBatchAborted:
            pass
        except BaseException as e:  # noqa: BLE001 - the launching thread re-raises it
            handover.fail(index, e)
        finally:
            _local.handover = None
            handover.stop(index)
