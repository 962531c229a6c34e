"""CUDA graph modes: what to capture for decode batches and for mixed batches."""

from __future__ import annotations

import enum


class CUDAGraphMode(enum.Enum):
    """How a model step is covered by CUDA graphs.

    ``NONE``, ``PIECEWISE`` and ``FULL`` are *runtime* modes: the one a single step
    runs under. ``FULL_DECODE_ONLY`` and ``FULL_AND_PIECEWISE`` are configuration
    modes that pick a runtime mode per batch kind: a (decode, mixed) pair.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = 3
    FULL_AND_PIECEWISE = 4

    def _pair(self) -> tuple[CUDAGraphMode, CUDAGraphMode]:
        return _PAIRS.get(self, (self, self))

    def decode_mode(self) -> CUDAGraphMode:
        """Runtime mode for uniform decode batches."""
        return self._pair()[0]

    def mixed_mode(self) -> CUDAGraphMode:
        """Runtime mode for prefill and mixed batches."""
        return self._pair()[1]

    def separate_routine(self) -> bool:
        """True when decode and mixed batches use different runtime modes."""
        return self in _PAIRS

    def has_mode(self, mode: CUDAGraphMode | str) -> bool:
        """True when ``mode`` is one of the runtime modes this mode may dispatch."""
        mode = CUDAGraphMode.parse(mode)
        if mode.separate_routine():
            raise ValueError(f"has_mode() takes a runtime mode (NONE, PIECEWISE, FULL), got {mode.name}")
        return mode in self._pair()

    def has_full_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.FULL)

    def has_piecewise_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def max_cudagraph_mode(self) -> CUDAGraphMode:
        """The strongest runtime mode this mode uses (FULL > PIECEWISE > NONE)."""
        return max(self._pair(), key=lambda m: m.value)

    @staticmethod
    def valid_runtime_modes() -> frozenset[CUDAGraphMode]:
        return _RUNTIME

    @classmethod
    def parse(cls, value: CUDAGraphMode | str) -> CUDAGraphMode:
        """Accept a member or its (case-insensitive) name; raise ValueError otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"invalid cudagraph mode {value!r}; valid: {', '.join(cls.__members__)}")


_PAIRS = {
    CUDAGraphMode.FULL_DECODE_ONLY: (CUDAGraphMode.FULL, CUDAGraphMode.NONE),
    CUDAGraphMode.FULL_AND_PIECEWISE: (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE),
}


_RUNTIME = frozenset({CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL})


class AttentionGraphSupport(enum.IntEnum):
    """How much of a batch an attention backend can run inside a full CUDA graph."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3
