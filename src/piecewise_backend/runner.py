"""GraphRunner: the engine-facing object that pads, dispatches, captures and replays.

It owns one persistent buffer per input, sized for the largest capture; every step
copies the batch into those buffers, so graphs always read the addresses they captured.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

try:
    from tqdm import tqdm
except ImportError:  # a bare GPU box may lack it: capture works, without a progress bar
    tqdm = None

from .assembly import effective_mode, resolve_cudagraph_mode, validate_capture_coverage, wrap_model
from .config import CompilationConfig
from .context import BatchDescriptor, set_forward_context
from .dispatch import CudagraphDispatcher
from .modes import AttentionGraphSupport, CUDAGraphMode
from .observability import logger
from .platforms import cuda as _cuda_platform
from .platforms import get_platform, resolve_platform_name
from .shapes import mark_token_views


@dataclasses.dataclass(frozen=True)
class StaticInput:
    """One per-token input of the model: ``(tokens, *shape)`` of ``dtype``; padding rows hold ``pad``."""

    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.long
    pad: int | float = 0

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"StaticInput.name must be an identifier, got {self.name!r}")
        if any(not isinstance(d, int) or d < 1 for d in self.shape):
            raise ValueError(f"StaticInput {self.name!r}: shape must hold positive ints, got {self.shape!r}")


@dataclasses.dataclass
class CaptureReport:
    graphs: int
    seconds: float
    stats: str


class GraphRunner:
    """Run ``model`` step by step under the CUDA graphs ``config`` asks for.

    ``inputs`` describe the per-token tensors; ``model_args`` name those passed to the model
    positionally (default: all, in order); ``context_fn`` turns the step's (padded) input
    views into forward-context attributes such as attention metadata.
    """

    def __init__(
        self,
        model: Any,
        config: CompilationConfig,
        inputs: Sequence[StaticInput],
        *,
        model_args: Sequence[str] | None = None,
        context_fn: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None,
        attention_support: AttentionGraphSupport = AttentionGraphSupport.ALWAYS,
        attention_split: bool = True,
        uniform_decode_query_len: int = 1,
        drafter: bool = False,
        device: torch.device | str | None = None,
    ):
        if not inputs:
            raise ValueError("GraphRunner needs at least one StaticInput (the token dimension comes from it)")
        names = [i.name for i in inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"GraphRunner input names must be unique, got {names}")
        self.inputs = {i.name: i for i in inputs}
        self.model_args = list(model_args) if model_args is not None else names
        unknown = [a for a in self.model_args if a not in self.inputs]
        if unknown:
            raise ValueError(f"model_args {unknown} are not among the inputs {names}")
        mode = resolve_cudagraph_mode(effective_mode(config), attention_support, attention_split=attention_split)
        self.config = config.replace(cudagraph_mode=mode)
        self.drafter = drafter
        self.context_fn = context_fn
        self.model = wrap_model(model, self.config, drafter=drafter)
        self.dispatcher = CudagraphDispatcher(self.config)
        self.dispatcher.initialize_keys(_drafter_mode(mode) if drafter else mode, uniform_decode_query_len)
        validate_capture_coverage(self.model, self.dispatcher)
        self.device = torch.device(device) if device is not None else _model_device(model)
        n = self.dispatcher.max_size
        self.buffers = {
            i.name: torch.full((n, *i.shape), i.pad, dtype=i.dtype, device=self.device) for i in inputs
        }
        self.last_mode = CUDAGraphMode.NONE
        self.capture_closed = False  # after capture(): an unseen descriptor raises instead of capturing
        self.report: CaptureReport | None = None

    @property
    def mode(self) -> CUDAGraphMode:
        return self.config.cudagraph_mode

    def _views(self, padded: int) -> dict[str, torch.Tensor]:
        return {name: buf[:padded] for name, buf in self.buffers.items()}

    def _call(self, views: Mapping[str, torch.Tensor], mode: CUDAGraphMode, desc: BatchDescriptor, extra: dict) -> Any:
        attrs = dict(self.context_fn(dict(views)) if self.context_fn else {}, **extra)
        if self.capture_closed:
            attrs.setdefault("allow_capture", False)
        with set_forward_context(mode, desc, **attrs):
            return self.model(*(views[a] for a in self.model_args))

    def _fits(self, batch: Mapping[str, torch.Tensor]) -> bool:
        """True when every non-token dimension fits the static buffers (else: eager)."""
        for name, t in batch.items():
            spec = self.inputs[name]
            if t.is_floating_point() != spec.dtype.is_floating_point:
                raise ValueError(f"GraphRunner.run: input {name!r} is {t.dtype}, its StaticInput is {spec.dtype}")
            if t.dim() != len(spec.shape) + 1 or any(a > b for a, b in zip(t.shape[1:], spec.shape)):
                return False
        return True

    def run(self, *, uniform_decode: bool = False, num_reqs: int | None = None, context: dict | None = None, **batch: torch.Tensor) -> Any:
        """Run one step; returns outputs sliced to the real token count.

        Replayed outputs live in graph memory: valid until the next step. ``context`` adds
        forward-context attributes on top of ``context_fn``'s.
        """
        missing = sorted(set(self.inputs) - set(batch))
        extra = sorted(set(batch) - set(self.inputs))
        if missing or extra:
            raise ValueError(f"GraphRunner.run: missing inputs {missing}, unknown inputs {extra}; expected {sorted(self.inputs)}")
        counts = {name: t.shape[0] for name, t in batch.items()}
        n = next(iter(counts.values()))
        if any(c != n for c in counts.values()):
            raise ValueError(f"GraphRunner.run: inputs disagree on the token count: {counts}")
        mode, desc = self.dispatcher.dispatch(n, uniform_decode=uniform_decode, num_reqs=num_reqs, disable_full=self.drafter)
        if mode != CUDAGraphMode.NONE and not self._fits(batch):
            logger.debug("step of %d tokens does not fit the static buffers: running eagerly", n)
            mode, desc = CUDAGraphMode.NONE, BatchDescriptor(n)
        self.last_mode = mode
        if mode == CUDAGraphMode.NONE:
            return self._call(batch, mode, desc, context or {})
        padded = desc.num_tokens
        for name, t in batch.items():
            buf, spec = self.buffers[name], self.inputs[name]
            if t.shape[1:] == spec.shape:  # the common case: one copy, pad only the padding rows
                buf[:n].copy_(t)
                if padded > n:
                    buf[n:padded].fill_(spec.pad)
            else:
                buf[:padded].fill_(spec.pad)
                buf[(slice(0, n), *(slice(0, d) for d in t.shape[1:]))].copy_(t)
        out = self._call(self._views(padded), mode, desc, context or {})
        return tree_map(lambda o: o[:n] if isinstance(o, torch.Tensor) and o.dim() and o.shape[0] == padded else o, out)

    def capture(self, *, disable_after: bool = True, progress: bool | None = None) -> CaptureReport:
        """Warm up and capture every descriptor the dispatcher can emit, largest first.

        With ``disable_after`` (default) later steps of this runner never capture: an
        unseen descriptor raises :class:`CaptureDisabledError` instead of capturing mid-serving.
        """
        plan = self.dispatcher.capture_descriptors()
        total = sum(len(descs) for _, descs in plan)
        platform_name = resolve_platform_name(self.config.platform)
        platform = get_platform(platform_name) if platform_name and total else None
        before = platform.memory() if platform else 0
        start = time.perf_counter()
        gc.collect()  # once for the whole capture, then frozen: collecting per graph dominated capture time
        gc.freeze()
        _cuda_platform.gc_managed_outside = True
        try:
            with _progress(total, progress) as bar:
                for mode, descs in plan:
                    for desc in descs:
                        views = self._views(desc.num_tokens)
                        for _ in range(self.config.num_warmups):
                            mark_token_views(views, self.inputs)  # one Dynamo graph for every size, 1 too
                            self._call(views, CUDAGraphMode.NONE, desc, {})
                        self._call(views, mode, desc, {})
                        bar.update(1)
                        bar.set_postfix_str(f"{mode.name} {desc.num_tokens}")
        finally:
            _cuda_platform.gc_managed_outside = False
            gc.unfreeze()
        stats = platform.describe(platform.memory() - before) if platform else "no graphs"
        self.report = CaptureReport(total, time.perf_counter() - start, stats)
        logger.info("captured %d graphs in %.2f s (%s)", total, self.report.seconds, stats)
        self.capture_closed = disable_after
        return self.report


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


def _progress(total: int, progress: bool | None) -> Any:
    """A tqdm bar (``progress=None``: only on a terminal), or a silent stand-in."""
    if tqdm is None or progress is False:
        return _NoBar()
    return tqdm(total=total, desc="capturing graphs", disable=None if progress is None else False)


def _drafter_mode(mode: CUDAGraphMode) -> CUDAGraphMode:
    # A drafter has only the breakable wrapper, even when the target runs plain FULL.
    return CUDAGraphMode.NONE if mode == CUDAGraphMode.NONE else CUDAGraphMode.PIECEWISE


def _model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
