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
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .ubatch_streams import CommStreams, StepStreams

NUM_UBATCHES = 2
DEFAULT_TIMEOUT_S = 300.0


class UBatchAborted(BaseException):
    """Raised inside a micro-batch thread whose step already failed: unwinds it quietly."""


class UBatchTimeoutError(TimeoutError):
    pass


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Handover:
    """The turn-taking of one micro-batched step (one per step, shared by its threads)."""

    def __init__(self, step: int, timeout_s: float, streams: StepStreams | None = None) -> None:
        self.step, self.deadline = step, time.monotonic() + timeout_s
        self.streams = streams  # CUDA: the compute and communication streams of the step
        self.cond = threading.Condition()
        self.turn = 0
        self.finished = [False] * NUM_UBATCHES
        self.stopped = [False] * NUM_UBATCHES  # its thread left the step (finished, failed or aborted)
        self.results: list[Any] = [None] * NUM_UBATCHES
        self.error: BaseException | None = None
        self.failed: int | None = None
        self.hooks: list[list[tuple[int, Callable[[], Any]]]] = [[] for _ in range(NUM_UBATCHES)]  # per runner
        self.order: list[int] = []  # which micro-batch ran each turn (tests and docs read it)

    def where(self) -> str:
        return f"micro-batched step #{self.step} on rank {_rank()}"

    def _wait(self, index: int) -> None:
        """Block (holding ``cond``) until it is ``index``'s turn or the step failed."""
        while self.turn != index and self.error is None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.fail(index, UBatchTimeoutError(
                    f"{self.where()}: micro-batch {index} waited for its turn past the timeout; micro-batch "
                    f"{self.turn} never yielded (blocked in a collective whose peer is absent?)"
                ))
                break
            self.cond.wait(min(left, 1.0))
        if self.error is not None:
            raise UBatchAborted()
        self.order.append(index)

    def start(self, index: int) -> None:
        with self.cond:
            self._wait(index)

    def yield_(self, index: int) -> None:
        with self.cond:
            other = (index + 1) % NUM_UBATCHES
            if self.finished[other]:
                return  # nobody to hand over to: keep running
            self.turn = other
            self.cond.notify_all()
            self._wait(index)
        self.join(index)
        self.run_own_hooks(index)

    def join(self, index: int) -> None:
        """A hand-over point of ``index``: its compute waits for its finished communication (CUDA)."""
        if self.streams is not None:
            self.streams.join(index)

    def finish(self, index: int, result: Any) -> None:
        self.join(index)
        self.run_own_hooks(index)
        with self.cond:
            self.results[index] = result
            self.finished[index] = True
            other = (index + 1) % NUM_UBATCHES
            if not self.finished[other]:
                self.turn = other
            self.cond.notify_all()

    def fail(self, index: int, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error, self.failed = error, index
            self.cond.notify_all()

    def stop(self, index: int) -> None:
        with self.cond:
            self.stopped[index] = True
            self.cond.notify_all()

    def register_hook(self, index: int, fn: Callable[[], Any]) -> None:
        with self.cond:
            self.hooks[(index + 1) % NUM_UBATCHES].append((index, fn))

    def run_hooks_for(self, index: int) -> None:
        """Run the hooks the other micro-batch left for ``index`` to run."""
        with self.cond:
            todo, self.hooks[index] = self.hooks[index], []
        for owner in {owner for owner, _ in todo}:
            self.join(owner)  # a hook consumes its owner's communication
        for _, fn in todo:
            fn()

    def run_own_hooks(self, index: int) -> None:
        """Run the hooks ``index`` registered that the other micro-batch has not run (it finished first)."""
        with self.cond:
            other = (index + 1) % NUM_UBATCHES
            mine = [fn for owner, fn in self.hooks[other] if owner == index]
            self.hooks[other] = [(o, fn) for o, fn in self.hooks[other] if o != index]
        for fn in mine:
            fn()

    def wait_all(self) -> list[Any]:
        """On the launching thread: the results in micro-batch order, or the step's error."""
        with self.cond:
            # after a failure too: wait for the other thread to reach a hand-over and stop, so nothing
            # of this step runs on when the caller goes on (a thread blocked in a collective: the deadline)
            while not all(self.stopped):
                left = self.deadline - time.monotonic()
                if left <= 0:
                    running = [i for i, done in enumerate(self.stopped) if not done]
                    self.error = UBatchTimeoutError(
                        f"{self.where()}: micro-batch(es) {running} did not finish within the timeout "
                        "(blocked in a collective whose peer rank is absent or runs a different step?)"
                    ) if self.error is None else self.error
                    self.cond.notify_all()
                    break
                self.cond.wait(min(left, 1.0))
            error, failed = self.error, self.failed
        if error is not None:
            if failed is not None and not isinstance(error, UBatchTimeoutError):
                error.add_note(f"raised in micro-batch {failed} of {self.where()}")
            raise error
        return self.results


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

    def run(self, jobs: list[Callable[[], Any]], timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[list[Any], list[int]]:
        """Results of ``jobs`` in micro-batch order, and the order in which turns ran."""
        if len(jobs) != NUM_UBATCHES:
            raise ValueError(f"UBatchThreads.run takes {NUM_UBATCHES} jobs, got {len(jobs)}")
        if current_ubatch() is not None:
            raise RuntimeError("micro-batching does not nest: a micro-batch thread started another micro-batched step")
        if not self._threads or not all(t.is_alive() for t, _ in self._threads):
            self._spawn()
        state = capture_state()
        streams = None
        if state["stream"] is not None:
            streams = self.comm.for_step(state["stream"], NUM_UBATCHES)
            state["prepare"] = not torch.cuda.is_current_stream_capturing()
            if not state["prepare"]:
                self.comm.check_ready(streams, [t.ident for t, _ in self._threads])
        self.steps += 1
        handover = Handover(self.steps, timeout_s, streams)
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
        if streams is not None:
            streams.join_all()
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
