"""Small checks shared by the edges that validate what callers pass (engine arguments,
``CompilationConfig``, the dispatcher, ``SamplingParams``): one meaning of each, everywhere."""

from __future__ import annotations

import numbers


def is_int(value: object) -> bool:
    """An integer that is not a bool: Python's ``int`` (subclasses such as ``IntEnum`` members included)
    and numpy's integer scalars (``numbers.Integral``); ``True``, ``1.0`` and ``"1"`` are not."""
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))
