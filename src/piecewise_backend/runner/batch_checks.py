"""What a GraphRunner accepts: its declared inputs (checked once, at construction) and each step's batch.

``GraphRunner.run`` is a public edge, so every step is checked here, in one pass (:meth:`BatchChecks.check_step`):
the input names, each tensor's type, rank and kind (floating or not), the token and request counts the
inputs agree on, ``num_reqs``, ``query_lens`` (micro-batching), the step's ``context`` (no opaque
objects when graphs may replay) and, under ``debug_checks``, the request rows of ``request_row`` inputs.
The pass also says whether every tensor fits the buffers (else the step runs eagerly) and whether every
one has exactly its buffer's width (then filling the buffers is one copy). Past this module the runner
trusts the batch. A FULL step's forward context has its own checks (:mod:`.full_context`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .full_context import context_leaves
from .static_inputs import StaticInput

_Tensor = torch.Tensor
_PLAIN = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device, torch.Tensor)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ---------------------------------------------------------------------------------------- at construction


def check_runner_args(
    inputs: Sequence[StaticInput], model_args: Sequence[str] | None, model_kwargs: Sequence[str] | None,
    max_num_reqs: int | None, context_fn: Any = None, eager_model: Any = None,
) -> tuple[list[StaticInput], list[str], list[str]]:
    """A GraphRunner's ``inputs``, ``model_args`` and ``model_kwargs`` (both None: every input positionally,
    in order) checked against each other and ``max_num_reqs``, and its ``context_fn`` and ``eager_model``;
    returns the three lists."""
    if eager_model is not None and not callable(eager_model):
        raise TypeError(f"eager_model must be callable (the model uncompiled), got {type(eager_model).__name__}")
    if context_fn is not None and not callable(context_fn):
        raise TypeError(f"context_fn must be callable(views) -> dict, got {type(context_fn).__name__}")
    inputs = list(inputs)
    bad = [i for i in inputs if not isinstance(i, StaticInput)]
    if bad:
        raise TypeError(f"GraphRunner inputs must be StaticInputs, got {bad[0]!r}")
    names = [i.name for i in inputs]
    if not any(i.per == "token" for i in inputs):
        raise ValueError(
            f"GraphRunner needs at least one per='token' StaticInput (the token count comes from it), got {names}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"GraphRunner input names must be unique, got {names}")
    positional = model_kwargs is None and model_args is None
    args = input_names("model_args", model_args, names, names if positional else [])
    kwargs = input_names("model_kwargs", model_kwargs, names, [])
    both = sorted(set(args) & set(kwargs))
    if both:
        raise ValueError(f"inputs {both} are in both model_args and model_kwargs; pass each one way")
    per_request = [i.name for i in inputs if i.per == "request"]
    if max_num_reqs is not None and not _is_count(max_num_reqs):
        raise ValueError(f"max_num_reqs must be a positive int, got {max_num_reqs!r}")
    if per_request and max_num_reqs is None:
        raise ValueError(f"per='request' inputs {per_request} need GraphRunner(max_num_reqs=...) (their row count)")
    request_row = sorted(i.name for i in inputs if i.request_row)  # rebased per micro-batch half
    if request_row and not per_request:
        raise ValueError(
            f"request_row inputs {request_row} hold rows of per-request inputs, but this runner "
            "has none: add the per='request' inputs they index"
        )
    return inputs, args, kwargs


def input_names(field: str, given: Sequence[str] | None, names: list[str], default: list[str]) -> list[str]:
    """The input names a GraphRunner passes as ``field`` (model_args or model_kwargs), checked."""
    if given is None:
        return list(default)
    if isinstance(given, str) or not all(isinstance(a, str) for a in given):
        raise TypeError(f"{field} must be a list of input names, got {given!r}")
    unknown = [a for a in given if a not in names]
    if unknown:
        raise ValueError(f"{field} {unknown} are not among the inputs {names}")
    return list(given)


# ---------------------------------------------------------------------------------------- every step


class BatchChecks:
    """Every check of one step's arguments, set up once per runner (``GraphRunner.checks``).

    ``replays``: graphs may replay (the step's ``context`` may then hold no opaque objects);
    ``ubatching``: ``query_lens`` is read (micro-batching splits at request boundaries);
    ``debug_checks``: ``request_row`` values are checked against the step's request count.
    """

    def __init__(
        self, specs: Mapping[str, StaticInput], *, max_num_reqs: int | None, replays: bool, ubatching: bool,
        debug_checks: bool,
    ) -> None:
        self.specs = dict(specs)
        self.max_num_reqs = max_num_reqs
        self.replays = replays
        self.ubatching = ubatching
        self.debug_checks = debug_checks
        self.request_row = [name for name, s in self.specs.items() if s.request_row]
        # per name: (trailing shape, floating, per token), what the hot loop reads
        self._rules = {name: (s.shape, s.dtype.is_floating_point, s.per == "token") for name, s in self.specs.items()}

    def check_step(
        self, batch: dict[str, Any], num_reqs: Any, context: Any, query_lens: Any,
    ) -> tuple[int, int | None, int | None, bool, bool, dict, list[int] | None]:
        """``(tokens, request rows, num_reqs, fit, exact, context, query_lens)`` of a valid step, or a clear
        error. ``request rows`` is None without per-request inputs; ``num_reqs`` defaults to it; ``fit``:
        every tensor fits its buffer (else the step runs eagerly); ``exact``: every one has its buffer's
        width; ``context`` is a dict; ``query_lens`` a list (None unless micro-batching and given)."""
        rules = self._rules
        if batch.keys() != rules.keys():
            missing, extra = sorted(set(rules) - set(batch)), sorted(set(batch) - set(rules))
            raise ValueError(
                f"GraphRunner.run: missing inputs {missing}, unknown inputs {extra}; expected {sorted(rules)}"
            )
        fit = exact = True
        n = reqs = None
        for name, t in batch.items():  # one pass over the tensors: this is every step's cost
            shape, floating, per_token = rules[name]
            if type(t) is not _Tensor or t.is_floating_point() is not floating:
                check_tensor(self.specs[name], t)  # a subclass, or raises naming what is wrong
            size = t.shape
            if not size or size[1:] != shape:  # the rank, then the width
                check_tensor(self.specs[name], t)
                exact = False
                fit = fit and fits(self.specs[name], t)
            if per_token:
                if n is None:
                    n = size[0]
                elif size[0] != n:
                    step_counts(batch, self.specs)  # raises, naming the counts
            elif reqs is None:
                reqs = size[0]
            elif size[0] != reqs:
                step_counts(batch, self.specs)
        if reqs is not None:
            if reqs > self.max_num_reqs:  # type: ignore[operator]
                raise ValueError(
                    f"GraphRunner.run: per-request inputs have {reqs} rows, above max_num_reqs={self.max_num_reqs}"
                )
            if num_reqs is None:
                num_reqs = reqs
            elif num_reqs != reqs:
                raise ValueError(f"GraphRunner.run: num_reqs={num_reqs} but the per-request inputs have {reqs} rows")
        elif num_reqs is not None and not _is_count(num_reqs):
            raise ValueError(f"GraphRunner.run: num_reqs must be None or a positive int, got {num_reqs!r}")
        context = {} if context is None else check_context(context, replays=self.replays)
        if self.debug_checks:
            for name in self.request_row:
                check_request_rows(self.specs[name], batch[name], 0, reqs, where=f" (the step has {reqs} requests)")
        lens = check_query_lens(query_lens, n, reqs) if self.ubatching else None  # type: ignore[arg-type]
        return n, reqs, num_reqs, fit, exact, context, lens  # type: ignore[return-value]

    def check_halves(self, batch: Mapping[str, torch.Tensor], split: tuple[int, int], n: int, num_reqs: int) -> None:
        """Under ``debug_checks``, a micro-batched step: each half's ``request_row`` values name only that
        half's requests (the first ``split[1]`` requests hold the first ``split[0]`` tokens)."""
        cut, first_reqs = split
        for name in self.request_row:
            t, spec = batch[name], self.specs[name]
            check_request_rows(spec, t[:cut], 0, first_reqs,
                               where=f" (micro-batch 0: tokens 0..{cut - 1}, requests 0..{first_reqs - 1})")
            check_request_rows(spec, t[cut:], first_reqs, num_reqs, first=cut,
                               where=f" (micro-batch 1: tokens {cut}..{n - 1}, requests {first_reqs}..{num_reqs - 1})")


def check_tensor(spec: StaticInput, value: Any) -> torch.Tensor:
    """``value`` as a step tensor for ``spec``, or a clear error."""
    if (
        not isinstance(value, torch.Tensor)
        or value.dim() != len(spec.shape) + 1
        or value.is_floating_point() != spec.dtype.is_floating_point
    ):
        _bad_tensor(spec, value)
    return value


def _bad_tensor(spec: StaticInput, value: Any) -> None:
    rows = "tokens" if spec.per == "token" else "requests"
    want = f"({rows}{''.join(f', {d}' for d in spec.shape)})"
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"GraphRunner.run: input {spec.name!r} must be a torch.Tensor of shape {want}, got "
            f"{type(value).__name__}; a graph replays tensors at fixed addresses, so opaque objects (lists, "
            "caches) cannot be inputs: keep their tensors in StaticInputs"
        )
    if value.dim() != len(spec.shape) + 1:
        raise ValueError(
            f"GraphRunner.run: input {spec.name!r} has shape {tuple(value.shape)}, its StaticInput wants {want}"
        )
    raise ValueError(f"GraphRunner.run: input {spec.name!r} is {value.dtype}, its StaticInput is {spec.dtype}")


def fits(spec: StaticInput, value: torch.Tensor) -> bool:
    """True when ``value``'s non-leading dims fit the static shape."""
    return all(a <= b for a, b in zip(value.shape[1:], spec.shape))


def step_counts(batch: Mapping[str, torch.Tensor], specs: Mapping[str, StaticInput]) -> tuple[int, int | None]:
    """The token count and the request count (None without per-request inputs) a step's inputs agree on."""
    tokens = reqs = None
    for name, t in batch.items():
        rows = t.shape[0]
        if specs[name].per == "token":
            if tokens is None:
                tokens = rows
            elif rows != tokens:
                _disagree(batch, specs, "token")
        elif reqs is None:
            reqs = rows
        elif rows != reqs:
            _disagree(batch, specs, "request")
    return tokens, reqs  # type: ignore[return-value]  # a runner has at least one per-token input


def _disagree(batch: Mapping[str, torch.Tensor], specs: Mapping[str, StaticInput], per: str) -> None:
    counts = {name: t.shape[0] for name, t in batch.items() if specs[name].per == per}
    raise ValueError(f"GraphRunner.run: per-{per} inputs disagree on the {per} count: {counts}")


def check_request_rows(
    spec: StaticInput, value: torch.Tensor, lo: int, hi: int, first: int = 0, where: str = ""
) -> None:
    """Under ``debug_checks``: every value of a ``request_row`` input lies in ``lo..hi-1``, or a clear error.

    ``value`` holds the step's tokens from token ``first``; ``where`` says which tokens those are.
    """
    bad = (value < lo) | (value >= hi)
    if bool(bad.any()):
        token = int(bad.reshape(bad.shape[0], -1).any(-1).nonzero()[0, 0])
        raise IndexError(
            f"GraphRunner.run (debug_checks): input {spec.name!r} (request_row=True) holds request row "
            f"{value[token].tolist()} at token {first + token}{where}; valid rows are {lo}..{hi - 1}. Its values "
            "index the step's per-request inputs (rows 0..R-1 of the whole step; the runner rebases them for "
            "each micro-batch half, which sees only its own requests)"
        )


def check_query_lens(query_lens: Any, n: int, reqs: int | None) -> list[int] | None:
    """``query_lens`` as a list: positive ints summing to the step's tokens, one per request row."""
    if query_lens is None:
        return None
    lens = list(query_lens)
    if not lens or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in lens) or sum(lens) != n:
        raise ValueError(f"GraphRunner.run: query_lens must be positive ints summing to the {n} tokens, got {lens}")
    if reqs is not None and len(lens) != reqs:
        raise ValueError(f"GraphRunner.run: {len(lens)} query_lens but the per-request inputs have {reqs} rows")
    return lens


def check_context(context: Any, replays: bool) -> dict:
    """A step's extra forward-context attributes; opaque values refused when graphs may replay."""
    if context is None:
        return {}
    if not isinstance(context, Mapping) or not all(isinstance(k, str) for k in context):
        raise TypeError(f"GraphRunner.run: context must be a dict of attribute names to values, got {context!r}")
    if replays:
        check_plain(context, "context")
    return dict(context)


def check_plain(attrs: Mapping[str, Any], source: str) -> None:
    """Refuse objects a graph replay cannot account for (a transformers ``DynamicCache``, a generator).

    Plain: Python scalars, strings, enums, dtypes, devices, tensors, and tuples, lists,
    dicts and dataclasses of those. Anything else holds state a graph captured once and
    never sees change.
    """
    for key, value in attrs.items():
        for path, leaf in context_leaves(value, key):
            if not isinstance(leaf, _PLAIN):
                raise TypeError(
                    f"GraphRunner: {source} {path!r} is a {type(leaf).__name__}; a graph replays what it read at "
                    "capture and cannot see an object's state change. Pass tensors (persistent ones: StaticInputs "
                    "and context_fn over the step's views), plain Python values, or dataclasses of those"
                )

