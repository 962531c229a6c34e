"""The hand-over of one micro-batched step: whose turn it is, hooks, results, failure and timeout.

Exactly one micro-batch thread runs at a time; a thread passes the turn at ``dbo_yield()`` and when
it finishes. On CUDA a hand-over is also where a micro-batch's compute waits for the communication
it launched (ubatch_streams).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .streams import StepStreams

NUM_UBATCHES = 2


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
