"""Inductor's graph partition as the piece compiler (``CompilationConfig(use_inductor_graph_partition=True)``).

Instead of splitting the Dynamo graph at the splitting ops and compiling each piece on its own, the
whole graph is compiled by Inductor once, with ``torch._inductor.config.custom_should_partition_ops``
naming the splitting ops: Inductor's scheduler cuts its generated code at every node of those ops
(a ``FallbackKernel``: a custom op Inductor has no lowering for, ``pb_kv::paged_attention`` and its
mutated ``out`` included) and calls each partition between them. The hook
``torch._inductor.utils.set_customized_partition_wrappers`` hands every partition to
:class:`PartitionWrappers` when the compile finishes (and again on an FX-graph-cache hit), which
makes it a piece: a :class:`~..capture.wrappers.CUDAGraphWrapper` (PIECEWISE) when the config
captures PIECEWISE graphs, the bare partition otherwise. The splitting ops run eagerly between
partitions; a FULL graph (the runner's outer wrapper) captures the whole compiled function, the
partition wrappers passing through.

Inductor partitions GPU nodes only (``Scheduler.should_partition`` gives every CPU node the
reason "cpu ops": a CPU graph has no partition at all), so the config refuses the option on a
machine without a GPU; see docs/design.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..capture.wrappers import CUDAGraphWrapper
from ..config import CompilationConfig
from ..modes import CUDAGraphMode
from ..platforms.registry import effective_mode


def partition_op_names(ops: Sequence[Any]) -> list[str]:
    """``ops`` (splitting ops) as the ``ns::name`` / ``ns::name.overload`` strings Inductor partitions at.

    Only custom ops (and ATen ops) lower to a node Inductor can partition at; a Python function
    splitting op (an ``eager_break`` function, ``F.scaled_dot_product_attention``) is traced through
    or decomposed, so no partition could start there: refused, naming it.
    """
    names, refused = [], []
    for op in ops:
        if isinstance(op, str):
            names.append(op)
        elif isinstance(op, torch._ops.OpOverload):
            names.append(f"{op._schema.name}.{op._overloadname}")
        elif isinstance(op, torch._ops.OpOverloadPacket):
            names.append(op._qualified_op_name)
        elif isinstance(getattr(op, "_qualname", None), str):  # a torch.library.custom_op object
            names.append(op._qualname)
        else:
            refused.append(getattr(op, "__qualname__", None) or repr(op))
    if refused:
        raise ValueError(
            f"use_inductor_graph_partition=True: splitting ops {refused} are Python functions, which Inductor "
            "traces through or decomposes, so it cannot partition at them; make each a torch.library custom op "
            "(it then lowers to a fallback kernel Inductor partitions at), or use "
            "use_inductor_graph_partition=False (pieces split before compiling)"
        )
    return names


class Partition:
    """One partition of an Inductor compile, as a piece: called with Inductor's list of its inputs.

    The partition empties the list it is given (to free inputs early); it gets a copy, so a capture
    wrapper around this piece still sees the call's inputs after the call.
    """

    __slots__ = ("count", "fn", "index")

    def __init__(self, fn: Callable[[list], Any], index: int, count: int) -> None:
        self.fn, self.index, self.count = fn, index, count

    def __call__(self, args: list) -> Any:
        return self.fn(list(args))

    def __repr__(self) -> str:
        return f"Partition({self.index + 1} of {self.count})"


class PartitionWrappers:
    """The wrapper function of one partitioned compile (``set_customized_partition_wrappers``'s argument):
    each partition becomes a :class:`Partition`, inside a ``CUDAGraphWrapper(PIECEWISE)`` when ``config``
    captures PIECEWISE graphs. ``partitions`` and ``wrappers`` list what it made, in partition order."""

    def __init__(self, config: CompilationConfig) -> None:
        self.config = config
        self.graphs = effective_mode(config).has_piecewise_cudagraphs()
        self.partitions: list[Partition] = []
        self.wrappers: list[CUDAGraphWrapper] = []

    def __call__(self, fn: Callable[[list], Any], metadata: Any) -> Callable[[list], Any]:
        piece = Partition(fn, metadata.partition_index, metadata.num_partitions)
        if len(self.partitions) == metadata.num_partitions:  # applied again (a cache hit in the same compile)
            self.partitions.clear()
            self.wrappers.clear()
        self.partitions.append(piece)
        if not self.graphs:
            return piece
        wrapper = CUDAGraphWrapper(piece, CUDAGraphMode.PIECEWISE, config=self.config)
        self.wrappers.append(wrapper)
        return wrapper


def compile_partitioned(
    compile_whole: Callable[[], Callable[..., Any]], ops: Sequence[Any], wrappers: PartitionWrappers
) -> Callable[..., Any]:
    """Run ``compile_whole`` (an Inductor compile of the whole graph) partitioned at ``ops``, each
    partition wrapped by ``wrappers``; the hook is set only for this compile and restored after."""
    from torch._inductor import config as inductor_config
    from torch._inductor import utils as inductor_utils

    names = partition_op_names(ops)
    holder = getattr(inductor_utils, "_unstable_customized_partition_wrapper", None)  # torch has no getter
    previous = getattr(holder, "wrapper", None)
    inductor_utils.set_customized_partition_wrappers(wrappers)
    try:
        with inductor_config.patch(graph_partition=True, custom_should_partition_ops=names):
            return compile_whole()
    finally:
        inductor_utils.set_customized_partition_wrappers(previous)
