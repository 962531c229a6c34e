"""CUDA platform: generations of graphs (one pool, one capture stream each) and graph memory.

Two facts of torch's CUDAGraph shape this module (tests/support/pbtest/cuda_double/rules.py cites the sources):

* ``reset()`` of a graph (also its destructor) frees the cuBLAS workspaces of the stream it was
  captured on (torch >= 2.12, PR 175276), for every thread's handle; graphs captured on that
  stream baked those workspace addresses in. So a graph is never destroyed while another graph
  of its stream lives: graphs are *parked* in their generation, whatever drops them (an entry
  cleared, a wrapper garbage-collected, an empty segment, an aborted capture), and a generation
  is destroyed as a whole once none of its graphs is used. A generation has a stream of its own,
  so ending one never touches another's workspaces.
* ``capture_begin`` registers the pool with the device *and the host* caching allocator;
  ``reset()`` releases both, and a ``torch.cuda.MemPool`` holds a use on the device allocator
  only. Once the host use count of a pool reaches 0, the next capture into it fails an INTERNAL
  ASSERT. Parking keeps every capture's host use until the generation ends, and an ended
  generation's pool id is never captured into again.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .streams import new_capture_stream, note_workspaces_cleared

_PARK_LIMIT = 256  # dead graphs parked in the current generation before later captures move to a new one


class Generation:
    """Graphs captured on one stream into one pool; destroyed together."""

    def __init__(self, device: int, stream: Any, own_stream: bool = True) -> None:
        self.own_stream = own_stream  # False: a caller's stream (breakable_graph(stream=)), never reused for another
        with torch.cuda.device(device):
            self.mempool: Any = torch.cuda.MemPool()  # holds a (device) use of its id while the generation lives
        self.id: tuple[int, int] = tuple(self.mempool.id)
        self.device, self.stream = device, stream
        self.graphs: list[torch.cuda.CUDAGraph] = []  # every graph captured here, live or parked
        self.live: weakref.WeakSet[Any] = weakref.WeakSet()  # the segments entries hold
        self.leaked = 0  # device uses of this pool that failed captures kept (torch without PR 190348)
        self.failures = 0  # captures CUDA invalidated in this pool

    def adopt(self, graph: torch.cuda.CUDAGraph, segment: Any = None) -> None:
        self.graphs.append(graph)
        if segment is not None:
            self.live.add(segment)

    def parked(self) -> int:
        return len(self.graphs) - len(self.live)

    def end(self) -> None:
        """Destroy every graph (freeing this stream's cuBLAS workspaces: no live graph reads them any
        more), give back the uses failed captures leaked, and drop the MemPool (~MemPool releases its
        use and empties the pool; never call this while a capture routes: it would terminate)."""
        for graph in self.graphs:
            graph.reset()
        if self.graphs:
            note_workspaces_cleared(self.stream)  # reset() freed them (torch >= 2.12): a warm-up must redo them
        self.graphs.clear()
        for _ in range(self.leaked):
            torch._C._cuda_releasePool(self.device, self.id)
        self.leaked = 0
        self.mempool = None


class PrivatePool:
    """A pool of its own (a ``pb.BreakableGraph``'s, or the graphs sharing it): a private generation,
    made at the first capture into it with the stream that capture asks for (else a capture stream
    of its own). A capture CUDA invalidated retires it (as any failed generation); the next capture
    makes a new one. It ends once this object is dropped and none of its graphs is used."""

    def __init__(self) -> None:
        self.gen: Generation | None = None

    def __repr__(self) -> str:
        return f"PrivatePool({'unused' if self.gen is None else f'pool {self.gen.id}, stream {self.gen.stream}'})"


class Generations:
    """The current generation, older ones whose graphs still live, and the pools of ended ones."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.older: list[Generation] = []  # moved away from (failed capture, scratch pool, park limit)
        self.saved: list[Generation] = []  # set aside by fresh_pool()
        self.private: list[tuple[Generation, weakref.ref[PrivatePool]]] = []  # of live or recently dropped PrivatePools
        self.retired: dict[tuple[int, int], str] = {}  # ended generations' pools -> why (memory may remain)
        self.failed_captures = 0
        self.leaked_host_uses = 0  # host-allocator uses failed captures leaked: no binding releases them
        # streams of ended generations, reused first: torch 2.11 never frees a stream's cuBLAS workspace,
        # so every new stream would keep one more (32 MiB per thread on Hopper)
        self.spare_streams: list[Any] = []
        self.current: Generation | None = None
        self.current = self._new()

    def all(self) -> list[Generation]:
        current = [self.current] if self.current is not None and all(self.current is not g for g, _ in self.private) else []
        return [*self.older, *self.saved, *(g for g, _ in self.private), *current]

    def new_private(self, owner: PrivatePool, stream: Any = None) -> Generation:
        """A generation for ``owner`` alone, on ``stream`` (a caller's) or a capture stream of its own."""
        gen = self._new() if stream is None else Generation(self.device, stream, own_stream=False)
        self.private.append((gen, weakref.ref(owner)))
        return gen

    def forget_private(self, gen: Generation) -> None:
        self.private = [(g, o) for g, o in self.private if g is not gen]

    def _new(self) -> Generation:
        taken = {g.stream.cuda_stream for g in self.all()}
        spare = [st for st in self.spare_streams if st.cuda_stream not in taken]
        stream = spare[0] if spare else new_capture_stream(self.device, taken)
        self.spare_streams = [st for st in self.spare_streams if st is not stream]
        return Generation(self.device, stream)

    def switch(self) -> None:
        """Later captures go to a new generation; the current one ends once its graphs are dead."""
        self.older.append(self.current)
        self.current = self._new()

    def retire(self, gen: Generation, why: str) -> None:
        """End ``gen`` (its graphs are parked with a generation of the same stream, if one is alive) for ``why``."""
        if gen.failures:
            why += f"; {gen.failures} failed capture(s) in it, {gen.leaked} leaked device use(s) given back"
        # A caller's stream may carry another generation (two graphs captured on one stream): its graphs
        # baked in that stream's cuBLAS workspace, which a reset() here would free. Park ours there instead.
        heir = next((g for g in self.all() if g is not gen and g.stream.cuda_stream == gen.stream.cuda_stream), None)
        if heir is not None:
            heir.graphs.extend(gen.graphs)
            gen.graphs.clear()
        gen.end()
        self.retired[gen.id] = why
        if gen.own_stream and heir is None:
            self.spare_streams.append(gen.stream)

    def collect(self, current: bool = True) -> None:
        """End every generation none of whose graphs is used any more. Call outside captures.
        ``current=False`` keeps the current one (and its stream): right before a capture, whose
        warm-up made the stream's cuBLAS workspace, a switch would leave the capture without it."""
        for gen in [g for g in self.older if not g.live]:
            self.older.remove(gen)
            self.retire(gen, "its graphs were dropped")
        for gen, owner in [(g, o) for g, o in self.private if o() is None and not g.live and g is not self.current]:
            self.forget_private(gen)
            self.retire(gen, "its BreakableGraph pool was dropped")
        if not current:
            return
        if self.current.graphs and not self.current.live:
            self.retire(self.current, "its graphs were dropped")
            self.current = self._new()
        elif self.current.parked() > _PARK_LIMIT:
            self.switch()

    def push_scratch(self) -> None:
        self.saved.append(self.current)
        self.current = self._new()

    def pop_scratch(self) -> None:
        scratch, self.current = self.current, self.saved.pop()
        if scratch.graphs and scratch.live:
            self.older.append(scratch)  # ends once the graphs still captured into it are dropped
        else:
            self.retire(scratch, "scratch pool")

    def pool_bytes(self, snapshot: list[dict[str, Any]]) -> dict[tuple[int, int], int]:
        held: dict[tuple[int, int], int] = {}
        for s in snapshot:
            pid = tuple(s["segment_pool_id"])
            held[pid] = held.get(pid, 0) + s["total_size"]
        for pid in [p for p in self.retired if p not in held]:
            del self.retired[pid]  # a retired pool is gone once its last segment is
        return held

    def memory(self, snapshot: list[dict[str, Any]]) -> int:
        held = self.pool_bytes(snapshot)
        ids = {g.id for g in self.all()} | set(self.retired)
        return sum(n for pid, n in held.items() if pid in ids)

    def retired_pools(self, snapshot: list[dict[str, Any]]) -> list[tuple[tuple[int, int], int, str]]:
        held = self.pool_bytes(snapshot)
        return [(pid, held.get(pid, 0), why) for pid, why in self.retired.items()]
