"""Capture-time checks of the simulated platform: refuse what it cannot record faithfully.

The recorder sees only what goes through the ATen dispatcher. Code that computes behind
its back (Inductor's fused C++ kernels, C++ custom kernels that write through raw
pointers) would be replayed wrong, silently. Two checks, both on what actually runs:

* the caller of each dispatched op: an op called from Inductor-generated code means the
  surrounding fused kernels ran unseen;
* a validation replay when a segment ends: the recorded ops are replayed from the
  pre-segment state and must reproduce, bit for bit, every tensor the eager run during
  capture wrote or allocated (what the program can read of it). Anything the recording
  missed shows up as a difference; the refusal names the op that wrote it, if any.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, NoReturn, Protocol

import torch
from torch.utils._pytree import tree_leaves


class Recorded(Protocol):
    """A recorded segment as the checks see it (the platform module imports this one)."""

    ops: Iterable[Any]

    def replay(self) -> None: ...


class RecordingMode(Protocol):
    """The simulator's recording mode (a TorchDispatchMode of :mod:`.platform`) as the checks see it: what it
    snapshotted and allocated, and its undo."""

    snapshots: dict[Any, tuple[Any, Any]]
    allocated: dict[Any, Any]

    def undo(self) -> None: ...

FIX_INDUCTOR = (
    "code compiled by Inductor (torch.compile's default backend, or compile_pieces='inductor') must be "
    "compiled with CompilationConfig(platform='simulated', compile_pieces='eager') and "
    "torch.compile(model, backend=pb.make_backend(config)), or run uncompiled"
)
FIX_HIDDEN = "give a custom kernel that writes behind the dispatcher a CPU implementation made of torch ops"
_ON_CUDA = "; it runs as it is on platform='cuda'"


class UnrecordableError(RuntimeError):
    """The simulator cannot replay this capture faithfully, so it refuses it."""


def refuse(cause: str, fix: str) -> NoReturn:
    raise UnrecordableError(f"cannot simulate this capture: {cause}. Fix: {fix}{_ON_CUDA}")


def _inductor_ran() -> bool:
    """Whether this process loaded Inductor-generated code (only then can its fused kernels be the cause)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    return codecache is not None and bool(codecache.PyCodeCache.modules or codecache.PyCodeCache.modules_no_attr)


def _output_code_dirs() -> tuple[str, ...]:
    """Where Inductor writes the Python modules it generates (and runs them from)."""
    dirs = [os.path.abspath(d) for d in [os.environ.get("TORCHINDUCTOR_CACHE_DIR")] if d]
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if utils is not None:
        dirs.append(os.path.abspath(utils.cache_dir()))
    return tuple(dirs)


_MAX_DEPTH = 12  # the op's caller sits a few frames above __torch_dispatch__ (torch/_ops.py, wrappers)


def check_caller(func: Any) -> None:
    """Refuse an op dispatched from Inductor-generated code (its fused kernels ran unseen)."""
    if "torch._inductor.runtime.cache_dir_utils" not in sys.modules:
        return  # Inductor never ran in this process: none of its code can be calling
    frame = sys._getframe(2)
    dirs: tuple[str, ...] | None = None
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return
        name = frame.f_code.co_filename
        if "inductor" in name:
            dirs = dirs or _output_code_dirs()
            if name.startswith(dirs):
                refuse(
                    f"{func} was called from Inductor-generated code ({name}); the fused C++ kernels "
                    "around it bypass the dispatcher and cannot be recorded",
                    FIX_INDUCTOR,
                )
        frame = frame.f_back


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _image(t: torch.Tensor | torch.UntypedStorage) -> torch.Tensor:
    """What the program can read of a storage (all of it) or of a tensor made during the segment.

    A kernel may return a view of a larger buffer (``_embedding_bag``'s ``offset2bag``): the bytes
    outside the view are unreachable, and a replay copies only the view, so only it is compared.
    """
    if isinstance(t, torch.UntypedStorage):
        return torch.empty(0, dtype=torch.uint8).set_(t)
    bits = _BITS.get(t.element_size())
    return t.view(bits) if bits is not None else _image(t.untyped_storage())


def _writers(graph: Recorded) -> dict[int, Any]:
    """Storage -> the last recorded op that writes it (a fresh output or an argument it mutates)."""
    writers: dict[int, Any] = {}
    for op in graph.ops:
        written = [t for _, t in op.fresh]
        schema = getattr(op.func, "_schema", None)  # a collective's replay is a plain callable
        for i, arg in enumerate(schema.arguments if schema is not None else ()):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = op.kwargs.get(arg.name) if arg.kwarg_only or i >= len(op.args) else op.args[i]
                written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        for t in written:
            writers[t.untyped_storage().data_ptr()] = op.func
    return writers


def validate_segment(mode: RecordingMode, graph: Recorded) -> None:
    """Replay ``graph`` from the pre-segment state and compare with the eager run; refuse on a difference.

    When it refuses, memory is left as after a capture (undone); when it passes, as after a
    replay, which the caller undoes. Random ops draw what they drew during capture: the
    default generator restarts from its pre-segment state.
    """
    seen: list[torch.Tensor | torch.UntypedStorage] = [s for s, _ in mode.snapshots.values()]
    seen += list(mode.allocated.values())
    eager = [_image(x).clone() for x in seen]
    mode.undo()
    try:
        graph.replay()
    except BaseException:
        mode.undo()
        raise
    differ = [x for x, e in zip(seen, eager) if not _image(x).equal(e)]
    if differ:
        mode.undo()
        first = differ[0]
        storage = first if isinstance(first, torch.UntypedStorage) else first.untyped_storage()
        writer = _writers(graph).get(storage.data_ptr())
        hidden = "a C++ kernel writing through raw pointers" + (", fused Inductor kernels" if _inductor_ran() else "")
        if writer is None:
            why = f"no recorded op writes the first of them, so it was written behind the dispatcher ({hidden})"
        else:
            why = (
                f"the first of them was written by {writer}, whose replay gave other bytes than its run during "
                f"capture: it read memory written behind the dispatcher ({hidden}), or it is not deterministic"
            )
        refuse(
            f"replaying the {len(graph)} recorded ATen ops did not reproduce {len(differ)} of the {len(seen)} "
            f"tensors this segment wrote during capture: {why}",
            FIX_INDUCTOR + "; " + FIX_HIDDEN if _inductor_ran() else FIX_HIDDEN,
        )
