"""``python -m piecewise_backend inspect MODULE:FACTORY``: show how the backend splits a model.

The factory is called with no arguments and returns a model, or ``(model, example_inputs)``
where ``example_inputs`` is a tensor, a tuple of positional inputs or a dict of keyword inputs.
Without example inputs the model runs once on random token ids of ``vocab`` =
``model.cfg.vocab_size`` or ``model.config.vocab_size`` (else 128): a Hugging Face style model
(a ``config`` and a ``forward(input_ids=...)``) gets ``input_ids`` of shape ``(1, tokens)`` as
a keyword (and ``use_cache=False`` when it takes one), any other model ``(tokens,)``
positionally. Pieces are compiled eagerly (no Inductor), so inspecting is fast; ``--dump DIR``
writes the split graph and every piece as readable Python. A model that reads the forward
context (``pb.get_forward_context()``: attention metadata, ...) gets one with ``--context
MODULE:FUNC``: ``FUNC`` returns a dict of attributes (called with the model's inputs, or with
none if it takes none), and both runs are inside ``pb.set_forward_context(**attrs)``. A graph
that Dynamo cut at a graph break says so. A factory or model that raises ends the command with a
one-line error (exit 1), not a traceback.

Table columns: ``nodes`` counts a piece's operations (placeholders and the output node
excluded), ``inputs`` its placeholders, ``outputs`` the values it returns; ``splitting op``
names the registered op a splitting piece holds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect as pyinspect
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_TOKENS = 8
DEFAULT_VOCAB = 128


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m piecewise_backend",
        description="Tools for the piecewise_breakable torch.compile backend.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    inspect = sub.add_parser(
        "inspect",
        help="compile a model with the backend and print its pieces",
        description="Build a model with MODULE:FACTORY, compile it with the piecewise_breakable backend "
        "(eager pieces), run it once and print the pieces of every graph.",
    )
    inspect.add_argument("target", metavar="MODULE:FACTORY", help="e.g. piecewise_backend.toy_llama:make_model")
    inspect.add_argument(
        "--tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"number of input token ids when the factory gives no example inputs (default {DEFAULT_TOKENS})",
    )
    inspect.add_argument("--dump", metavar="DIR", default=None, help="write the split graph and pieces as Python here")
    inspect.add_argument(
        "--context",
        metavar="MODULE:FUNC",
        default=None,
        help="for a model that reads the forward context (attention metadata...): FUNC returns a dict of its "
        "attributes; it is called with the model's inputs (or with none if it takes none), and the model runs "
        "inside pb.set_forward_context(**that dict)",
    )
    inspect.set_defaults(parser=inspect)
    return parser


def _load_callable(parser: argparse.ArgumentParser, target: str, form: str = "MODULE:FACTORY") -> Any:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        example = "piecewise_backend.toy_llama:make_model" if form == "MODULE:FACTORY" else "mymodels:step_context"
        prefix = "" if form == "MODULE:FACTORY" else "argument --context: "
        parser.error(f"{prefix}expected {form} (e.g. {example}), got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        parser.error(f"cannot import module {module_name!r}: {e}")
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            parser.error(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        parser.error(f"{target!r} is not callable (got {type(obj).__name__})")
    return obj


def _takes_arguments(fn: Any) -> bool:
    try:
        return bool(pyinspect.signature(fn).parameters)
    except (TypeError, ValueError):  # no signature: give it the inputs
        return True


def _load_factory(parser: argparse.ArgumentParser, target: str) -> Any:
    obj = _load_callable(parser, target)
    try:
        required = [
            p.name for p in pyinspect.signature(obj).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):  # no signature (some builtins): find out by calling it
        required = []
    if required:
        parser.error(
            f"{target} needs arguments ({', '.join(required)}); inspect calls the factory with none: "
            "point it at a function without required arguments that builds the model"
        )
    return obj


class CommandError(Exception):
    """A failure in the user's factory or model: reported in one line, exit status 1."""


def _where(e: BaseException) -> str:
    """The innermost frame outside torch and this package: where the user's code failed."""
    skip = (str(Path(torch.__file__).parent), str(Path(__file__).parent))
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(skip)]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _attempt(what: str, fn: Any, *args: Any, hint: str = "", **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "no forward context is set" in message:  # the model reads the context (pb.get_forward_context)
            hint = "; the model reads the forward context: pass --context MODULE:FUNC returning its attributes"
        raise CommandError(f"{what} raised {type(e).__name__}: {message}{_where(e)}{hint}") from e


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _takes(model: Any, name: str) -> bool:
    try:
        return name in pyinspect.signature(model.forward if isinstance(model, torch.nn.Module) else model).parameters
    except (TypeError, ValueError):
        return False


def default_inputs(model: Any, tokens: int) -> tuple[tuple[Any, ...], dict[str, Any], str]:
    """Random token ids for ``model``: ``(args, kwargs, description)``."""
    vocab = vocab_size(model)
    param = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    device = param.device if param is not None else "cpu"
    if getattr(model, "config", None) is not None and _takes(model, "input_ids"):  # Hugging Face style
        kwargs: dict[str, Any] = {"input_ids": torch.randint(0, vocab, (1, tokens), device=device)}
        text = f"input_ids=torch.randint(0, {vocab}, (1, {tokens}))"
        if _takes(model, "use_cache"):
            kwargs["use_cache"] = False  # a returned DynamicCache cannot be compared with eager's
            text += ", use_cache=False"
        return (), kwargs, text
    return (torch.randint(0, vocab, (tokens,), device=device),), {}, f"torch.randint(0, {vocab}, ({tokens},))"


def vocab_size(model: Any) -> int:
    for holder in ("cfg", "config"):
        size = getattr(getattr(model, holder, None), "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return DEFAULT_VOCAB


def op_name(op: Any) -> str:
    """A readable name for a registry entry: ``ns::name`` or a Python path."""
    if isinstance(op, str):
        return op
    name = getattr(op, "__name__", None)
    if name is not None and getattr(F, name, None) is op:
        return f"torch.nn.functional.{name}"
    module = getattr(op, "__module__", None) or "?"
    return f"{module}.{getattr(op, '__qualname__', name or repr(op))}"


def _num_outputs(gm: torch.fx.GraphModule) -> int:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return len(out) if isinstance(out, (tuple, list)) else 1


def piece_rows(split: Any) -> list[tuple[str, ...]]:
    from .ops import OpMatcher

    matcher = OpMatcher(split.found_ops)
    rows = []
    for p in split.pieces:
        nodes = [n for n in p.module.graph.nodes if n.op not in ("placeholder", "output")]
        inputs = sum(n.op == "placeholder" for n in p.module.graph.nodes)
        ops = ""
        if p.is_splitting:
            found = [matcher.match(n.target) for n in nodes if n.op == "call_function"]
            ops = ", ".join(dict.fromkeys(op_name(s) for s in found if s is not None))
        kind = "splitting" if p.is_splitting else "compiled"
        rows.append((str(p.index), p.name, kind, str(len(nodes)), str(inputs), str(_num_outputs(p.module)), ops))
    return rows


def format_table(rows: list[tuple[str, ...]]) -> str:
    header = ("index", "name", "kind", "nodes", "inputs", "outputs", "splitting op")
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join(lines)


def run_inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import piecewise_backend as pb

    if args.dump is not None and Path(args.dump).exists() and not Path(args.dump).is_dir():
        parser.error(f"argument --dump: {args.dump!r} is a file; give a directory (created if missing)")
    factory = _load_factory(parser, args.target)
    made = _attempt(f"the factory {args.target}", factory)
    ex_args: tuple[Any, ...] | None = None
    ex_kwargs: dict[str, Any] = {}
    if isinstance(made, tuple):
        if len(made) != 2:
            parser.error(f"{args.target} returned a tuple of {len(made)}; expected a model or (model, example_inputs)")
        made, example = made
        if isinstance(example, dict):
            ex_args, ex_kwargs = (), dict(example)
        else:
            ex_args = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    model = made
    if not callable(model):
        parser.error(f"{args.target} returned {type(model).__name__}, which is not a callable model")
    if isinstance(model, torch.nn.Module):
        model.eval()
    if ex_args is None:
        ex_args, ex_kwargs, source = default_inputs(model, args.tokens or DEFAULT_TOKENS)
    else:
        source = "example inputs from the factory" + (" (--tokens ignored)" if args.tokens else "")

    attrs: dict[str, Any] = {}
    if args.context is not None:
        context_fn = _load_callable(parser, args.context, "MODULE:FUNC")
        inputs = (ex_args, ex_kwargs) if _takes_arguments(context_fn) else ((), {})
        attrs = _attempt(f"the context function {args.context}", context_fn, *inputs[0], **inputs[1])
        if not isinstance(attrs, dict) or not all(isinstance(k, str) for k in attrs):
            parser.error(f"argument --context: {args.context} returned {type(attrs).__name__}; expected a dict of "
                         "forward-context attributes (names to values), e.g. {'attn_metadata': ...}")

    ops = pb.registered_splitting_ops()
    config = pb.CompilationConfig(compile_pieces="eager", debug_dump_dir=args.dump)
    backend = pb.make_backend(config)
    context = (lambda: pb.set_forward_context(**attrs)) if args.context is not None else contextlib.nullcontext
    with torch.no_grad():
        hint = "" if source.startswith("example") else "; return (model, example_inputs) from the factory"
        with context():
            expected = _attempt(f"the model on {source}", model, *ex_args, hint=hint, **ex_kwargs)
        compiled = torch.compile(model, backend=backend)
        with context():
            got = _attempt("the model compiled with piecewise_breakable", compiled, *ex_args, **ex_kwargs)
    try:
        torch.testing.assert_close(got, expected)
        check, status = "compiled output matches eager", 0
    except AssertionError as e:
        check, status = "MISMATCH, compiled output differs from eager: " + str(e).splitlines()[0], 1
    except TypeError as e:  # outputs assert_close cannot compare
        check, status = f"skipped ({e})", 0

    print(f"model: {args.target} ({type(model).__name__})")
    print(f"inputs: {source}")
    if args.context is not None:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in attrs.items())
        print(f"forward context: {args.context} ({shown})")
    print(f"graphs: {len(backend.splits)}")
    found: list[Any] = []
    for g, split in enumerate(backend.splits):
        found.extend(s for s in split.found_ops if not any(s is f or s == f for f in found))
        print()
        cut = f" (graph break: {split.graph_break})" if split.graph_break is not None else ""
        print(
            f"graph {g}: {len(split.pieces)} pieces, {split.num_splitting} splitting, "
            f"{len(split.pieces) - split.num_splitting} compiled{cut}"
        )
        print(format_table(piece_rows(split)))
    missing = [op for op in ops if not any(op is f or op == f for f in found)]
    print()
    print("splitting ops found: " + (", ".join(op_name(o) for o in found) or "none"))
    print("splitting ops not found: " + (", ".join(op_name(o) for o in missing) or "none"))
    broken = [s for s in backend.splits if s.graph_break is not None]
    if broken:
        print(f"note: Dynamo broke the model into {len(backend.splits)} graphs at graph breaks (above); a break cuts "
              "it where no splitting op is: remove them (torch._dynamo.explain lists them) to compile one graph")
    if not found:
        print("note: no splitting op appeared, so nothing was split; register the model's attention op "
              "with piecewise_backend.register_splitting_op")
    if args.dump is not None:
        files = sorted(p for p in Path(args.dump).rglob("*.py"))
        print(f"dumped {len(files)} files to {args.dump}")
    print(f"eager check: {check}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "inspect":
        try:
            return run_inspect(args, args.parser)
        except CommandError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    parser.error(f"unknown command {args.command!r}")  # unreachable: argparse checks choices
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
