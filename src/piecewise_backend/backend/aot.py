"""Restart without Dynamo: compile a model ahead of time with the piecewise backend, save, load.

:func:`aot_compile` traces ``model.forward`` once with Dynamo (``fullgraph``), splits and
compiles it like the ``piecewise_breakable`` backend, and can save the result; in a later
process :func:`load_compiled` rebuilds the callable from the file without tracing: Dynamo's
guards are restored from the file, the split graph and its pieces are unpickled (as code, without
their fake-tensor metadata), and each compiled piece is deserialized (``standalone_compile(...,
aot=True)`` bytes). docs/restart.md lists the guards and limits.

Built on torch's ``torch.compile(...).aot_compile`` and ``torch.compiler.load_compiled_function``
(experimental in torch 2.11 and 2.13; torch 2.11 offers the first only with
``torch._dynamo.config.enable_aot_compile``, which :func:`aot_compile` turns on for its own compile).
Limits, checked where possible: the grad mode of every call must be the one at compile time; the
loaded function serves the shapes its guards accept (mark the token dimension with
:func:`~piecewise_backend.shapes.mark_token_dim` before compiling to serve every size); the file is
tied to the torch and Python versions it was made with.

A file is ``MAGIC | sha256(payload) | payload`` (the payload a pickle): every way a file can be
wrong (truncated, bit flips, another format, torch failing to load it) is an :class:`AOTFileError`
naming the file. Loading unpickles, which runs code: the file and its directories must be
writable by no other user (:mod:`.trust`).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..config import CompilationConfig
from ..observability import counters
from .cache import as_piece_callable, load_artifact, returns_bare_value
from .compiler import PiecewiseBackend, direct_forward
from .split import Piece, SplitGraph
from .trust import check_trusted, check_trusted_file

FORMAT = 2
MAGIC = b"PBAOT\x00\x02\n"  # the format is in the magic: an older file fails the header check
_DIGEST = 32


class AOTFileError(RuntimeError):
    """An AOT file that cannot be loaded: the message names the file and why."""


def _environment() -> dict[str, Any]:
    from ..version import __version__

    return {"format": FORMAT, "torch": torch.__version__, "python": sys.version_info[:2], "piecewise_backend": __version__}


def _pickle_split(split: SplitGraph) -> bytes:
    """The split graph and its pieces as code, without their fake-tensor metadata (which does
    not pickle, and which nothing needs once the pieces are compiled)."""
    from torch.fx._graph_pickler import GraphPickler, Options

    holder = fx.GraphModule({p.name: p.module for p in split.pieces}, split.split_gm.graph)
    graphs = [split.split_gm.graph, *(p.module.graph for p in split.pieces)]
    saved = {n: n.meta for g in graphs for n in g.nodes}
    try:
        for n in saved:
            n.meta = {}
        return GraphPickler.dumps(holder, Options(ops_filter=None))
    finally:
        for n, meta in saved.items():
            n.meta = meta


def _unpickle_split(data: bytes, kinds: list[tuple[str, int, bool]]) -> SplitGraph:
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    holder = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    for module in (holder, *(holder.get_submodule(name) for name, _, _ in kinds)):
        module.recompile()  # a GraphModule comes back from the pickle without its generated code
    pieces = [Piece(name, index, splitting, holder.get_submodule(name)) for name, index, splitting in kinds]
    return SplitGraph(holder, pieces, [])


class _AOTBackend(PiecewiseBackend):
    """The backend of :func:`aot_compile`: every compiled piece is a savable artifact."""

    def __init__(self, config: CompilationConfig):
        super().__init__(config)
        self._serializable = True

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        """A ``PiecewiseArtifact`` of the stitched pieces (its class is built on first use)."""
        forward = super().__call__(gm, example_inputs, **kwargs)
        split = self.splits[-1]
        inductor = self.config.compile_pieces == "inductor"
        pieces = {p.index: self.piece_artifacts[id(p.module)] for p in split.pieces if inductor and not p.is_splitting}
        return _artifact_class()(forward, split, self.config, pieces)


class _LoadBackend(PiecewiseBackend):
    """Assembles a loaded split from deserialized pieces instead of compiling them."""

    def __init__(self, config: CompilationConfig, pieces: dict[int, Any]):
        super().__init__(config)
        self._loaded = pieces

    def _compile(self, piece: Piece) -> Callable[..., Any]:
        counters["cache_loads"] += 1
        return as_piece_callable(self._loaded[piece.index], returns_bare_value(piece.module))

    def assemble(self, split: SplitGraph) -> Callable[..., Any]:
        for piece in split.pieces:
            split.split_gm.__dict__[piece.name] = self._runner(piece)  # setattr refuses non-Modules
        return direct_forward(split.split_gm)


def __getattr__(name: str) -> Any:
    if name == "PiecewiseArtifact":  # built on first use (pickle finds it here too): see _artifact_class
        return _artifact_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _artifact_class() -> type:
    """``PiecewiseArtifact``, built on first use: its base, ``SerializableCallable``, imports all of Dynamo
    (about 1.2 s), which ``import piecewise_backend`` would otherwise pay for every user."""
    from torch._dynamo.aot_compile_types import SerializableCallable

    class PiecewiseArtifact(SerializableCallable):
        """What :func:`aot_compile`'s backend returns: the stitched pieces, savable as bytes."""

        def __init__(self, forward: Callable[..., Any], split: SplitGraph, config: CompilationConfig, pieces: dict[int, Any]):
            self.forward, self.split, self.config, self.pieces = forward, split, config, pieces

        def __call__(self, *args: Any) -> Any:
            return self.forward(*args)

        @classmethod
        def serialize_compile_artifacts(cls, fn: PiecewiseArtifact) -> bytes:
            blobs: dict[int, bytes] = {}  # identical pieces share one artifact object: store it once
            for a in fn.pieces.values():
                if id(a) not in blobs:
                    blobs[id(a)] = a.serialize()
            state = {
                "env": _environment(),
                "split": _pickle_split(fn.split),
                "kinds": [(p.name, p.index, p.is_splitting) for p in fn.split.pieces],
                "config": fn.config.replace(splitting_ops=[], cache_dir=None, debug_dump_dir=None),
                "pieces": {i: id(a) for i, a in fn.pieces.items()},
                "blobs": blobs,
            }
            return pickle.dumps(state)

        @classmethod
        def deserialize_compile_artifacts(cls, data: bytes) -> PiecewiseArtifact:
            state = pickle.loads(data)
            env = _environment()
            if state["env"] != env:
                raise RuntimeError(f"compiled with {state['env']}, cannot load under {env}; compile again")
            artifacts = {k: load_artifact(b) for k, b in state["blobs"].items()}
            pieces = {i: artifacts[k] for i, k in state["pieces"].items()}
            split = _unpickle_split(state["split"], state["kinds"])
            forward = _LoadBackend(state["config"], pieces).assemble(split)
            return cls(forward, split, state["config"], pieces)

    PiecewiseArtifact.__module__, PiecewiseArtifact.__qualname__ = __name__, "PiecewiseArtifact"  # pickled by name
    return PiecewiseArtifact


class CompiledModel:
    """A model compiled ahead of time: call it like the model; ``save(path)`` for a later process."""

    def __init__(self, fn: Any, model: torch.nn.Module, grad_enabled: bool, inference_mode: bool,
                 inference_args: Sequence[bool | None] = ()):
        self.fn, self.model, self.grad_enabled, self.inference_mode = fn, model, grad_enabled, inference_mode
        self.inference_args = list(inference_args)  # per positional input: an inference tensor at compile?

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() != self.grad_enabled:
            want = "enabled" if self.grad_enabled else "disabled (torch.no_grad() or torch.inference_mode())"
            raise RuntimeError(f"this model was compiled with grad mode {want}; call it the same way "
                               f"(grad mode is now {'enabled' if torch.is_grad_enabled() else 'disabled'})")
        if any(hasattr(a, "_has_dynamo_dim_marking") for a in args):
            # Dynamic-dim marks steer a trace; this model is traced already, and its guards
            # refuse a marked tensor. A plain view of it carries no mark.
            args = tuple(a.view(a.shape) if hasattr(a, "_has_dynamo_dim_marking") else a for a in args)
        try:
            return self.fn(self.model, *args, **kwargs)
        except RuntimeError as e:
            problem = self._inference_mismatch(args) if "dispatch key set mismatch" in str(e) else None
            if problem is None:
                raise
            raise RuntimeError(problem) from e

    def _inference_mismatch(self, args: Sequence[Any]) -> str | None:
        """Why Dynamo's dispatch-key guard refused a call, when it is an inference tensor or its absence.

        A tensor made under ``torch.inference_mode()`` has other dispatch keys than one made outside;
        the guards of the trace check them, and a loaded model cannot trace again. Copying the
        tensor would break in-place updates the model makes to it (a KV cache), so it is refused."""
        for i, (a, was) in enumerate(zip(args, self.inference_args)):
            if isinstance(a, torch.Tensor) and was is not None and a.is_inference() != was:
                made = "made outside torch.inference_mode()" if was else "an inference tensor"
                want = "under torch.inference_mode()" if was else "outside torch.inference_mode()"
                return (f"argument {i} is {made}, but this model was compiled with one made {want}; the guards of "
                        f"the compiled trace tell them apart (dispatch keys) and it cannot trace again. Create "
                        f"the input {want}, or compile with example inputs made the way the model is called")
        return None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write to ``path`` (``~`` expanded) atomically (temp file, then rename), private to this user (0600)."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        payload = pickle.dumps({"env": _environment(), "grad_enabled": self.grad_enabled,
                                "inference_mode": self.inference_mode, "inference_args": self.inference_args,
                                "function": AOTCompiledFunction.serialize(self.fn).serialized_data})
        data = MAGIC + hashlib.sha256(payload).digest() + payload
        path = os.path.expanduser(os.fspath(path))
        directory = os.path.dirname(os.path.abspath(path))
        check_trusted(directory, "to save an AOT file into")  # a file others could swap: load would refuse it
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".pb_aot.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise


def aot_compile(model: torch.nn.Module, example_inputs: Sequence[Any], *, config: CompilationConfig | None = None,
                path: str | os.PathLike[str] | None = None) -> CompiledModel:
    """Compile ``model`` for ``example_inputs`` (positional) with the piecewise backend; save to ``path`` if given.

    Runs under the current grad mode, which every later call must match. Mark dynamic
    dimensions on ``example_inputs`` first (:func:`~piecewise_backend.shapes.mark_token_dim`).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"aot_compile takes an nn.Module, got {type(model).__name__}")
    if config is not None and not isinstance(config, CompilationConfig):
        raise TypeError(f"aot_compile's config must be a CompilationConfig, got {type(config).__name__}")
    backend = _AOTBackend(config or CompilationConfig())
    # torch 2.11 has the API but adds ``.aot_compile`` only with this flag on (on by default in 2.13)
    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(model.forward, fullgraph=True, backend=backend)
    compiled = compiled.aot_compile((tuple(example_inputs), {}))
    inference_args = [a.is_inference() if isinstance(a, torch.Tensor) else None for a in example_inputs]
    result = CompiledModel(compiled, model, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), inference_args)
    if path is not None:
        result.save(path)
    return result


def _read_state(path: str | os.PathLike[str], trust: bool) -> dict[str, Any]:
    check_trusted(path, "AOT file", trust=trust)
    with open(path, "rb") as f:
        check_trusted_file(f.fileno(), path, "AOT file", trust=trust)  # the file as opened, not as named
        data = f.read()
    head = len(MAGIC) + _DIGEST
    if not data.startswith(MAGIC) or len(data) < head:
        raise AOTFileError(f"{path} is not a file saved by piecewise_backend.aot_compile (format {FORMAT}): bad "
                           "header or truncated (a file of an older version of this package has another header); "
                           "compile again")
    if hashlib.sha256(data[head:]).digest() != data[len(MAGIC) : head]:
        raise AOTFileError(f"{path} is corrupt or truncated (its sha256 does not match its contents); compile again")
    try:
        state = pickle.loads(data[head:])
    except Exception as e:
        raise AOTFileError(f"{path} could not be read ({type(e).__name__}: {e}); compile again") from e
    if not isinstance(state, dict) or state.get("env") != _environment():
        found = state.get("env") if isinstance(state, dict) else None
        raise AOTFileError(f"{path} was saved by {found}; this process is {_environment()}: compile again")
    return state


def load_compiled(path: str | os.PathLike[str], model: torch.nn.Module, *, trust: bool = False) -> CompiledModel:
    """Load what :func:`aot_compile` saved, for ``model`` (same class and parameter shapes; its own weights).

    The file is unpickled, which runs code: it and its directories must be writable by no other
    user (else :class:`~piecewise_backend.backend.trust.UntrustedPathError`), unless ``trust=True`` or
    ``PB_TRUST_CACHE_DIR=1``. Any other problem with the file raises :class:`AOTFileError`.
    """
    path = os.path.expanduser(os.fspath(path))
    state = _read_state(path, trust)
    try:
        # Guards record dispatch keys relative to the thread-local modes they are built under:
        # rebuild them under the modes of the compile.
        with torch.inference_mode(state["inference_mode"]), torch.set_grad_enabled(state["grad_enabled"]):
            fn = torch.compiler.load_compiled_function(io.BytesIO(state["function"]))
    except Exception as e:
        raise AOTFileError(f"{path} could not be loaded ({type(e).__name__}: {e}); compile again") from e
    return CompiledModel(fn, model, state["grad_enabled"], state["inference_mode"], state.get("inference_args", ()))
