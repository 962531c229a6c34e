"""Naming what a piece's compiled code depends on, for the keys of :mod:`.keys`.

:class:`Describer` turns a graph into text: every node, the bodies of higher-order ops
(recursively), every object a node calls or reads, and its inputs' metadata. In one process
(``stable=False``) an object may be named by its identity (the describer keeps it alive in
``refs`` so the id is not reused); across processes (``stable=True``) it must be named by what it
is: ops by name, functions by their code, defaults, closure cells and the globals they read,
tensors by value. What cannot be named that way raises :class:`Uncacheable`.
"""

from __future__ import annotations

import enum
import hashlib
import os
import sys
import types
from typing import Any

import torch
import torch.fx as fx

_TORCH_DIR = os.path.dirname(torch.__file__)
# Namespaces whose C++ kernels ship with torch (covered by torch's version in the cache key).
_TORCH_NAMESPACES = frozenset({
    "aten", "prims", "quantized", "_quantized", "quantized_decomposed", "sparse", "mkldnn", "_c10d_functional",
    "_c10d_functional_autograd", "c10d", "_dtensor", "rngprims", "inductor", "profiler", "debugprims", "_test",
})
_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_NAMED = (torch.dtype, torch.device, torch.layout, torch.memory_format)


class Uncacheable(Exception):
    """A piece whose code cannot be named stably across processes; the message says what and why."""


def _is_torch_or_stdlib(module: str | None) -> bool:
    root = (module or "").split(".")[0]
    return root in ("torch", "builtins", "_operator", "operator", "math") or root in sys.stdlib_module_names


class Describer:
    """Text naming a graph and everything it reads; ``refs`` holds what was named by identity."""

    def __init__(self, stable: bool):
        self.stable = stable
        self.refs: list[Any] = []  # objects named by id: kept alive so the id is not reused
        self.names: dict[fx.Node, str] = {}
        self._seen: dict[int, str] = {}  # functions being described (recursion through globals)

    def identity(self, obj: Any, what: str) -> str:
        if self.stable:
            raise Uncacheable(f"{what} cannot be named across processes")
        self.refs.append(obj)
        return f"id({type(obj).__qualname__}@{id(obj):x})"

    # ------------------------------------------------------------------ values

    def value(self, v: Any) -> str:
        if isinstance(v, fx.Node):
            return self.names[v]
        if isinstance(v, _SCALARS):
            return f"{type(v).__name__}:{v!r}"  # repr tells -0.0 from 0.0 and 1 from 1.0
        if isinstance(v, _NAMED):
            return f"{type(v).__name__}:{v}"
        if isinstance(v, enum.Enum):
            return f"{type(v).__module__}.{type(v).__qualname__}.{v.name}"
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return f"{type(v).__name__}({v.node.expr})"
        if isinstance(v, (tuple, list)):  # torch.Size and fx's immutable_list included
            return f"{type(v).__name__}[{','.join(self.value(x) for x in v)}]"
        if isinstance(v, dict):
            return "{" + ",".join(f"{self.value(k)}:{self.value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, slice):
            return f"slice({self.value(v.start)},{self.value(v.stop)},{self.value(v.step)})"
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, fx.GraphModule):
            return "graph{" + self.graph(v) + "}"
        if isinstance(v, torch.nn.Module):
            return self.identity(v, f"module {type(v).__qualname__}")
        if isinstance(v, types.ModuleType):
            return f"module:{v.__name__}"
        if callable(v):
            return self.callable(v)
        return self.identity(v, f"a {type(v).__qualname__} object")

    def tensor(self, t: torch.Tensor) -> str:
        meta = f"T{tuple(map(str, t.shape))}{tuple(map(str, t.stride()))}{t.dtype}{t.device}"
        if isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta":
            return meta
        if type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
            return meta + self.identity(t, f"a {type(t).__qualname__} constant")
        data = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        return meta + hashlib.sha256(data).hexdigest()  # a constant is code: keyed by its value

    # ------------------------------------------------------------------ callables

    def callable(self, f: Any) -> str:
        if isinstance(f, torch._ops.OpOverload):
            return f"op:{f.name()}{self._kernels(f)}"
        if isinstance(f, torch._ops.OpOverloadPacket):
            overloads = [getattr(f, name) for name in f.overloads()]
            return f"packet:{f._qualified_op_name}" + "".join(self._kernels(o) for o in overloads)
        if isinstance(f, torch._ops.HigherOrderOperator):
            return f"hop:{f.name()}"
        if isinstance(f, types.FunctionType):
            return self.function(f)
        if isinstance(f, types.MethodType):
            return f"method({self.callable(f.__func__)},{self.value(f.__self__)})"
        if isinstance(f, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                          types.ClassMethodDescriptorType)):
            owner = getattr(f, "__self__", None)
            if owner is None or isinstance(owner, (types.ModuleType, type)):
                return f"builtin:{getattr(f, '__module__', None)}.{f.__qualname__}"
            return f"bound({f.__qualname__},{self.value(owner)})"
        if isinstance(f, type):
            if _is_torch_or_stdlib(f.__module__):
                return f"class:{f.__module__}.{f.__qualname__}"
            return self.identity(f, f"class {f.__module__}.{f.__qualname__}")
        if hasattr(f, "func") and hasattr(f, "args") and hasattr(f, "keywords"):  # functools.partial
            return f"partial({self.callable(f.func)},{self.value(f.args)},{self.value(f.keywords)})"
        uuid = getattr(f, "uuid", None)
        if self.stable and callable(uuid) and uuid() is not None:
            return f"uuid:{type(f).__qualname__}:{uuid()!r}"
        return self.identity(f, f"callable {type(f).__qualname__} object")

    def function(self, f: types.FunctionType) -> str:
        name = f"{f.__module__}.{f.__qualname__}"
        if not self.stable:
            return f"fn:{name}:" + self.identity(f, name)
        if _is_torch_or_stdlib(f.__module__) and f.__closure__ is None:
            return f"fn:{name}"  # torch's own source is in the environment part of the cache key
        if id(f) in self._seen:
            return f"fn:{name}:again"  # described earlier in this key (or a cycle through globals)
        self._seen[id(f)] = name
        parts = [name, _code_digest(f.__code__), self.value(f.__defaults__), self.value(f.__kwdefaults__)]
        for cell in f.__closure__ or ():  # two closures from one factory share code: their cells differ
            parts.append(self.value(cell.cell_contents))
        for global_name in sorted(_global_names(f.__code__)):
            if global_name in f.__globals__:
                try:
                    parts.append(f"{global_name}={self.value(f.__globals__[global_name])}")
                except Uncacheable as e:
                    raise Uncacheable(f"{name} reads the global {global_name!r}: {e}") from None
        return "fn(" + ",".join(parts) + ")"

    def _kernels(self, op: torch._ops.OpOverload) -> str:
        """An op whose CompositeImplicitAutograd kernel is inlined into the piece: its body is code too."""
        from torch._library.custom_ops import OPDEFS

        py = op.py_kernels.get(torch._C.DispatchKey.CompositeImplicitAutograd)
        described = f"[py:{self.callable(py)}]" if py is not None else ""
        opdef = OPDEFS.get(op.name())  # torch.library.custom_op / triton_op: rules AOTAutograd inlines
        for mode, fn in getattr(opdef, "_torch_dispatch_fns", {}).items():
            described += f"[{mode.__module__}.{mode.__qualname__}:{self.callable(fn)}]"
        has_cia = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        if not self.stable or not has_cia:
            return described
        dump = torch._C._dispatch_dump(op.name())
        line = next((ln for ln in dump.splitlines() if ln.startswith("CompositeImplicitAutograd")), "")
        where = line.split("registered at ", 1)[-1].split(" :: ")[0].rsplit(":", 1)[0]
        python = where.endswith(".py") or where.startswith("<")
        if python and not os.path.abspath(where).startswith(_TORCH_DIR + os.sep):
            raise Uncacheable(f"{op.name()} has a CompositeImplicitAutograd kernel written in Python ({where}), "
                              "inlined into the piece; the key cannot see its body")
        if not python and op.namespace not in _TORCH_NAMESPACES:
            raise Uncacheable(f"{op.name()} has a CompositeImplicitAutograd kernel from an extension ({where}), "
                              "inlined into the piece; the key cannot see its body")
        return described

    # ------------------------------------------------------------------ graphs

    def example(self, v: Any) -> str:
        if isinstance(v, torch.SymInt):  # a size input: its range is code (a kernel for s >= 2 may not serve 1)
            return f"{self.value(v)} {_ranges([v], v.node.shape_env)}"
        if isinstance(v, torch.Tensor):
            shape_env = getattr(getattr(v, "fake_mode", None), "shape_env", None)
            return f"{self.tensor(v)} grad={v.requires_grad} {_ranges((*v.shape, *v.stride()), shape_env)}"
        return self.value(v)

    def graph(self, gm: fx.GraphModule) -> str:
        outer, self.names = self.names, {}
        lines = []
        for i, node in enumerate(gm.graph.nodes):
            self.names[node] = f"%v{i}"
            extra = ""
            if node.op == "placeholder":
                target, extra = "", self.example(node.meta.get("example_value"))  # inputs are positional
            elif node.op == "call_function":
                target = self.callable(node.target)
                if "triton_kernel_wrapper" in target:  # the kernel is an index into a process-local table
                    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

                    kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
                    extra = self.identity(kernel, "a user Triton kernel")
            elif node.op in ("get_attr", "call_module"):
                target = self.value(_fetch(gm, node.target))  # what the name holds is the code, not the name
            else:
                target = str(node.target)
            lines.append(f"{node.op} {target} {self.value((node.args, node.kwargs))} {extra}")
        self.names = outer
        return "\n".join(lines)


def _ranges(sizes: Any, shape_env: Any) -> list[str]:
    if shape_env is None:
        return []
    symbols = {s for d in sizes if isinstance(d, torch.SymInt) for s in d.node.expr.free_symbols}
    return sorted(f"{s}:{shape_env.var_to_range.get(s)}" for s in symbols)


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.sha256(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)).encode())
    for const in code.co_consts:
        h.update(_code_digest(const).encode() if isinstance(const, types.CodeType) else repr(const).encode())
    return h.hexdigest()[:32]


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


