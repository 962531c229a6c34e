"""CUDA platform: torch.cuda.CUDAGraph segments in one shared pool, on a side stream."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch

from ..capture import gc_managed  # capture.bulk_capture() owns gc during a bulk capture


class _CudaRecorder:
    def __init__(self, pool: tuple[int, int]):
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=pool)

    def end(self) -> torch.cuda.CUDAGraph:
        self.graph.capture_end()
        return self.graph

    def abort(self) -> None:
        # After an error inside capture, capture_end itself may raise; the graph is dropped anyway.
        with contextlib.suppress(Exception):
            self.graph.capture_end()
        with contextlib.suppress(Exception):
            self.graph.reset()


class CudaPlatform:
    name = "cuda"

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()  # every graph shares it: they never replay concurrently
        self.stream = torch.cuda.Stream()  # capture off the default stream, as CUDA requires

    @contextlib.contextmanager
    def capture_scope(self) -> Iterator[None]:
        if not gc_managed():
            gc.collect()  # once per capture call, never per segment (it dominated capture time in vLLM)
        torch.cuda.synchronize()
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)  # order the capture stream's eager work before what follows

    def begin(self) -> _CudaRecorder:
        return _CudaRecorder(self.pool)

    def memory(self) -> int:
        return torch.cuda.memory_reserved()

    def describe(self, amount: int) -> str:
        return f"{amount / 2**20:.1f} MiB of CUDA memory reserved"
