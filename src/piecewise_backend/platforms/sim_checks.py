"""Capture-time checks of the simulated platform: refuse what it cannot record faithfully.

The recorder sees only what goes through the ATen dispatcher. Code that computes behind
its back (Inductor's fused C++ kernels, C++ custom kernels that write through raw
pointers) would be replayed wrong, silently. Two checks, both on what actually runs:

* the caller of each dispatched op: an op called from Inductor-generated code means the
  surrounding fused kernels ran unseen;
* a validation replay when a segment ends: the recorded ops are replayed from the
  pre-segment state and must reproduce, bit for bit, every tensor the eager run during
  capture wrote or allocated. Anything the recording missed shows up as a difference.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import torch

if TYPE_CHECKING:
    from .simulated import SimulatedGraph, _RecordingMode

_FIX = (
    "code compiled by Inductor (torch.compile's default backend, or compile_pieces='inductor') must be "
    "compiled with CompilationConfig(platform='simulated', compile_pieces='eager') and "
    "torch.compile(model, backend=pb.make_backend(config)), or run uncompiled; a custom kernel that "
    "writes behind the dispatcher needs a CPU implementation made of torch ops to be simulated; "
    "either runs as it is on platform='cuda'"
)


class UnrecordableError(RuntimeError):
    """The simulator cannot replay this capture faithfully, so it refuses it."""


def refuse(cause: str) -> NoReturn:
    raise UnrecordableError(f"cannot simulate this capture: {cause}. Fix: {_FIX}")


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
                    "around it bypass the dispatcher and cannot be recorded"
                )
        frame = frame.f_back


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def validate_segment(mode: _RecordingMode, graph: SimulatedGraph, rng: torch.Tensor) -> None:
    """Replay ``graph`` from the pre-segment state and compare with the eager run; refuse on a difference.

    When it refuses, memory is left as after a capture (undone); when it passes, as after a
    replay, which the caller undoes.
    """
    storages = [s for s, _ in mode.snapshots.values()] + [t.untyped_storage() for t in mode.allocated.values()]
    eager = [s.clone() for s in storages]
    end_rng = torch.get_rng_state()
    mode.undo()
    torch.set_rng_state(rng)  # random ops draw the same numbers as during capture
    try:
        graph.replay()
    except BaseException:
        mode.undo()
        raise
    finally:
        torch.set_rng_state(end_rng)
    differ = sum(not _bytes(s).equal(_bytes(e)) for s, e in zip(storages, eager))
    if differ:
        mode.undo()
        refuse(
            f"replaying the {len(graph)} recorded ATen ops did not reproduce {differ} of the {len(storages)} tensors "
            "this segment wrote during capture, so something in it computed outside the dispatcher "
            "(fused Inductor kernels, a C++ kernel writing through raw pointers)"
        )
