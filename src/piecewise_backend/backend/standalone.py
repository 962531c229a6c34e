"""Graphs for plain ``torch.compile`` calls: the compiled graph's own capture, outside any runner.

A graph the backend compiled is called in two ways. Inside a forward context (a ``GraphRunner``, an
engine, a wrapper the caller set up) the runner chose the mode and the descriptor, and the call goes
straight to the split graph. Called plainly (``torch.compile(model, backend=...)`` and then
``model(x)``, as transformers' ``generate`` or a gpt-fast loop does), :class:`StandaloneGraphs` captures
and replays by itself, as Inductor's ``mode="reduce-overhead"`` does for its users:

* one graph per input *signature*: every tensor's shape, stride, dtype and device, every Python int
  (a dynamic size), and the address of every input with a static address (parameters, buffers,
  ``torch._dynamo.mark_static_address`` tensors such as transformers' ``StaticCache``): a static input
  that moved is a new signature, captured anew, never read stale;
* a signature's first call runs eagerly (lazy initialisation, autotuning); its second captures (FULL
  first where the mode allows, else or if that fails breakable, PIECEWISE) and returns the replay's
  values; later calls replay. Other inputs are staged into static buffers (the wrapper's
  ``InputSpec``), and in-place writes to them are copied back to the caller's tensors;
* outputs are copied out of graph memory on every replay, so an output the caller holds never
  changes under the next call (outputs that are static inputs are returned as they are);
* eager, said once with the reason, where nothing may be captured: the mode is NONE, the config turns
  it off (``standalone_capture=False``), no platform (``platform="auto"`` without a GPU), inputs that
  require grad under grad mode, training randomness (dropout would replay one mask), a signature whose
  captures failed, or past ``standalone_max_graphs`` / ``standalone_memory_budget``. A second thread
  calling while one captures or replays runs eagerly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map

from ..capture.memory import release_cached
from ..capture.session import capture_active
from ..capture.wrappers import BreakableCUDAGraphWrapper
from ..config import CompilationConfig
from ..context import BatchDescriptor, current_forward_context, set_forward_context
from ..modes import CUDAGraphMode
from ..observability import counters, logger
from ..platforms.registry import config_platform_name

__all__ = ["RANDOM_OPS", "RUNAWAY", "SIGNATURES_PER_GRAPH", "StandaloneGraphs", "random_ops", "static_inputs"]

_FULL, _PIECEWISE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE

#: Calls whose draws a replay would repeat (names of ``call_function`` targets of Dynamo's graph).
RANDOM_OPS = ("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
              "bernoulli", "rand", "randn", "randint", "randperm", "normal", "multinomial", "rand_like",
              "randn_like", "randint_like", "poisson")


def static_inputs(gm: fx.GraphModule) -> list[bool]:
    """Per placeholder of Dynamo's graph: does the input have a static address (a parameter, a module
    buffer, a ``mark_static_address`` tensor: Dynamo's ``_dynamo_static_input_type``)?"""
    flags = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            kept = node.meta.get("tensor_dict") or {}
            value = node.meta.get("example_value")
            flags.append(bool(kept.get("_dynamo_static_input_type")) or isinstance(value, torch.nn.Parameter))
    return flags


def random_ops(gm: fx.GraphModule) -> list[str]:
    """The random calls of ``gm`` a replay would repeat: dropout in training mode, random factories."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if name not in RANDOM_OPS:
            continue
        if "dropout" in name and not (node.kwargs.get("training", len(node.args) > 2 and node.args[2]) is True):
            continue  # dropout with training=False is the identity
        found.append(name)
    return found


#: Signatures in a row without a repeat after which :class:`StandaloneGraphs` says that nothing replays.
RUNAWAY = 4
#: Signatures a graph keeps at most, per ``standalone_max_graphs``; later new ones run eagerly, untracked.
SIGNATURES_PER_GRAPH = 4


def _difference(before: tuple, after: tuple, num_static: int) -> str:
    """What differs between two signatures (``StandaloneGraphs._key``: one part per input, then the static
    inputs' addresses), in words."""
    n = len(after) - num_static
    for i, (a, b) in enumerate(zip(before, after)):
        if a == b:
            continue
        if i >= n:
            return f"static input {i - n} moved (its address changed)"
        if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 4:
            return f"input {i}'s shape/stride/dtype went from {a[:3]} to {b[:3]}"
        return (f"input {i} went from {a!r} to {b!r} (a Python value the graph takes: a dynamic size or a "
                "counter such as a sliding-window StaticCache's length; a graph holds one value)")
    return "the number of inputs changed"


class _Signature:
    __slots__ = ("calls", "desc", "mode", "spare")

    def __init__(self, index: int):
        self.calls = 0
        self.desc = BatchDescriptor(index + 1)  # keys this signature's entry in the wrapper (1, 2, ...)
        self.mode: CUDAGraphMode | None = None  # the captured mode; None: not captured (yet, or never)
        self.spare = False  # runs eagerly for good (failed, or over a bound)


class StandaloneGraphs:
    """The callable the backend returns for one compiled graph (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any], config: CompilationConfig, *, static: Sequence[bool],
                 random: Sequence[str] = (), name: str = "graph", off: str | None = None):
        self.fn, self.config, self.name = fn, config, name
        self.static = [i for i, s in enumerate(static) if s]
        self.wrapper = BreakableCUDAGraphWrapper(fn, runtime_mode=None, config=config)  # FULL and PIECEWISE entries
        mode = config.cudagraph_mode
        self.modes = ([_FULL] if mode.has_full_cudagraphs() else []) + ([_PIECEWISE] if mode.has_piecewise_cudagraphs() else [])
        self.signatures: dict[tuple, _Signature] = {}
        self.memory_bytes = 0  # graph pool bytes this graph's captures added
        self.said: set[str] = set()  # reasons already logged
        self._lock = threading.Lock()
        self.off = off or self._why_off(random)  # why this graph never captures outside a runner (None: it does)

    def _why_off(self, random: Sequence[str]) -> str | None:
        if not self.config.standalone_capture:
            return "CompilationConfig(standalone_capture=False)"
        if not self.modes:
            return f"cudagraph_mode {self.config.cudagraph_mode.name}"
        if config_platform_name(self.config) is None:
            return "no CUDA device and platform='auto' (platform='simulated' simulates graphs on the CPU)"
        if random:
            return f"the graph draws random numbers ({', '.join(sorted(set(random)))}): a replay would repeat one draw"
        return None

    def __call__(self, *args: Any) -> Any:
        if current_forward_context() is not None or capture_active():  # a runner's step, or inside a capture
            return self.fn(*args)
        if self.off is not None:
            self._say(self.off)
            return self.fn(*args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            self._say("inputs require grad under grad mode (a graph holds no autograd); run under torch.no_grad()")
            return self.fn(*args)
        if not self._lock.acquire(blocking=False):  # another thread captures or replays this graph now
            return self.fn(*args)
        try:
            return self._run(args)
        finally:
            self._lock.release()

    def _key(self, args: tuple) -> tuple:
        parts: list[Any] = [
            (tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args
        ]
        parts.extend(args[i].data_ptr() for i in self.static if isinstance(args[i], torch.Tensor))
        return tuple(parts)

    def _run(self, args: tuple) -> Any:
        key = self._key(args)
        sig = self.signatures.get(key)
        if sig is None:
            if len(self.signatures) >= SIGNATURES_PER_GRAPH * self.config.standalone_max_graphs:
                return self.fn(*args)  # bounded: said when they started to run away (_new_signature)
            self._new_signature(key)
            sig = self.signatures[key] = _Signature(len(self.signatures))
        sig.calls += 1
        if sig.mode is not None:
            with set_forward_context(sig.mode, sig.desc):
                return self._copied(self.wrapper(*args), args)
        if sig.spare or sig.calls < 2:  # the first call of a signature runs eagerly (its warm-up)
            return self.fn(*args)
        captured = sum(s.mode is not None for s in self.signatures.values())
        if captured >= self.config.standalone_max_graphs:
            sig.spare = True
            self._say(f"standalone_max_graphs={self.config.standalone_max_graphs} graphs are captured; new input "
                      "signatures run eagerly (a new shape every call? mark the dimension dynamic, or pad)")
            return self.fn(*args)
        return self._capture(sig, args)

    def _new_signature(self, key: tuple) -> None:
        """Say once when calls bring a new signature each (none seen twice yet): nothing is ever replayed;
        name what changed from the last one."""
        if ("runaway" in self.said or len(self.signatures) + 1 < RUNAWAY
                or any(s.calls > 1 for s in self.signatures.values())):
            return
        self.said.add("runaway")
        last = next(reversed(self.signatures))
        self._say(f"every call brings a new input signature ({RUNAWAY} so far, none seen twice), so no graph is "
                  f"replayed: {_difference(last, key, len(self.static))}; at most "
                  f"{SIGNATURES_PER_GRAPH * self.config.standalone_max_graphs} are kept")

    def _capture(self, sig: _Signature, args: tuple) -> Any:
        platform = self.wrapper.platform
        errors = []
        for mode in self.modes:
            before = platform.memory()
            try:
                with set_forward_context(mode, sig.desc):
                    out = self.wrapper(*args)
            except Exception as e:  # noqa: BLE001 - the next mode, or eager, with the reason said once
                errors.append(f"{mode.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            grown = platform.memory() - before
            budget = self.config.standalone_memory_budget
            if budget is not None and self.memory_bytes + grown > budget:
                self.wrapper.drop(mode, sig.desc)
                release_cached(platform)
                sig.spare = True
                self._say(f"standalone_memory_budget={budget} bytes reached; new input signatures run eagerly")
                return self._copied(out, args)
            self.memory_bytes += grown
            sig.mode = mode
            logger.debug("%s: captured input signature %d in mode %s", self.name, sig.desc.num_tokens, mode.name)
            return self._copied(out, args)
        sig.spare = True
        counters["capture_failures"] += 1
        self._say(f"capturing failed ({'; '.join(errors)}); this input signature runs eagerly")
        return self.fn(*args)

    def _copied(self, out: Any, args: tuple) -> Any:
        """``out`` with every tensor in graph memory copied (the next replay overwrites it); an output that is
        one of the static inputs (a cache returned) stays that tensor."""
        keep = {id(args[i]) for i in self.static}
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and id(t) not in keep else t, out)

    def _say(self, reason: str) -> None:
        if reason in self.said:
            return
        self.said.add(reason)
        logger.warning("torch.compile'd %s called outside a runner: no CUDA graph (%s)", self.name, reason)

    def captured(self) -> dict[CUDAGraphMode, int]:
        """How many input signatures replay a graph, per mode."""
        counts: dict[CUDAGraphMode, int] = {}
        for s in self.signatures.values():
            if s.mode is not None:
                counts[s.mode] = counts.get(s.mode, 0) + 1
        return counts
