"""Automatic breaks for models that read the host: a module that calls ``.tolist()`` / ``.item()`` runs eagerly.

The adapter's probe names the innermost module active at each host read (jetmoe's router, longcat's
experts). A graph cannot hold such a read, and Dynamo cannot trace it. Instead of refusing the model,
the smallest module enclosing the read whose call takes and returns only tensors (and constants) is
turned into a **break point**: its ``forward`` becomes one call of the custom op
``pb_hf::module_break``, a registered splitting op, so Dynamo records a single opaque node (it would
inline a plain ``eager_break`` function) and the backend makes that piece a break. The router's own
call is not enough when its host values are Python ints its parent consumes (jetmoe's
``expert_size`` list): the break must hold that consumer too.

The op's output shapes (its fake implementation) come from two recording forwards at different token
counts: every output size is ``a * tokens + b``. A graph cannot hold a break, so such a model has no
FULL graphs (:func:`no_full_graphs`).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..capture.session import is_in_breakable_graph
from ..config import CompilationConfig
from ..ops import register_splitting_op
from ..runner.assembly import drop_full_graphs
from .adapter import probe
from .patching import Changes, Undo
from .probe_result import ProbeResult, host_read_refusal

OP = "pb_hf::module_break"
_PROBE_TOKENS = (3, 5)  # two token counts: each output size is then a * tokens + b
_CONSTANTS = (type(None), bool, int, float, str)
#: The live break points, by key (the op's ``key`` argument). Each is held by its module's forward: an
#: entry goes when its model does.
_BREAKS: weakref.WeakValueDictionary[int, ModuleBreak] = weakref.WeakValueDictionary()
_KEYS = itertools.count()
#: The break points' paths of each model's latest adaptation (:func:`installed`), gone with the model.
_INSTALLED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()


# A template describes a call's tree: ("T",) a tensor, ("C", value) a constant,
# ("S", type, (children...)) a tuple or list, ("D", (keys...), (children...)) a dict.


def _template(value: Any) -> tuple | None:
    """The template of ``value``, or None if a leaf is neither a tensor nor a constant."""
    if isinstance(value, torch.Tensor):
        return ("T",)
    if isinstance(value, _CONSTANTS):
        return ("C", value)
    if type(value) in (tuple, list):
        children = tuple(_template(v) for v in value)
        return None if None in children else ("S", type(value), children)
    if type(value) is dict:
        keys = tuple(value)
        children = tuple(_template(value[k]) for k in keys)
        return None if None in children else ("D", keys, children)
    return None


def _tensors(value: Any, template: tuple, out: list[torch.Tensor], where: str) -> None:
    """Append the tensors of ``value`` to ``out`` in template order; raise if it does not match."""
    kind = template[0]
    if kind == "T":
        if not isinstance(value, torch.Tensor):
            raise _mismatch(where, "a tensor", value)
        out.append(value)
    elif kind == "C":
        if isinstance(value, torch.Tensor) or value != template[1] or type(value) is not type(template[1]):
            raise _mismatch(where, repr(template[1]), value)
    elif kind == "S":
        if type(value) is not template[1] or len(value) != len(template[2]):
            raise _mismatch(where, f"a {template[1].__name__} of {len(template[2])}", value)
        for i, (v, t) in enumerate(zip(value, template[2])):
            _tensors(v, t, out, f"{where}[{i}]")
    else:
        if type(value) is not dict or len(value) != len(template[1]):
            raise _mismatch(where, f"a dict with keys {list(template[1])}", value)
        for k, t in zip(template[1], template[2]):
            if k not in value:
                raise _mismatch(where, f"a dict with keys {list(template[1])}", value)
            _tensors(value[k], t, out, f"{where}[{k!r}]")


def _mismatch(where: str, expected: str, got: Any) -> ValueError:
    return ValueError(
        f"{OP}: {where} is {type(got).__name__} {got!r:.60}, but the probe that made this module a break saw "
        f"{expected}: a break point replays the call structure it was made for"
    )


def _rebuild(template: tuple, tensors: list[torch.Tensor], pos: list[int]) -> Any:
    kind = template[0]
    if kind == "T":
        pos[0] += 1
        return tensors[pos[0] - 1]
    if kind == "C":
        return template[1]
    if kind == "S":
        return template[1](_rebuild(t, tensors, pos) for t in template[2])
    return {k: _rebuild(t, tensors, pos) for k, t in zip(template[1], template[2])}


@dataclasses.dataclass
class ModuleBreak:
    """One module run as a break point: its call template, original forward and output shapes."""

    key: int
    path: str
    forward: Callable[..., Any]  # the module's own forward, bound
    call: tuple  # template of (args, kwargs)
    result: tuple  # template of its output
    sizes: list[tuple[tuple[int, int], ...]]  # per output tensor, per dim: (a, b) with size a * tokens + b
    dtypes: list[torch.dtype]
    token_dim: tuple[int, int, int, int]  # (input tensor, dim, a, b): recovers the token count from the inputs

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if is_in_breakable_graph():
            # The capture's own run of the break sees memory the unexecuted graph before it never wrote
            # (a router's indices: one_hot of garbage fails): its stub returns zeros of the right shapes,
            # and every replay, the capturing step's first included, runs the module.
            return self.shaped(inputs, torch.zeros)
        args, kwargs = _rebuild(self.call, inputs, [0])
        out: list[torch.Tensor] = []
        _tensors(self.forward(*args, **kwargs), self.result, out, f"the output of {self.path}")
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        # a custom op returns fresh, contiguous tensors (the shapes the fake implementation promised)
        return [t.clone() if t.untyped_storage().data_ptr() in storages else t.contiguous() for t in out]

    def shaped(self, inputs: list[torch.Tensor], make: Callable[..., torch.Tensor] = torch.empty) -> list[torch.Tensor]:
        """Tensors of the output shapes for ``inputs`` (symbolic sizes under Dynamo: the fake implementation)."""
        i, dim, a, b = self.token_dim
        tokens = (inputs[i].shape[dim] - b) // a if a else 0
        device = inputs[0].device
        return [
            make([a_ * tokens + b_ for a_, b_ in sizes], dtype=dtype, device=device)
            for sizes, dtype in zip(self.sizes, self.dtypes)
        ]


@torch.library.custom_op(OP, mutates_args=())
def module_break(inputs: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """Run the module registered under ``key`` on ``inputs`` (its call's tensors, in template order)."""
    return _BREAKS[key].run(inputs)


@module_break.register_fake
def _(inputs: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    return _BREAKS[key].shaped(inputs)


register_splitting_op(module_break)


def _break_forward(plan: ModuleBreak) -> Callable[..., Any]:
    """The forward a break module gets: its call's tensors through the op, the output rebuilt.
    Plain Python over constants (the templates, the key), which Dynamo traces into one op node."""
    key, call, result = plan.key, plan.call, plan.result

    def forward(*args: Any, **kwargs: Any) -> Any:
        tensors: list[torch.Tensor] = []
        _tensors((args, kwargs), call, tensors, "the call")
        return _rebuild(result, torch.ops.pb_hf.module_break(tensors, key), [0])

    forward.module_break = plan  # type: ignore[attr-defined]  # the registration lives as long as the module's forward
    return forward


def _sizes(small: torch.Tensor, large: torch.Tensor) -> tuple[tuple[int, int], ...] | None:
    """Per dim (a, b) with size = a * tokens + b, from the sizes at the two probe token counts."""
    t0, t1 = _PROBE_TOKENS
    if small.dim() != large.dim():
        return None
    out = []
    for s, l in zip(small.shape, large.shape):
        a, rest = divmod(l - s, t1 - t0)
        if rest:
            return None
        out.append((a, s - a * t0))
    return tuple(out)


def _leaves(value: Any) -> list[Any]:
    if type(value) in (tuple, list):
        return [x for v in value for x in _leaves(v)]
    if type(value) is dict:
        return [x for v in value.values() for x in _leaves(v)]
    return [value]


def _plan(path: str, module: torch.nn.Module, calls: dict[int, tuple[Any, Any]]) -> ModuleBreak | str:
    """A ModuleBreak for ``module`` from its recorded calls, or why it cannot be one."""
    if set(calls) != set(_PROBE_TOKENS):
        return "its forward is not called"
    (args0, out0), (args1, out1) = calls[_PROBE_TOKENS[0]], calls[_PROBE_TOKENS[1]]
    call, result = _template(args0), _template(out0)
    if call is None or result is None or any(not isinstance(v, (torch.Tensor, type(None))) for v in _leaves(out0)):
        return "it takes something other than tensors and constants, or returns something other than tensors"
    if call != _template(args1) or result != _template(out1):
        return "its call differs with the token count (a size passed as a Python number)"
    ins = [(a, b) for a, b in zip(_leaves(args0), _leaves(args1)) if isinstance(a, torch.Tensor)]
    outs = [(a, b) for a, b in zip(_leaves(out0), _leaves(out1)) if isinstance(a, torch.Tensor)]
    if not ins or not outs:
        return "it takes or returns no tensor"
    in_sizes = [_sizes(a, b) for a, b in ins]
    out_sizes = [_sizes(a, b) for a, b in outs]
    if None in in_sizes or None in out_sizes:
        return "a size of its tensors is not linear in the token count"
    token_dims = [(i, d, a, b) for i, sizes in enumerate(in_sizes) for d, (a, b) in enumerate(sizes) if a]
    if not token_dims and any(a for sizes in out_sizes for a, _ in sizes):
        return "its outputs grow with the token count but none of its inputs does"
    exact = [t for t in token_dims if t[2:] == (1, 0)]
    return ModuleBreak(
        key=-1, path=path, forward=module.forward, call=call, result=result, sizes=out_sizes,
        dtypes=[a.dtype for a, _ in outs], token_dim=(exact or token_dims or [(0, 0, 0, 0)])[0],
    )


def install_host_breaks(model: torch.nn.Module, result: ProbeResult, changes: Changes | None = None) -> list[str]:
    """Make a break point of the smallest module enclosing each host read the probe found; returns their
    paths (empty: no host read); ``changes``, if given, can undo it.
    Raises ``ValueError`` naming the read when no enclosing module can be a break."""
    changes = changes if changes is not None else Changes()
    if not result.host_reads:
        return []
    root = type(model).__name__
    names = {f"{root}.{n}" if n else root: m for n, m in model.named_modules()}
    chains: dict[str, list[str]] = {}
    for where in dict.fromkeys(result.host_read_modules):  # the probe names modules as root.child.grandchild
        parts = where.split(".")
        chains[where] = [".".join(parts[:i]) for i in range(len(parts), 1, -1) if ".".join(parts[:i]) in names]
    calls = _record_calls(model, {p: names[p] for chain in chains.values() for p in chain})
    chosen: dict[str, ModuleBreak] = {}
    for where, chain in chains.items():
        if any(p in chosen for p in chain):  # inside a module already chosen
            continue
        why: list[str] = []
        for path in chain:
            plan = _plan(path, names[path], calls.get(path, {}))
            if isinstance(plan, ModuleBreak):
                chosen[path] = plan
                break
            why.append(f"{path.split('.', 1)[-1]}: {plan}")
        else:
            read = next(r for r, m in zip(result.host_reads, result.host_read_modules) if m == where)
            raise ValueError(
                f"{root} reads device data on the host in its forward ({read}), and no module around it can run as "
                f"a break point (one whose call takes and returns only tensors): {'; '.join(why)}"
            )
    # an enclosing choice made after an inner one (two reads in one subtree): keep the outermost only
    for path in [p for p in chosen if any(p != q and p.startswith(q + ".") for q in chosen)]:
        del chosen[path]
    for path, plan in chosen.items():
        plan.key = next(_KEYS)
        _BREAKS[plan.key] = plan
        changes.set(names[path], "forward", _break_forward(plan))
        changes.set(names[path], "pb_host_break", plan.key)
    return [p.split(".", 1)[1] for p in chosen]


def installed(model: torch.nn.Module) -> list[str]:
    """The paths of the break points :data:`MECHANISM` installed in ``model``'s latest adaptation (empty: none)."""
    return list(_INSTALLED.get(model, ()))


class HostBreaks:
    """The mechanism that runs each module reading the host as a break point (:func:`install_host_breaks`);
    refuses a model whose host reads no break can take (none where the probe saw no attention layer)."""

    name = "host breaks"

    def refusal_of(self, model: torch.nn.Module, probed: ProbeResult | None) -> str | None:
        assert probed is not None, "host breaks are installed after the probe"
        return None if probed.layers else host_read_refusal(type(model).__name__, probed)

    def install(self, model: torch.nn.Module, probed: ProbeResult | None) -> Undo:
        assert probed is not None, "host breaks are installed after the probe"
        changes = Changes()
        paths = install_host_breaks(model, probed, changes)
        before = _INSTALLED.get(model)
        _INSTALLED[model] = tuple(paths)
        changes.then(lambda: _INSTALLED.pop(model, None) if before is None else _INSTALLED.__setitem__(model, before))
        return changes.undo


MECHANISM = HostBreaks()





def _record_calls(model: torch.nn.Module, modules: dict[str, torch.nn.Module]) -> dict[str, dict[int, tuple[Any, Any]]]:
    """Each module's first call (``((args, kwargs), output)``) in a probe forward of each probe token count."""
    calls: dict[str, dict[int, tuple[Any, Any]]] = {p: {} for p in modules}
    tokens = [0]

    def hook(path: str) -> Callable[..., None]:
        def record(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            calls[path].setdefault(tokens[0], ((args, kwargs), output))

        return record

    handles = [m.register_forward_hook(hook(p), with_kwargs=True) for p, m in modules.items()]
    try:
        for n in _PROBE_TOKENS:
            tokens[0] = n
            probe(model, tokens=n)
    finally:
        for h in handles:
            h.remove()
    return calls


def no_full_graphs(config: CompilationConfig, breaks: list[str]) -> CompilationConfig:
    """``config`` without FULL graphs when the model has host-read breaks (a FULL graph holds no break)."""
    if not breaks:
        return config
    mode = drop_full_graphs(config.cudagraph_mode, _reason(breaks))
    return config if mode == config.cudagraph_mode else config.replace(cudagraph_mode=mode)


def host_read_downgrades(config: CompilationConfig, breaks: list[str]) -> tuple[str, ...]:
    """What :func:`no_full_graphs` takes from ``config``, as a sentence for ``GraphRunner.downgrades`` (empty: nothing)."""
    mode = no_full_graphs(config, breaks).cudagraph_mode
    if mode == config.cudagraph_mode:
        return ()
    decode = "PIECEWISE graphs" if mode.has_piecewise_cudagraphs() else "eagerly"
    return (f"cudagraph_mode {config.cudagraph_mode.name} -> {mode.name}: {_reason(breaks)}, and no FULL graph "
            f"holds a break (decode steps run {decode})",)


def _reason(breaks: list[str]) -> str:
    more = f" (and {len(breaks) - 1} more: {', '.join(breaks[1:])})" if len(breaks) > 1 else ""
    return f"the model reads the host in {breaks[0]}{more}, run as a break point"
