"""CudagraphDispatcher: from a batch's token count to (runtime mode, graph key)."""

from __future__ import annotations

import bisect

from ..config import CompilationConfig
from ..context import BatchDescriptor
from ..modes import CUDAGraphMode
from ..validation import is_int as _is_int

_NONE, _PIECEWISE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
_EAGER_KEYS = 1 << 16  # bounds the NONE keys kept (one small object per token count seen)


class CudagraphDispatcher:
    """Pads a batch to a captured size and picks the runtime mode that has a graph for it.

    Order: exact FULL key (uniform decode) -> relaxed FULL -> relaxed PIECEWISE -> NONE.
    """

    def __init__(self, config: CompilationConfig):
        if not isinstance(config, CompilationConfig):
            raise TypeError(f"CudagraphDispatcher takes a CompilationConfig, got {type(config).__name__}")
        self.config = config
        self.sizes: list[int] = list(config.sizes)
        self.max_size = self.sizes[-1] if self.sizes else 0
        # padding table: index n -> smallest captured size >= n (O(1) per step; the config bounds its length)
        self._pad = [0] * (self.max_size + 1)
        for n in range(1, self.max_size + 1):
            self._pad[n] = self.sizes[bisect.bisect_left(self.sizes, n)]
        # keys prebuilt per size: building a BatchDescriptor validates its fields, too slow per step
        self._relaxed = {s: BatchDescriptor(s) for s in self.sizes}
        seqs = config.max_num_seqs
        # FULL graphs of mixed batches: metadata that depends on the request count is keyed by it (vLLM)
        self._full_mixed = {s: BatchDescriptor(s, num_reqs=min(s, seqs)) if seqs else self._relaxed[s] for s in self.sizes}
        self._eager: dict[int, BatchDescriptor] = {}  # NONE steps' keys, built once per token count
        self.mode = _NONE
        self.uniform_decode_query_len = 1
        self.keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {_PIECEWISE: set(), _FULL: set()}
        self._routes()

    def initialize_keys(self, mode: CUDAGraphMode | str, uniform_decode_query_len: int = 1) -> None:
        """Build the set of keys ``dispatch`` may return for ``mode``."""
        mode = CUDAGraphMode.parse(mode)
        if not _is_int(uniform_decode_query_len) or uniform_decode_query_len < 1:
            raise ValueError(f"uniform_decode_query_len must be a positive int, got {uniform_decode_query_len!r}")
        if mode != _NONE and not self.sizes:
            raise ValueError(
                f"cudagraph_mode {mode.name} needs capture sizes, but the config has none "
                "(capture_sizes=[] or max_capture_size=0 is for cudagraph_mode NONE)"
            )
        self.mode, self.uniform_decode_query_len = mode, uniform_decode_query_len
        self.keys = {_PIECEWISE: set(), _FULL: set()}
        mixed = mode.mixed_mode()
        if mixed == _PIECEWISE:
            self.keys[_PIECEWISE].update(self._relaxed.values())
        elif mixed == _FULL:
            self.keys[_FULL].update(self._full_mixed.values())
        if mode.separate_routine() and mode.decode_mode() == _FULL:
            q = uniform_decode_query_len
            self.keys[_FULL].update(
                BatchDescriptor(s, num_reqs=s // q, uniform=True) for s in self.sizes if s % q == 0
            )
        self._routes()

    def _routes(self) -> None:
        """Per padded size, the key each branch of ``dispatch`` finds in ``keys`` (absent: none);
        dicts of ints, since hashing descriptors and modes runs Python code on every step."""
        full, q = self.keys[_FULL], self.uniform_decode_query_len
        exact = {s: BatchDescriptor(s, num_reqs=s // q, uniform=True) for s in self.sizes if s % q == 0}
        self._exact_full = {s: d for s, d in exact.items() if d in full}
        self._mixed_full = {s: d for s, d in self._full_mixed.items() if d in full}
        self._mixed_piecewise = {s: d for s, d in self._relaxed.items() if d in self.keys[_PIECEWISE]}

    def pad(self, num_tokens: int) -> int:
        """The captured size a batch of ``num_tokens`` runs at (``num_tokens`` itself above the largest)."""
        if not _is_int(num_tokens) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        return self._pad[num_tokens] if num_tokens <= self.max_size else num_tokens

    def dispatch(
        self,
        num_tokens: int,
        *,
        uniform_decode: bool = False,
        num_reqs: int | None = None,
        disable_full: bool = False,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        if not _is_int(num_tokens) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        if uniform_decode is not True and uniform_decode is not False:
            raise ValueError(f"uniform_decode must be a bool, got {uniform_decode!r}")
        if disable_full is not True and disable_full is not False:
            raise ValueError(f"disable_full must be a bool, got {disable_full!r}")
        if num_reqs is not None and (not _is_int(num_reqs) or num_reqs < 1):
            raise ValueError(f"num_reqs must be None or a positive int, got {num_reqs!r}")
        q = self.uniform_decode_query_len
        if uniform_decode and num_reqs is not None and num_reqs * q != num_tokens:
            raise ValueError(
                f"a uniform decode batch of {num_reqs} requests has {num_reqs * q} tokens "
                f"(uniform_decode_query_len={q}), got num_tokens={num_tokens}"
            )
        if self.mode == _NONE or num_tokens > self.max_size:
            return _NONE, self.eager_key(num_tokens)
        padded = self._pad[num_tokens]
        if not disable_full:
            if uniform_decode:
                exact = self._exact_full.get(padded)
                if exact is not None:
                    return _FULL, exact
            mixed = self._mixed_full.get(padded)
            if mixed is not None:
                return _FULL, mixed
        relaxed = self._mixed_piecewise.get(padded)
        if relaxed is not None:
            return _PIECEWISE, relaxed
        return _NONE, self.eager_key(num_tokens)

    def piecewise_key(self, num_tokens: int) -> BatchDescriptor | None:
        """The PIECEWISE key a mixed batch padded to ``num_tokens`` dispatches to (None: no such key)."""
        return self._mixed_piecewise.get(num_tokens)

    def eager_key(self, num_tokens: int) -> BatchDescriptor:
        """The key of a step of ``num_tokens`` run eagerly (runtime mode NONE): ``BatchDescriptor(num_tokens)``,
        built once per token count."""
        desc = self._eager.get(num_tokens)
        if desc is None:
            desc = BatchDescriptor(num_tokens)
            if len(self._eager) < _EAGER_KEYS:
                self._eager[num_tokens] = desc
        return desc

    def capture_descriptors(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """Every key to capture at startup, per mode, largest first (PIECEWISE before FULL)."""
        plan = []
        for mode in (_PIECEWISE, _FULL):
            if self.keys[mode]:
                descs = sorted(self.keys[mode], key=lambda d: (d.num_tokens, d.uniform), reverse=True)
                plan.append((mode, descs))
        return plan
