"""The ``piecewise_breakable`` torch.compile backend: split at splitting ops, compile the rest.

``piecewise_breakable`` is the entry-point target (a plain function: registering it
at import as well would make torch raise "duplicate name"); :func:`make_backend`
builds a backend for a non-default :class:`CompilationConfig`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from ..capture.session import BreakPoint
from ..capture.wrappers import CUDAGraphWrapper
from ..config import CompilationConfig
from ..modes import CUDAGraphMode
from ..observability import counters, logger
from ..ops import OpMatcher, registered_splitting_ops
from ..platforms.registry import effective_mode
from .cache import PieceCache, compile_cached
from .dump import dump_split
from .keys import CompileState, describe_piece
from .partition import PartitionWrappers, compile_partitioned
from .split import Piece, SplitGraph, split_graph
from .standalone import StandaloneGraphs, random_ops, static_inputs

_graph_ids = iter(range(1 << 62))


def direct_forward(gm: fx.GraphModule) -> Callable[..., Any]:
    """``gm``'s generated ``forward``, bound: what a piece costs to call on every step and replay.

    A lazily recompiled GraphModule's ``forward`` taken before its first call stays
    ``_lazy_forward``, which goes through ``nn.Module.__call__`` and a Dynamo-disable
    wrapper on *every* call (a few microseconds per piece, per step). Recompile now and
    hand out the generated function itself.
    """
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule

        _LazyGraphModule.force_recompile(gm)
    except (ImportError, AttributeError):  # older/newer torch without lazy graph modules
        pass
    return gm.forward


def _example_inputs(gm: fx.GraphModule) -> list[Any]:
    return [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]


def _compile_inductor(gm: fx.GraphModule) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    fresh = fx.GraphModule(gm, graph)  # compile_fx rewrites the module it is given
    return compile_fx(fresh, _example_inputs(gm))  # returns a bare value when the piece does


def _break_name(piece: Piece, matcher: OpMatcher | None) -> str:
    """``piece``'s name with the splitting op(s) it holds, e.g. ``submod_1 (pb_kv::paged_attention)``."""
    found = [matcher.match(n.target) for n in piece.module.graph.nodes if n.op == "call_function"] if matcher else []
    names = dict.fromkeys(op if isinstance(op, str) else getattr(op, "__qualname__", repr(op)) for op in found if op)
    return f"{piece.name} ({', '.join(names)})" if names else piece.name


_RESUME = "torch_dynamo_resume_in_"  # Dynamo's name for the code after a graph break


def graph_break(gm: fx.GraphModule) -> str | None:
    """Why Dynamo cut the model at an edge of ``gm`` when a graph break did: the graph ends at one, or
    resumes a function after one. None for a whole function's graph (or a torch without the record)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    stack = list(getattr(reason, "user_stack", None) or [])
    if reason is None:
        return None
    if getattr(reason, "graph_break", False):
        where = f" at {stack[-1].filename}:{stack[-1].lineno}" if stack else ""
        text = str(getattr(reason, "reason", "")).strip()
        return f"Dynamo ended this graph at a graph break{where} ({text.splitlines()[0] if text else 'no reason given'})"
    name = stack[-1].name if stack else ""
    if name.startswith(_RESUME):
        function = name[len(_RESUME):].rsplit("_at_", 1)[0]
        return f"this graph is {name}: the rest of {function} after a graph break"
    return None


class PiecewiseBackend:
    """A torch.compile backend: ``backend(gm, example_inputs)`` -> stitched callable."""

    def __init__(self, config: CompilationConfig | None = None):
        self.config = config or CompilationConfig()
        if self.config.compile_pieces == "none":
            raise ValueError(
                "a torch.compile backend of CompilationConfig(compile_pieces='none') is refused: 'none' means no "
                "Dynamo at all (the engine or a GraphRunner serves the model uncompiled, its splitting ops breaking "
                "at run time); under torch.compile use compile_pieces='eager' or 'inductor', or pass the model "
                "uncompiled to serve.Engine / GraphRunner with compile_pieces='none'"
            )
        # in-process key -> (compiled code, the objects the key names by id, kept alive so no id is reused)
        self._compiled: dict[str, tuple[Callable[..., Any], list[Any]]] = {}
        self.splits: list[SplitGraph] = []  # every split made, for inspection and tests
        self.piece_wrappers: list[CUDAGraphWrapper] = []  # use_breakable=False: one per compiled piece
        self.partitioned: list[PartitionWrappers] = []  # use_inductor_graph_partition: one per compile
        #: standalone_capture: each compiled graph's capture for calls outside a runner (backend/standalone.py)
        self.standalone: list[StandaloneGraphs] = []
        self._cache = PieceCache(self.config.cache_dir) if self.config.cache_dir is not None else None
        self._serializable = False  # True: every piece compiles to a savable artifact (the AOT path)
        self._artifacts: dict[str, Any] = {}  # in-process key -> savable artifact, when there is one
        self._state = CompileState()  # grad mode, autocast, configs...: described once per graph
        # warnings already given, per backend (a set keyed by id(backend) outlived it: a new backend
        # at the same address stayed silent)
        self._logged: set[str] = set()
        self._logged_lock = threading.Lock()
        self.piece_artifacts: dict[int, Any] = {}  # id(piece.module) -> its artifact (what aot_compile saves)

    def __deepcopy__(self, memo: dict) -> PiecewiseBackend:
        """A new backend of the same (frozen) config: it shares nothing else (no compiled pieces, splits,
        wrappers or graphs). transformers deep-copies its ``CompileConfig``, backend included."""
        return PiecewiseBackend(self.config)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        asked_off = _compile_kwargs(kwargs)  # torch passes mode=/options= only when the user set them
        warn_last_compile()
        graph_index = next(_graph_ids)
        self._state = CompileState()
        counters["graphs"] += 1
        configured = self.config.splitting_ops is not None
        ops = self.config.splitting_ops if configured else registered_splitting_ops()
        if self.config.use_inductor_graph_partition:
            return self._partitioned(gm, ops)
        split = split_graph(gm, ops)
        split.graph_break = graph_break(gm)
        self._log_missing(ops, split, configured, graph_index)
        split_gm = split.split_gm
        matcher = OpMatcher(split.found_ops)
        for piece in split.pieces:
            split_gm.__dict__[piece.name] = self._runner(piece, matcher)  # setattr refuses non-Modules
        counters["pieces"] += len(split.pieces)
        counters["splitting_pieces"] += split.num_splitting
        self.splits.append(split)
        dump_split(split, graph_index, self.config.debug_dump_dir)
        forward = direct_forward(split_gm)
        # nothing to decide per call (the runner's path stays one call) where no plain call may capture, as asked
        if not self.config.standalone_capture or self.config.cudagraph_mode == CUDAGraphMode.NONE or asked_off:
            if asked_off:
                logger.debug("graph %d: no capture outside a runner: %s", graph_index, asked_off)
            return forward
        graphs = StandaloneGraphs(forward, self.config, static=static_inputs(gm), random=random_ops(gm),
                                  name=f"graph {graph_index}")
        self.standalone.append(graphs)
        return graphs

    def _partitioned(self, gm: fx.GraphModule, ops: Sequence[Any]) -> Callable[..., Any]:
        """``use_inductor_graph_partition``: one Inductor compile of ``gm`` partitioned at ``ops``, each
        partition a piece (:mod:`.partition`); its PIECEWISE wrappers join :attr:`piece_wrappers`."""
        wrappers = PartitionWrappers(self.config)
        fn = compile_partitioned(lambda: _compile_inductor(gm), ops, wrappers)
        counters["compiles"] += 1
        counters["compiled_pieces"] += len(wrappers.partitions)
        counters["pieces"] += len(wrappers.partitions)
        self.piece_wrappers.extend(wrappers.wrappers)
        self.partitioned.append(wrappers)
        logger.debug("compiled a graph with Inductor in %d partitions", len(wrappers.partitions))
        return fn

    def _runner(self, piece: Piece, matcher: OpMatcher | None = None) -> Callable[..., Any]:
        if piece.is_splitting:
            return BreakPoint(direct_forward(piece.module), _break_name(piece, matcher))
        counters["compiled_pieces"] += 1
        if self.config.compile_pieces == "eager":
            fn: Callable[..., Any] = direct_forward(piece.module)
        else:
            fn = self._compile(piece)
        if not self.config.use_breakable and effective_mode(self.config) != CUDAGraphMode.NONE:
            wrapper = CUDAGraphWrapper(fn, CUDAGraphMode.PIECEWISE, config=self.config)
            self.piece_wrappers.append(wrapper)
            return wrapper
        return fn

    def _compile(self, piece: Piece) -> Callable[..., Any]:
        """Compiled code for ``piece``: once per distinct piece in this backend (same graph, same
        called objects, same compile-time state: :mod:`.keys`), then from ``cache_dir`` when set
        (loaded by a later process), else Inductor."""
        key, refs = describe_piece(piece.module, stable=False, state=self._state)
        hit = self._compiled.get(key)
        if hit is not None:
            counters["compile_cache_hits"] += 1
            if key in self._artifacts:
                self.piece_artifacts[id(piece.module)] = self._artifacts[key]
            return hit[0]
        if self._cache is None and not self._serializable:
            logger.debug("compiling %s with Inductor", piece.name)
            fn = _compile_inductor(piece.module)
            counters["compiles"] += 1
        else:
            fn, artifact, loaded = compile_cached(piece.module, self._cache, self._state)
            self._artifacts[key] = self.piece_artifacts[id(piece.module)] = artifact
            if not loaded:
                logger.debug("compiled %s with Inductor (serializable)", piece.name)
                counters["compiles"] += 1
        self._compiled[key] = (fn, refs)
        return fn

    def _log_missing(self, ops: Sequence[Any], split: SplitGraph, configured: bool, graph_index: int) -> None:
        if ops and not split.found_ops and effective_mode(self.config).has_piecewise_cudagraphs():
            # PIECEWISE graphs of this graph would hold attention: wrong for mixed batches, and silent otherwise.
            with self._logged_lock:
                first = "no splitting op" not in self._logged
                self._logged.add("no splitting op")
            if first:
                names = [op if isinstance(op, str) else getattr(op, "__name__", None) or repr(op) for op in ops]
                if split.graph_break is not None:  # registration is not the cause: the op may be in the next graph
                    logger.warning(
                        "graph %d has no splitting op, so its PIECEWISE graphs capture it whole, attention included. "
                        "Dynamo cut the model here, not at a splitting op: %s. Each graph break makes graphs of its "
                        "own (torch._dynamo.explain(model)(*inputs) lists them); remove it (boolean-mask indexing, "
                        ".item(), printing a tensor, ...) so the model compiles as one graph split only at its "
                        "splitting ops (looked for: %s)",
                        graph_index, split.graph_break, ", ".join(names),
                    )
                else:
                    logger.warning(
                        "graph %d has no splitting op, so its PIECEWISE graphs capture it whole, attention included; "
                        "register the model's attention op with pb.register_splitting_op (looked for: %s)",
                        graph_index, ", ".join(names),
                    )
            return
        for op in ops:
            if any(op is f or op == f for f in split.found_ops):
                continue
            with self._logged_lock:
                if repr(op) in self._logged:
                    continue
                self._logged.add(repr(op))
            log = logger.warning if configured else logger.debug
            log("splitting op %r did not appear in graph %d; nothing was split there", op, graph_index)

    def clear_graphs(self) -> None:
        """Drop the graphs every per-piece wrapper (``use_breakable=False``) captured."""
        for wrapper in self.piece_wrappers:
            wrapper.clear_graphs()

    def drop(self, mode: CUDAGraphMode | str, descriptor: Any) -> bool:
        """Drop the per-piece graphs (``use_breakable=False``) of ``descriptor`` in ``mode``; True when any was."""
        return any([wrapper.drop(mode, descriptor) for wrapper in self.piece_wrappers])  # noqa: C419 (drop all)

    def reset(self) -> None:
        """Forget compiled pieces, recorded splits and per-piece wrappers (with their graphs)."""
        self.clear_graphs()
        self._compiled.clear()
        self._artifacts.clear()
        self.piece_artifacts.clear()
        self.splits.clear()
        self.piece_wrappers.clear()
        self.standalone.clear()
        self.partitioned.clear()


#: torch.compile's ``mode=`` values: those with CUDA graphs, and the one without.
MODES_WITH_GRAPHS = ("default", "reduce-overhead", "max-autotune")
MODES_WITHOUT_GRAPHS = ("max-autotune-no-cudagraphs",)


def _compile_kwargs(kwargs: dict[str, Any]) -> str | None:
    """torch.compile's ``mode``/``options`` honored (a mode without CUDA graphs turns standalone capture off:
    returns why) or refused naming what is valid."""
    unknown = set(kwargs) - {"mode", "options"}
    if unknown:
        raise TypeError(f"piecewise_breakable: unexpected arguments {sorted(unknown)} from torch.compile")
    if kwargs.get("options"):
        raise ValueError(
            f"torch.compile(options={kwargs['options']!r}) is refused by piecewise_breakable: options are Inductor's "
            "settings for a whole-graph compile; this backend compiles pieces (CompilationConfig(compile_pieces=...)) "
            "and its CUDA graphs follow CompilationConfig(cudagraph_mode=..., standalone_capture=...)"
        )
    mode = kwargs.get("mode") or "default"
    if mode in MODES_WITHOUT_GRAPHS:
        return f"torch.compile(mode={mode!r}) asks for no CUDA graphs"
    if mode not in MODES_WITH_GRAPHS:
        raise ValueError(f"torch.compile(mode={mode!r}) is not a mode piecewise_breakable knows: one of "
                         f"{list(MODES_WITH_GRAPHS + MODES_WITHOUT_GRAPHS)}")
    return None


def warn_last_compile() -> bool:
    """Called while Dynamo compiles a graph: when this is the last compile Dynamo makes of the frame
    (``torch._dynamo.config.recompile_limit``), warn that later calls failing its guards run uncompiled,
    without any graph (Dynamo itself says so only at debug level); returns whether it warned."""
    import torch._dynamo.config as dynamo_config
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    limit = getattr(dynamo_config, "recompile_limit", None) or getattr(dynamo_config, "cache_size_limit", 8)
    if compile_id is None or compile_id.frame_compile_id is None or compile_id.frame_compile_id + 1 != limit:
        return False
    logger.warning(
        "Dynamo compiles frame %s for the %d-th time, its last (torch._dynamo.config.recompile_limit=%d): later calls "
        "that fail its guards run uncompiled, without CUDA graphs. Cause: a value the guards pin changes between "
        "calls (TORCH_LOGS=recompiles names it; a Python int that grows every step, such as a sliding-window "
        "StaticCache's length, recompiles every call); or many models share one compiled forward (transformers' "
        "generate after %d models in one process): raise recompile_limit", compile_id.frame_id, limit, limit, limit)
    return True


def make_backend(config: CompilationConfig | None = None) -> PiecewiseBackend:
    """A backend for ``config``: ``torch.compile(model, backend=pb.make_backend(config))``."""
    if config is not None and not isinstance(config, CompilationConfig):
        raise TypeError(f"make_backend takes a CompilationConfig, got {type(config).__name__}")
    return PiecewiseBackend(config)


def piecewise_breakable(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """Entry point of ``torch.compile(model, backend="piecewise_breakable")`` with the default config."""
    return _default_backend()(gm, example_inputs, **kwargs)


_default: PiecewiseBackend | None = None


def _default_backend() -> PiecewiseBackend:
    global _default
    if _default is None:
        _default = PiecewiseBackend(CompilationConfig())
    return _default


def register() -> None:
    """Register ``piecewise_breakable`` by hand (source checkouts without the entry point). Idempotent."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "piecewise_breakable" not in _BACKENDS:
        register_backend(name="piecewise_breakable")(piecewise_breakable)
