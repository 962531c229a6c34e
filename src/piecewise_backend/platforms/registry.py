"""Which platform a config runs on: resolve a name, hand out the platform, and its warm-up hooks."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from ..config import CompilationConfig
from ..modes import CUDAGraphMode
from .base import Platform


def resolve_platform_name(name: str) -> str | None:
    """'auto' -> 'cuda' when a GPU is present, else None (no graphs on a real CPU run)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else None
    return name


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
    scope = getattr(platform, "warmup_scope", None)
    return contextlib.nullcontext() if scope is None else scope()


def warmed_step(platform: Platform | None) -> contextlib.AbstractContextManager[None]:
    """Around warm-ups and the capture they prepare: what they warmed up counts for that
    capture only, whether or not one happens (CUDA: skips the lazy warm-up; elsewhere a no-op)."""
    scope = getattr(platform, "warmed_step", None)
    return contextlib.nullcontext() if scope is None else scope()


def warm_up(platform: Platform, fn: Any, args: tuple, kwargs: dict, times: int) -> None:
    """Before a lazy capture, warm ``fn`` up ``times`` times where ``platform`` needs it (CUDA)."""
    hook = getattr(platform, "warm_up", None)
    if hook is not None:
        hook(fn, args, kwargs, times)


def effective_mode(config: CompilationConfig) -> CUDAGraphMode:
    """The configured mode, or NONE when platform='auto' finds no GPU (CPU users want speed, not simulation)."""
    if resolve_platform_name(config.platform) is None:
        return CUDAGraphMode.NONE
    return config.cudagraph_mode
