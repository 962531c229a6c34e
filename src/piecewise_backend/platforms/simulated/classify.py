"""What the simulated platform's recorder does with each op: the one place an op is classified.

:func:`classify` sorts an ATen op overload into an :class:`OpKind`: a host sync (illegal while
capturing), an op whose CPU kernel must run CUDA's algorithm instead (:mod:`.rules`), an
allocation, a native op recorded whole (ATen, or a C++ kernel), or an opaque op implemented in
Python whose implementation runs under the recorder. The recorder itself is :mod:`.simulated`.
"""

from __future__ import annotations

import enum
import functools
import re
from typing import Any

import torch

from . import rules as sim_rules

_ALLOCATIONS = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::empty_permuted",
    "aten::new_empty",
    "aten::new_empty_strided",
}
_NATIVE_NAMESPACES = {"aten"}
_CIA = torch._C.DispatchKey.CompositeImplicitAutograd
_PY_SITE = re.compile(r"registered at \S+\.py:\d+")


class OpKind(enum.Enum):
    HOST_SYNC = "host sync"  # the host reads device data: illegal while capturing
    CUDA_KERNEL = "cuda kernel"  # the CPU kernel reads data on the host, CUDA's does not: run CUDA's algorithm
    ALLOCATION = "allocation"  # empty*: memory with no values, nothing to replay
    NATIVE = "native"  # an ATen op or a C++ kernel: recorded, replayed as it is (no Python runs)
    OPAQUE = "opaque"  # an op implemented in Python: its implementation runs under the recorder


def classify(func: Any, args: tuple, kwargs: dict) -> OpKind:
    """What the recorder does with ``func``: the one place an op is classified."""
    if sim_rules.is_host_sync(func, args, kwargs):
        return OpKind.HOST_SYNC
    if func in sim_rules.CUDA_KERNELS:
        return OpKind.CUDA_KERNEL
    if func._schema.name in _ALLOCATIONS:
        return OpKind.ALLOCATION
    name = func.name()
    if is_composite(name):
        # Reaches the recorder whole only under inference_mode: its parts are what runs (and may sync).
        return OpKind.OPAQUE
    if func.namespace in _NATIVE_NAMESPACES:
        return OpKind.NATIVE
    return OpKind.OPAQUE if _python_kernel(name) else OpKind.NATIVE


@functools.cache
def is_composite(name: str) -> bool:
    """Whether op ``name`` has a CompositeImplicitAutograd kernel (it decomposes into other ops)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, _CIA)


@functools.cache
def _python_kernel(name: str) -> bool:
    # The dispatcher records where each kernel was registered: "<file>.py:<line>" for a Python
    # one (torch.library, custom_op), a C++ source for compiled kernels such as vLLM's or fbgemm's.
    for line in torch._C._dispatch_dump_table(name).splitlines():
        if line.startswith("CPU:"):
            return _PY_SITE.search(line) is not None
    return False
