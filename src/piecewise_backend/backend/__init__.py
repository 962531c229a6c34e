"""The ``piecewise_breakable`` torch.compile backend: split, compile pieces (cached), AOT.

``piecewise_backend.backend:piecewise_breakable`` is the ``torch_dynamo_backends`` entry point."""

from .aot import AOTFileError, CompiledModel, aot_compile, load_compiled
from .compiler import PiecewiseBackend, make_backend, piecewise_breakable, register
from .split import Piece, SplitGraph, split_graph
from .trust import TRUST_ENV, UntrustedPathError

__all__ = [
    "make_backend",
    "piecewise_breakable",
    "PiecewiseBackend",
    "register",
    "Piece",
    "split_graph",
    "SplitGraph",
    "aot_compile",
    "AOTFileError",
    "CompiledModel",
    "load_compiled",
    "TRUST_ENV",
    "UntrustedPathError",
]
