"""CompilationConfig: one frozen, validated description of what to compile and capture."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .modes import CUDAGraphMode
from .ops import canonicalize_op
from .validation import is_int

PLATFORMS = ("auto", "cuda", "simulated")
DEFAULT_MAX_CAPTURE_SIZE = 512
# One graph per capture size, and a padding table entry per token count: bound both (vLLM caps near 8k).
MAX_CAPTURE_SIZE_LIMIT = 1 << 16
#: "none": no Dynamo at all; the engine serves the model's own forward, splitting ops break at run time
#: (capture/op_breaks.py)
COMPILE_PIECES = ("inductor", "eager", "none")


def default_capture_sizes(max_capture_size: int) -> tuple[int, ...]:
    """[1, 2, 4], every 8 below 256, every 16 from 256 up to ``max_capture_size``."""
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, max_capture_size + 1, 16)]
    return tuple(s for s in ladder if s <= max_capture_size)


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    cudagraph_mode: CUDAGraphMode | str = CUDAGraphMode.FULL_AND_PIECEWISE
    splitting_ops: tuple[Any, ...] | list[Any] | None = None
    capture_sizes: tuple[int, ...] | list[int] | None = None
    max_capture_size: int | None = None  # None: the largest of capture_sizes, else 512
    compile_pieces: str = "inductor"
    use_breakable: bool = True
    platform: str = "auto"
    num_warmups: int = 1
    debug_dump_dir: str | os.PathLike[str] | None = None
    max_num_seqs: int | None = None  # set: FULL keys of mixed batches carry num_reqs=min(padded, max_num_seqs)
    debug_checks: bool = False  # poison stale replay outputs, escaped break outputs on CUDA, cross-rank key checks (slower; for debugging)
    cache_dir: str | os.PathLike[str] | None = None  # compiled pieces saved and loaded across processes
    use_ubatching: bool = False  # micro-batching (dual-batch overlap): UBatchWrapper instead of the graph wrappers
    dbo_decode_token_threshold: int = 32  # a pure-decode step is micro-batched from this many tokens
    dbo_prefill_token_threshold: int = 512  # a step with a prefill, from this many tokens
    use_inductor_graph_partition: bool = False  # one Inductor compile partitioned at the splitting ops (not yet)
    #: plain torch.compile calls (no runner, no forward context) capture and replay graphs (backend/standalone.py)
    standalone_capture: bool = True  # False: such calls run the compiled graph as it is (engines' runners set it)
    standalone_max_graphs: int = 16  # input signatures each compiled graph captures outside a runner; then eager
    standalone_memory_budget: int | None = None  # graph pool bytes those captures may add (None: no limit)

    def __post_init__(self) -> None:
        set_ = object.__setattr__.__get__(self)
        try:
            set_("cudagraph_mode", CUDAGraphMode.parse(self.cudagraph_mode))
        except ValueError as e:
            raise ValueError(f"CompilationConfig.cudagraph_mode: {e}") from None
        if self.splitting_ops is not None:
            if isinstance(self.splitting_ops, (str, bytes)) or not hasattr(self.splitting_ops, "__iter__"):
                raise ValueError(
                    f"CompilationConfig.splitting_ops must be None or a list of ops, got {self.splitting_ops!r}"
                )
            try:
                set_("splitting_ops", tuple(canonicalize_op(op) for op in self.splitting_ops))
            except (TypeError, ValueError) as e:
                raise ValueError(f"CompilationConfig.splitting_ops: {e}") from None
        graphs = self.cudagraph_mode != CUDAGraphMode.NONE
        explicit_max = self.max_capture_size is not None
        object.__setattr__(self, "_max_derived", not explicit_max)  # not a field: replace() re-derives it
        if explicit_max:
            least = 1 if graphs else 0
            if not is_int(self.max_capture_size) or not least <= self.max_capture_size <= MAX_CAPTURE_SIZE_LIMIT:
                raise ValueError(
                    f"CompilationConfig.max_capture_size must be an int in [{least}, {MAX_CAPTURE_SIZE_LIMIT}] "
                    f"(0 only with cudagraph_mode NONE; larger batches run eagerly), got {self.max_capture_size!r}"
                )
        if self.capture_sizes is not None:
            iterable = hasattr(self.capture_sizes, "__iter__") and not isinstance(self.capture_sizes, (str, bytes))
            sizes = list(self.capture_sizes) if iterable else []
            bad = [s for s in sizes if not is_int(s) or s < 1]
            if bad or not iterable or (graphs and not sizes):
                raise ValueError(
                    "CompilationConfig.capture_sizes must be a non-empty list of positive ints (empty only with "
                    f"cudagraph_mode NONE), got {self.capture_sizes!r}"
                )
            top = max(sizes, default=0)
            if explicit_max and top > self.max_capture_size:
                raise ValueError(
                    f"CompilationConfig.capture_sizes {sorted(s for s in sizes if s > self.max_capture_size)} exceed "
                    f"max_capture_size={self.max_capture_size}; raise max_capture_size, drop those sizes, or leave "
                    "max_capture_size unset (it then follows capture_sizes)"
                )
            if top > MAX_CAPTURE_SIZE_LIMIT:
                raise ValueError(
                    f"CompilationConfig.capture_sizes hold {top}, above the limit {MAX_CAPTURE_SIZE_LIMIT}; "
                    "larger batches run eagerly"
                )
            set_("capture_sizes", tuple(sorted({int(s) for s in sizes})))  # numpy ints stored as ints
            if not explicit_max:
                set_("max_capture_size", top)
        elif not explicit_max:
            set_("max_capture_size", DEFAULT_MAX_CAPTURE_SIZE)
        if self.compile_pieces not in COMPILE_PIECES:
            raise ValueError(f"CompilationConfig.compile_pieces must be one of {COMPILE_PIECES}, got {self.compile_pieces!r}")
        if not isinstance(self.use_breakable, bool):
            raise ValueError(f"CompilationConfig.use_breakable must be a bool, got {self.use_breakable!r}")
        if self.platform not in PLATFORMS:
            raise ValueError(f"CompilationConfig.platform must be one of {PLATFORMS}, got {self.platform!r}")
        if self.platform == "simulated" and self.compile_pieces == "inductor":
            raise ValueError(
                "CompilationConfig: platform='simulated' needs compile_pieces='eager' or 'none' (Inductor's fused CPU "
                "kernels bypass the ATen dispatcher the simulator records); got compile_pieces='inductor'"
            )
        if self.compile_pieces == "none":
            _check_no_dynamo(self)
        if not is_int(self.num_warmups) or self.num_warmups < 0:
            raise ValueError(f"CompilationConfig.num_warmups must be an int >= 0, got {self.num_warmups!r}")
        for name in ("debug_dump_dir", "cache_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"CompilationConfig.{name} must be None or a path, got {value!r}")
        if self.max_num_seqs is not None and (not is_int(self.max_num_seqs) or self.max_num_seqs < 1):
            raise ValueError(f"CompilationConfig.max_num_seqs must be None or a positive int, got {self.max_num_seqs!r}")
        if not isinstance(self.debug_checks, bool):
            raise ValueError(f"CompilationConfig.debug_checks must be a bool, got {self.debug_checks!r}")
        if not isinstance(self.use_ubatching, bool):
            raise ValueError(f"CompilationConfig.use_ubatching must be a bool, got {self.use_ubatching!r}")
        if not isinstance(self.use_inductor_graph_partition, bool):
            raise ValueError(
                f"CompilationConfig.use_inductor_graph_partition must be a bool, got {self.use_inductor_graph_partition!r}"
            )
        if self.use_inductor_graph_partition:
            why = _partition_refusal(self)
            if why:
                raise ValueError(
                    f"CompilationConfig.use_inductor_graph_partition=True is refused: {why}; or use the default "
                    "(False): each piece between splitting ops is compiled on its own (compile_pieces)"
                )
        if not isinstance(self.standalone_capture, bool):
            raise ValueError(f"CompilationConfig.standalone_capture must be a bool, got {self.standalone_capture!r}")
        if not is_int(self.standalone_max_graphs) or self.standalone_max_graphs < 0:
            raise ValueError(f"CompilationConfig.standalone_max_graphs must be an int >= 0, got {self.standalone_max_graphs!r}")
        budget = self.standalone_memory_budget
        if budget is not None and (not is_int(budget) or budget < 0):
            raise ValueError(f"CompilationConfig.standalone_memory_budget must be None or bytes >= 0, got {budget!r}")
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            value = getattr(self, name)
            if not is_int(value) or value < 2:  # a micro-batched step has two non-empty halves
                raise ValueError(f"CompilationConfig.{name} must be an int >= 2 (tokens), got {value!r}")
        for name in ("max_capture_size", "num_warmups", "max_num_seqs", "dbo_decode_token_threshold",
                     "dbo_prefill_token_threshold"):
            value = getattr(self, name)
            if value is not None and type(value) is not int:
                set_(name, int(value))  # a numpy integer scalar passed the checks: the config holds Python ints

    @property
    def max_capture_size_derived(self) -> bool:
        """``max_capture_size`` was not given: it follows ``capture_sizes`` (and ``replace`` derives it again)."""
        return self._max_derived

    @property
    def sizes(self) -> tuple[int, ...]:
        """The capture sizes in effect, ascending."""
        return self.capture_sizes if self.capture_sizes is not None else default_capture_sizes(self.max_capture_size)

    def replace(self, **changes: Any) -> CompilationConfig:
        """A copy with ``changes`` applied and validated; a max_capture_size derived from
        capture_sizes is derived again."""
        if getattr(self, "_max_derived", False) and "max_capture_size" not in changes:
            changes["max_capture_size"] = None
        return dataclasses.replace(self, **changes)


def _check_no_dynamo(config: CompilationConfig) -> None:
    """Refuse what ``compile_pieces="none"`` cannot do, naming the field: each of these needs compiled pieces."""
    if not config.use_breakable:
        raise ValueError(
            "CompilationConfig(compile_pieces='none', use_breakable=False) is refused: use_breakable=False captures "
            "one graph per compiled piece, and without Dynamo there are no pieces; PIECEWISE steps of an uncompiled "
            "model are captured by the breakable wrapper (use_breakable=True), or compile with compile_pieces='eager'"
        )
    if config.cache_dir is not None:
        raise ValueError(
            "CompilationConfig(compile_pieces='none', cache_dir=...) is refused: cache_dir saves compiled pieces, "
            "and compile_pieces='none' compiles nothing; pass cache_dir=None"
        )


def _partition_refusal(config: CompilationConfig) -> str:
    """Why ``config`` cannot compile with Inductor's graph partition here ("" when it can)."""
    import torch

    if not torch.cuda.is_available():
        return ("no GPU here, and Inductor partitions only GPU nodes (torch's Scheduler.should_partition gives every "
                "CPU node the reason 'cpu ops', so a CPU graph gets no partition at all)")
    if config.platform == "simulated" or config.compile_pieces != "inductor":
        return (f"it is an Inductor compile on the GPU: needs platform 'auto' or 'cuda' and compile_pieces='inductor', "
                f"got platform={config.platform!r}, compile_pieces={config.compile_pieces!r}")
    if config.use_breakable:
        return ("partitions are captured one PIECEWISE graph each (the per-piece scheme), not by the breakable "
                "wrapper: pass use_breakable=False")
    if config.cache_dir is not None:
        return ("this release does not save partitioned compiles in cache_dir (Inductor's own FX graph cache "
                "still applies across processes): pass cache_dir=None")
    missing = missing_partition_hooks()
    if missing:
        return f"torch {torch.__version__} lacks {', '.join(missing)} (custom_should_partition_ops came with pytorch PR 166458; torch 2.13 has all of them)"
    return ""


#: The torch hooks ``use_inductor_graph_partition`` uses, as (module, attribute).
PARTITION_HOOKS = (
    ("torch._inductor.config", "graph_partition"),
    ("torch._inductor.config", "custom_should_partition_ops"),
    ("torch._inductor.utils", "set_customized_partition_wrappers"),
)


def missing_partition_hooks() -> list[str]:
    """The hooks of :data:`PARTITION_HOOKS` this torch lacks (empty: it can partition at the splitting ops).
    Imports Inductor: called only for a config that asks for the partition."""
    import importlib

    missing = []
    for module, name in PARTITION_HOOKS:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module}.{name}")
    return missing
