"""KV cache slots per attention *call site*: for models that run one attention module more than once per forward.

The paged cache normally holds one K/V per attention layer, found by the module's ``layer_idx``. Some
models call attention where a module's ``layer_idx`` does not name one K/V history:

* a shared block (zamba's ``ZambaAttention``, zamba2's shared transformer) is one module called at
  several depths, with the layer passed as an argument (``layer_idx`` None or -1);
* a module calls the interface twice per forward (diffllama's two value halves);
* a stack of layers runs in a loop (dory's recurrent section, hrm_text's H/L cycles, whose two stacks
  also reuse layer indices 0..n-1).

Without a cache, as the engine runs the model, every call attends over the keys of its own call in
the same forward: one K/V history per *call*. :class:`CallSites` gives each call of a forward its
own cache slot: the probe lists the calls in the order the forward makes them, the cache holds one
slot per call, and the attention entry asks :meth:`CallSites.next` for its slot. Tracing runs that
Python once, so the slot indices are constants in the graph (FULL, PIECEWISE and eager pieces alike).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class CallSites:
    """The attention calls of one forward, in order: the i-th call writes and reads cache slot ``i``."""

    def __init__(self, modules: Sequence[torch.nn.Module]):
        if not modules:
            raise ValueError("CallSites needs the attention modules of at least one call")
        #: the module of each call site, in call order (a module appears once per call it makes)
        self.modules = list(modules)
        self.count = 0

    def __len__(self) -> int:
        return len(self.modules)

    def start(self) -> None:
        """A forward begins: the next call is call site 0."""
        self.count = 0

    def next(self, module: torch.nn.Module) -> int:
        """The cache slot of this call of ``module``: the next call site, checked against the probe's order."""
        i = self.count
        if i >= len(self.modules) or self.modules[i] is not module:
            expected = type(self.modules[i]).__name__ if i < len(self.modules) else "no further call"
            raise RuntimeError(
                f"attention call {i} of this forward comes from {type(module).__name__}, but the probe saw {expected} "
                f"there ({len(self.modules)} calls per forward): the model calls attention in an order that depends "
                "on its input, which per-call-site KV slots cannot serve"
            )
        self.count = i + 1
        return i

    @staticmethod
    def needed(calls: Sequence[tuple[torch.nn.Module, object]]) -> bool:
        """Whether ``calls`` (``(module, layer_idx)`` in call order) need call-site slots: a module called
        twice, a module without an int ``layer_idx`` of its own, or two modules sharing one ``layer_idx``."""
        modules = {id(m) for m, _ in calls}
        layers = [layer for _, layer in calls]
        unindexed = any(not isinstance(layer, int) or layer < 0 for layer in layers)
        return len(modules) < len(calls) or unindexed or len(set(layers)) < len(modules)
