"""Compiled pieces saved to ``CompilationConfig.cache_dir`` and loaded by later processes.

One file per distinct piece, named by a key over everything that changes its code
(:func:`~piecewise_backend.backend.keys.describe_piece` with ``stable=True``: the graph with the bodies of
higher-order ops, called functions by their code and closures, constants by value, input
metadata and symbolic ranges, grad mode, autocast, default dtype, Inductor's and AOTAutograd's
configs and custom passes by ``uuid()``) and the environment: torch (version and source hash),
Python, this package's version and the device (CPU vector ISA, GPU capability). A piece the key
cannot name across processes is compiled and not cached (a WARNING says why). Pieces are compiled
with ``torch._inductor.standalone_compile(..., aot=True)``, whose artifacts serialize to bytes.

A file is ``MAGIC | sha256(payload) | key | payload``, written to a temp file and renamed,
so concurrent writers never expose a half-written entry. Anything wrong with an entry (missing,
truncated, corrupt, another key, a deserialization error) or with the directory (read-only)
logs a WARNING and the piece compiles: the cache can cost a compile, never a result. Entries are
pickles: a directory or entry another user can write is refused (:mod:`.trust`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from ..observability import counters, logger
from .keys import CompileState, Uncacheable, describe_piece
from .trust import UntrustedPathError, check_trusted, check_trusted_file

MAGIC = b"PBPIECE1"
_DIGEST = 32
_KEY_LEN = 64


def example_inputs(gm: fx.GraphModule) -> list[Any]:
    """The fake example values of ``gm``'s placeholders, as Dynamo recorded them."""
    return [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]


def returns_bare_value(gm: fx.GraphModule) -> bool:
    """True when ``gm`` returns a single value, not a tuple (``split_module`` does that)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return not isinstance(out.args[0], (tuple, list))


@functools.cache
def _environment(device_type: str) -> str:
    from torch._inductor.codecache import torch_key

    from ..version import __version__

    parts = [
        f"torch={torch.__version__}",
        f"torch_key={torch_key().hex()}",
        f"python={sys.version_info[:3]}",
        f"piecewise_backend={__version__}",
    ]
    if device_type == "cpu":
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        parts.append(f"vec_isa={pick_vec_isa()!s}")
    elif device_type == "cuda" and torch.cuda.is_available():
        parts.append(f"capability={torch.cuda.get_device_capability()}")
    return "\n".join(parts)


def piece_key(gm: fx.GraphModule, state: CompileState | None = None) -> str:
    """A hex digest equal only for pieces that compile to the same code in the same environment.

    Raises :class:`~piecewise_backend.backend.keys.Uncacheable` for a piece whose code cannot be named
    across processes (a closure over an object, a custom pass without ``uuid()``, an op whose
    Python kernel is inlined, ...): such a piece is compiled, never cached.
    """
    inputs = example_inputs(gm)
    devices = {v.device.type for v in inputs if isinstance(v, torch.Tensor)}
    h = hashlib.sha256(describe_piece(gm, stable=True, state=state)[0].encode())
    for device in sorted(devices) or ["cpu"]:
        h.update(_environment(device).encode())
    return h.hexdigest()


def compile_artifact(gm: fx.GraphModule) -> Any:
    """Compile ``gm`` with Inductor into a serializable artifact (``.serialize()`` -> bytes)."""
    return torch._inductor.standalone_compile(gm, example_inputs(gm), dynamic_shapes="from_graph", aot=True)


def load_artifact(payload: bytes) -> Any:
    from torch._inductor.standalone_compile import AOTCompiledArtifact

    with torch._inductor.config.patch(enable_autograd_for_aot=True):
        return AOTCompiledArtifact.deserialize(payload)


def as_piece_callable(artifact: Any, bare: bool) -> Callable[..., Any]:
    """``artifact`` with the piece's calling convention: a loaded artifact returns a list even
    where the piece returns a bare value."""
    if not bare:
        return artifact

    def first(*args: Any) -> Any:
        out = artifact(*args)
        return out[0] if isinstance(out, (list, tuple)) else out

    return first


def check_frame(data: bytes, key: str) -> str | None:
    """What is wrong with ``data`` as the cache entry for ``key``, or None."""
    head = len(MAGIC) + _DIGEST + _KEY_LEN
    if len(data) < head or not data.startswith(MAGIC):
        return "not a piecewise_backend cache entry (bad header or truncated)"
    if data[len(MAGIC) + _DIGEST : head].decode("ascii", "replace") != key:
        return "entry holds another key"
    if hashlib.sha256(data[head:]).digest() != data[len(MAGIC) : len(MAGIC) + _DIGEST]:
        return "checksum mismatch (truncated or corrupt)"
    return None


class PieceCache:
    """The files of one ``cache_dir``: ``load(key)`` -> artifact or None, ``save(key, artifact)``.

    ``~`` is expanded. A directory another user can write is refused with ``PermissionError``
    (entries are pickles: :mod:`.trust`) with :class:`~.trust.UntrustedPathError`, unless ``PB_TRUST_CACHE_DIR=1``.
    The check runs when the cache is made, again before every write (the directory may have been
    created since, by anyone), and before reads until the directory is found in place.
    """

    def __init__(self, cache_dir: str | os.PathLike[str]):
        self.root = Path(os.path.expanduser(os.fspath(cache_dir))) / "pieces"
        self._checked = False  # the whole path existed and passed: nothing on it can appear later
        self._check()

    def _check(self) -> None:
        check_trusted(self.root.parent, "cache_dir")  # the error names the directory the user gave
        check_trusted(self.root, "cache_dir")
        self._checked = self.root.is_dir()

    def path(self, key: str) -> Path:
        return self.root / f"{key}.piece"

    def load(self, key: str) -> Any | None:
        path = self.path(key)
        if not self._checked:
            self._check()
        try:
            with open(path, "rb") as f:
                check_trusted_file(f.fileno(), path, "compile cache entry")
                data = f.read()
        except FileNotFoundError:
            return None
        except UntrustedPathError:
            raise
        except OSError as e:
            logger.warning("compile cache: cannot read %s (%s); compiling the piece", path, e)
            return None
        problem = check_frame(data, key)
        if problem is None:
            try:
                return load_artifact(data[len(MAGIC) + _DIGEST + _KEY_LEN :])
            except Exception as e:  # any failure of torch's loader: recompile rather than crash
                problem = f"torch could not load it ({type(e).__name__}: {e})"
        counters["cache_rejects"] += 1
        logger.warning("compile cache: ignoring %s: %s; compiling the piece", path, problem)
        return None

    def save(self, key: str, artifact: Any) -> bool:
        try:
            payload = artifact.serialize()
        except Exception as e:
            logger.warning("compile cache: piece not serializable (%s: %s); not cached", type(e).__name__, e)
            return False
        data = MAGIC + hashlib.sha256(payload).digest() + key.encode("ascii") + payload
        tmp = None
        self._check()  # before creating: a parent someone else made since is refused, nothing written
        try:
            self.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # private: entries are pickles
            self.root.mkdir(mode=0o700, exist_ok=True)
            self._check()  # exist_ok: another user may have made them between the check and here
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{key[:16]}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(key))  # atomic: readers see the old file or the whole new one
            tmp = None
        except UntrustedPathError:
            raise
        except OSError as e:
            logger.warning("compile cache: cannot write to %s (%s); the piece stays compiled in memory only", self.root, e)
            return False
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        counters["cache_saves"] += 1
        return True


def compile_cached(gm: fx.GraphModule, cache: PieceCache | None,
                   state: CompileState | None = None) -> tuple[Callable[..., Any], Any, bool]:
    """(piece callable, artifact, loaded?) for ``gm``: from ``cache`` when it holds it, else compiled
    (and saved to ``cache``). ``state``: see :func:`~piecewise_backend.backend.keys.describe_piece`."""
    bare = returns_bare_value(gm)
    key = None
    if cache is not None:
        try:
            key = piece_key(gm, state)
        except Uncacheable as e:
            logger.warning("compile cache: piece not cached: %s", e)
    if cache is not None and key is not None:
        artifact = cache.load(key)
        if artifact is not None:
            counters["cache_loads"] += 1
            logger.debug("compile cache: loaded %s", key[:16])
            return as_piece_callable(artifact, bare), artifact, True
    artifact = compile_artifact(gm)
    if cache is not None and key is not None:
        cache.save(key, artifact)
    return artifact, artifact, False
