"""``piecewise_backend.hf.tiny_random_model``, ``hf.tiny_random_vlm``, ``hf.random_mm_inputs``, ``hf.TINY``, ``hf.TINY_IF_SET``, ``hf.MAX_PARAMS``: aliases of the test
fixtures of :mod:`piecewise_backend.testing.hf_models`, loaded on first use (hf's face imports :func:`__getattr__`).

The fixtures build on what hf serves, but import nothing of it: ``tiny_random_model`` is given hf's
served layer types and its state layers here, with the documented signature.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from .adapter import SERVED_LAYER_TYPES
from .mixers import candidates

#: The names of the fixtures importable from :mod:`piecewise_backend.hf`.
FIXTURES = frozenset({"MAX_PARAMS", "TINY", "TINY_IF_SET", "tiny_random_model", "tiny_random_vlm", "random_mm_inputs"})
_LOADED: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """The module ``__getattr__`` of :mod:`piecewise_backend.hf`: a fixture by name, loaded once."""
    if name not in FIXTURES:
        raise AttributeError(f"module 'piecewise_backend.hf' has no attribute {name!r}")
    if name not in _LOADED:
        from ..testing import hf_models

        value = getattr(hf_models, name)
        _LOADED[name] = _given_what_hf_serves(value) if name == "tiny_random_model" else value
    return _LOADED[name]


def _given_what_hf_serves(fixture: Any) -> Any:
    """``fixture`` (``testing.hf_models.tiny_random_model``) with hf's served layer types and state layers
    passed in; its signature the documented one (without those two)."""
    given = {"served_layer_types": SERVED_LAYER_TYPES, "state_layers": candidates}
    bound = functools.update_wrapper(functools.partial(fixture, **given), fixture)
    del bound.__wrapped__
    signature = inspect.signature(fixture)
    bound.__signature__ = signature.replace(parameters=[p for p in signature.parameters.values() if p.name not in given])
    return bound
