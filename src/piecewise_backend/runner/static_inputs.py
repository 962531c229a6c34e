"""StaticInput: one model input of a GraphRunner, the shape and pad of its persistent buffer.

A graph reads fixed addresses, so every input lives in a buffer allocated once: per-token
inputs have one row per token of the largest capture size, per-request inputs one row per
request (``max_num_reqs``). A step copies its tensors into the buffers' leading corner and
fills everything else with the input's ``pad``: the model sees the declared shape on every
step, graph or eager, and never a previous step's data (:mod:`.buffers`). A step's tensors are checked
against these specs in :mod:`.batch_checks`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

PER_VALUES = ("token", "request")


@dataclasses.dataclass(frozen=True)
class StaticInput:
    """One model input: ``(rows, *shape)`` of ``dtype``; rows and columns without data hold ``pad``.

    ``per="token"``: one row per token (padded to the captured size). ``per="request"``:
    one row per request, always ``max_num_reqs`` rows. A tensor narrower than ``shape`` is
    padded with ``pad`` in every mode; a wider one cannot fit and the step runs eagerly.

    ``request_row=True`` (per-token integer inputs, ``pad=0``): each value is a row of the
    per-request inputs (a token's request). A micro-batched step gives each half only its own
    requests' rows, so the runner rebases these values per half; ``debug_checks`` checks them.
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.long
    pad: int | float = 0
    per: str = "token"
    request_row: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(
                "StaticInput.name must be a str that is a Python identifier, "
                f"got {self.name!r} ({type(self.name).__name__})"
            )
        shape = self.shape
        if not isinstance(shape, (tuple, list)) or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in shape
        ):
            raise ValueError(
                f"StaticInput {self.name!r}: shape is the dims after the token (or request) dim, a tuple of "
                f"positive ints such as () or (4,); got {shape!r}"
            )
        object.__setattr__(self, "shape", tuple(shape))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"StaticInput {self.name!r}: dtype must be a torch.dtype such as torch.float32, got {self.dtype!r}"
            )
        if self.per not in PER_VALUES:
            raise ValueError(f"StaticInput {self.name!r}: per must be 'token' or 'request', got {self.per!r}")
        _check_pad(self.name, self.pad, self.dtype)
        if not isinstance(self.request_row, bool):
            raise TypeError(f"StaticInput {self.name!r}: request_row must be True or False, got {self.request_row!r}")
        if self.request_row and (
            self.per != "token" or self.dtype.is_floating_point or self.dtype.is_complex or self.dtype == torch.bool
            or self.pad != 0
        ):
            raise ValueError(
                f"StaticInput {self.name!r}: request_row=True marks a per-token integer input holding rows of the "
                f"per-request inputs, padded with row 0 (the first row of every micro-batch half); got "
                f"per={self.per!r}, dtype={self.dtype}, pad={self.pad!r}"
            )


def _check_pad(name: str, pad: Any, dtype: torch.dtype) -> None:
    where = f"StaticInput {name!r}: pad {pad!r}"
    if not isinstance(pad, (int, float)):
        raise TypeError(f"{where} must be a Python int or float that {dtype} can hold")
    if dtype == torch.bool:
        if pad not in (0, 1):
            raise ValueError(f"{where} does not fit torch.bool: use False/True (0/1)")
    elif dtype.is_floating_point:
        if not math.isfinite(pad) or abs(pad) > torch.finfo(dtype).max:
            raise ValueError(f"{where} must be finite and within +-{torch.finfo(dtype).max:g} for {dtype}")
    elif not dtype.is_complex:
        info = torch.iinfo(dtype)
        if isinstance(pad, float) and not pad.is_integer() or not info.min <= pad <= info.max:
            raise ValueError(f"{where} does not fit {dtype}: use an integer in [{info.min}, {info.max}]")


