"""Escaped break outputs: a tensor a break made and kept (on ``self``, in a closure) without returning it.

A graph segment after the break that reads such a tensor was recorded reading the capture-time one;
each replay re-runs the break, which makes a new tensor the segment never sees, so the segment reads a
stale tensor (on a GPU, pool memory a later capture may reuse). vLLM's breakable-graph debug mode and
SGLang's checker look for the same. :class:`EscapeWatch` finds it during the capture: it notes the
storages each break's ops create, forgets those the break returns (a replay copies its new results
into them) and those that died, and refuses a later segment's op that reads one of the rest, naming
the break. On by default on the simulated platform, with ``debug_checks`` on CUDA: it costs one Python
dispatch per op recorded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["EscapeWatch", "EscapedOutputError"]


class EscapedOutputError(RuntimeError):
    """A graph segment reads a tensor a break made without returning it (see :mod:`.escapes`)."""


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts: not watched
        return None


def _storages(tree: Any) -> set[int]:
    found = (_storage(t) for t in tree_leaves(tree) if isinstance(t, torch.Tensor))
    return {s._cdata for s in found if s is not None}


class EscapeWatch(TorchDispatchMode):
    """Pushed around one breakable capture; the session calls :meth:`enter_break` and :meth:`leave_break`
    around each break it runs."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Dynamo's fake-tensor tracing is neither a break's allocation nor a segment's read

    def __init__(self) -> None:
        super().__init__()
        self.breaking: str | None = None  # the break running now
        self.made: dict[int, tuple[StorageWeakRef, str]] = {}  # this break's new storages (weakly), described
        self.escaped: dict[int, tuple[StorageWeakRef, str, str]] = {}  # storage -> (ref, break, the tensor described)

    def enter_break(self, name: str) -> None:
        self.breaking, self.made = name, {}

    def leave_break(self, out: Any) -> None:
        """The break returned ``out``: what it made, still lives and is not in ``out`` has escaped."""
        name, self.breaking = self.breaking, None
        returned = _storages(out)
        for key, (ref, what) in self.made.items():
            if key not in returned and not ref.expired():
                self.escaped[key] = (ref, name or "?", what)
        self.made = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.breaking is None:
            if self.escaped:
                self._check_reads(func, args, kwargs)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        inputs = _storages((args, kwargs))
        for t in tree_leaves(out):
            storage = _storage(t) if isinstance(t, torch.Tensor) else None
            if storage is None or storage._cdata in inputs:
                continue
            known = self.made.get(storage._cdata)
            if known is None or known[0].expired():  # a dead storage's address may come back
                self.made[storage._cdata] = (StorageWeakRef(storage), f"a tensor of shape {tuple(t.shape)}, {t.dtype}")
        return out

    def _check_reads(self, func: Any, args: tuple, kwargs: dict) -> None:
        for t in tree_leaves((args, kwargs)):
            storage = _storage(t) if isinstance(t, torch.Tensor) else None
            if storage is None:
                continue
            key = storage._cdata
            hit = self.escaped.get(key)
            if hit is None:
                continue
            ref, name, what = hit
            if ref.expired():  # that tensor died; this storage is another one at the same address
                del self.escaped[key]
                continue
            raise EscapedOutputError(
                f"break {name!r} made {what} and kept it without returning it, and the graph segment after the "
                f"break reads it ({func}): an escaped output. Each replay re-runs the break, whose new tensor "
                "that segment never sees: it would read the capture-time tensor (stale; on a GPU, memory the "
                "graph pool may give to another capture). Return every tensor that code after the break reads "
                "(a replay copies the new result into the captured one), or have the break write into a tensor "
                "that exists before it"
            )
