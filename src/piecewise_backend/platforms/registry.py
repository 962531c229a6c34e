"""Which platform a config runs on: resolve a name, hand out the platform, and its warm-up hooks.

**What "auto" means**, in one place (:func:`resolve_platform_name`): ``"cuda"`` when a GPU is
present; else the simulator, where the caller can run on it (``simulate=True``: a
:class:`~piecewise_backend.BreakableGraph`, and a :class:`CompilationConfig` with
``compile_pieces="eager"``, since Inductor's fused CPU kernels bypass what the simulator records);
else no graphs (None). ``CompilationConfig()`` (``compile_pieces="inductor"``) on a CPU therefore
runs no graphs: real CPU users want speed, not simulation. A config that loses its graphs that
way says so once per process with a :class:`UserWarning` (:func:`effective_mode`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Any

import torch

from ..config import PLATFORMS, CompilationConfig
from ..modes import CUDAGraphMode
from .base import Platform


def resolve_platform_name(name: str, *, simulate: bool = False) -> str | None:
    """The platform ``name`` means here: ``"cuda"`` and ``"simulated"`` are themselves; ``"auto"`` is
    ``"cuda"`` when a GPU is present, else ``"simulated"`` when ``simulate`` (the caller can run on the
    simulator), else None (no graphs)."""
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {name!r}; valid: {PLATFORMS}")
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "simulated" if simulate else None
    return name


def config_platform_name(config: CompilationConfig) -> str | None:
    """The platform ``config`` captures on (None: no graphs): :func:`resolve_platform_name` of its
    ``platform``, where a config of ``compile_pieces="eager"`` can run on the simulator."""
    return resolve_platform_name(config.platform, simulate=config.compile_pieces == "eager")


def get_platform(name: str) -> Platform:
    if name == "cuda":  # one per device: the current one
        if not torch.cuda.is_available():
            raise RuntimeError(
                "platform='cuda' was asked for but torch.cuda.is_available() is False; "
                "use platform='simulated' (with compile_pieces='eager') to run graph capture on the CPU"
            )
        from .cuda.platform import platform_for

        return platform_for(torch.cuda.current_device())
    return _named_platform(name)


@functools.cache
def _named_platform(name: str) -> Platform:
    if name == "simulated":
        from .simulated.platform import SimulatedPlatform

        return SimulatedPlatform()
    raise ValueError(f"unknown platform {name!r}; valid: 'cuda', 'simulated'")


def warmup_scope(platform: Platform | None) -> contextlib.AbstractContextManager[None]:
    """Where eager warm-ups for ``platform``'s captures run (CUDA: its capture stream)."""
    return contextlib.nullcontext() if platform is None else platform.warmup_scope()


def warmed_step(platform: Platform | None) -> contextlib.AbstractContextManager[None]:
    """Around warm-ups and the capture they prepare: what they warmed up counts for that
    capture only, whether or not one happens (CUDA: skips the lazy warm-up; elsewhere a no-op)."""
    return contextlib.nullcontext() if platform is None else platform.warmed_step()


def warm_up(platform: Platform, fn: Any, args: tuple, kwargs: dict, times: int) -> None:
    """Before a lazy capture, warm ``fn`` up ``times`` times where ``platform`` needs it (CUDA)."""
    platform.warm_up(fn, args, kwargs, times)


#: The text of the warning a config gives when it runs no graphs for want of a GPU (once per process).
NO_GPU_WARNING = (
    "piecewise_backend: platform='auto' found no CUDA device, so cudagraph_mode {mode} -> NONE (no graphs: steps run "
    "eagerly). To capture simulated graphs on the CPU, use CompilationConfig(platform=\"simulated\", "
    "compile_pieces=\"eager\"); to run eagerly without this warning, cudagraph_mode=\"NONE\""
)
_warned = [False]  # the no-GPU warning was given in this process
_warned_lock = threading.Lock()


def effective_mode(config: CompilationConfig) -> CUDAGraphMode:
    """The configured mode, or NONE when no platform captures it here (:func:`config_platform_name`
    is None: ``platform="auto"`` without a GPU and ``compile_pieces="inductor"``). The first config of
    the process to lose its graphs that way warns (:data:`NO_GPU_WARNING`, a ``UserWarning``)."""
    mode = config.cudagraph_mode
    if mode == CUDAGraphMode.NONE or config_platform_name(config) is not None:
        return mode
    with _warned_lock:
        first, _warned[0] = not _warned[0], True
    if first:
        warnings.warn(NO_GPU_WARNING.format(mode=mode.name), UserWarning, stacklevel=2)
    return CUDAGraphMode.NONE
