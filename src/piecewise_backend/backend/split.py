"""Split a Dynamo FX graph at splitting ops into an ordered list of pieces."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from ..ops import OpMatcher, OpSpec

# Targets that only allocate: a piece holding nothing else is merged into its neighbour.
_ALLOC_FUNCTIONS = {torch.empty, torch.empty_like, torch.empty_strided}
_ALLOC_METHODS = {"new_empty", "new_empty_strided"}


@dataclasses.dataclass
class Piece:
    name: str
    index: int
    is_splitting: bool
    module: fx.GraphModule

    def __repr__(self) -> str:
        kind = "splitting" if self.is_splitting else "compiled"
        return f"Piece({self.name!r}, index={self.index}, {kind}, nodes={len(self.module.graph.nodes)})"


@dataclasses.dataclass
class SplitGraph:
    split_gm: fx.GraphModule
    pieces: list[Piece]
    found_ops: list[OpSpec]  # the splitting specs that matched at least one node
    #: why Dynamo cut the model at this graph's edge when a graph break did (set by the backend), else None
    graph_break: str | None = None

    @property
    def num_splitting(self) -> int:
        return sum(p.is_splitting for p in self.pieces)


def _is_alloc(node: fx.Node) -> bool:
    if node.op == "call_function":
        if node.target in _ALLOC_FUNCTIONS:
            return True
        return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.name in (
            "aten::empty",
            "aten::empty_like",
            "aten::empty_strided",
        )
    return node.op == "call_method" and node.target in _ALLOC_METHODS


def _is_size(node: fx.Node) -> bool:
    if isinstance(node.meta.get("example_value"), torch.Size):
        return True
    if node.op == "call_method" and node.target == "size" and len(node.args) == 1 and not node.kwargs:
        return True
    return node.op == "call_function" and node.target is getattr and node.args[1:] == ("shape",)


def _assign(graph: fx.Graph, matcher: OpMatcher) -> tuple[dict[fx.Node, int], set[int], list[OpSpec]]:
    ids: dict[fx.Node, int] = {}
    splitting: set[int] = set()
    found: list[OpSpec] = []
    cur, in_split = 0, False
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0] in ids:
            ids[node] = ids[node.args[0]]  # no tuple crosses a boundary
            continue
        spec = matcher.match(node.target) if node.op == "call_function" else None
        if spec is not None:
            if not any(spec is f or spec == f for f in found):
                found.append(spec)
            if not in_split:
                cur, in_split = cur + 1, True
            splitting.add(cur)
        elif in_split:
            cur, in_split = cur + 1, False
        ids[node] = cur
    return ids, splitting, found


def _merge(ids: dict[fx.Node, int], splitting: set[int]) -> dict[fx.Node, int]:
    """Fold allocation-only pieces into a neighbour, merge same-kind neighbours, renumber 0..k-1."""
    members: dict[int, list[fx.Node]] = {}
    for node, i in ids.items():
        members.setdefault(i, []).append(node)
    order = sorted(members)
    remap = {i: i for i in order}
    for pos, i in enumerate(order):
        if i not in splitting and len(order) > 1 and all(_is_alloc(n) for n in members[i]):
            remap[i] = order[pos - 1] if pos > 0 else order[pos + 1]
    for i in order:  # resolve chains (an alloc piece mapped onto another one)
        while remap[remap[i]] != remap[i]:
            remap[i] = remap[remap[i]]
    targets = list(dict.fromkeys(remap[i] for i in order))
    final: dict[int, int] = {}
    n, last_kind = -1, None
    for t in targets:
        kind = t in splitting
        if kind != last_kind:
            n += 1
        final[t], last_kind = n, kind
    return {node: final[remap[i]] for node, i in ids.items()}


def _localize_sizes(graph: fx.Graph, ids: dict[fx.Node, int]) -> None:
    """Give each piece that uses a torch.Size its own copy, so no Size crosses a boundary."""
    for node in list(graph.nodes):
        if node not in ids or not _is_size(node):
            continue
        foreign: dict[int, list[fx.Node]] = {}
        for user in node.users:
            if user.op != "output" and ids.get(user) != ids[node]:
                foreign.setdefault(ids[user], []).append(user)
        for piece, users in foreign.items():
            with graph.inserting_before(min(users, key=_position(graph))):
                copy = graph.node_copy(node)
            ids[copy] = piece
            for user in users:
                user.replace_input_with(node, copy)
        if not node.users:
            graph.erase_node(node)
            del ids[node]


def _position(graph: fx.Graph) -> Any:
    pos = {n: i for i, n in enumerate(graph.nodes)}
    return pos.__getitem__


def split_graph(gm: fx.GraphModule, splitting_ops: Iterable[Any] | Any) -> SplitGraph:
    """Split ``gm`` (a Dynamo-level graph) at ``splitting_ops`` (one op or a list); ``gm`` is not modified."""
    if isinstance(splitting_ops, str) or callable(splitting_ops):  # one op (an op packet is iterable)
        splitting_ops = [splitting_ops]
    matcher = OpMatcher(splitting_ops)
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    work = fx.GraphModule(gm, graph)

    ids, splitting, found = _assign(graph, matcher)
    ids = _merge(ids, splitting)
    _localize_sizes(graph, ids)
    is_split_piece = {i: False for i in ids.values()}
    for node, i in ids.items():
        if node.op == "call_function" and matcher.match(node.target) is not None:
            is_split_piece[i] = True

    split_gm = split_module(work, None, lambda n: ids[n], keep_original_order=True)
    pieces = []
    for name, module in split_gm.named_children():
        if name.startswith("submod_"):
            i = int(name[len("submod_") :])
            pieces.append(Piece(name, i, is_split_piece[i], module))
    pieces.sort(key=lambda p: p.index)
    for pos, p in enumerate(pieces):
        p.index = pos
    return SplitGraph(split_gm, pieces, found)
