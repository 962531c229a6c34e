"""A vision encoder as CUDA graphs: over image budgets for fixed-size towers, per image grid for qwen2-vl's.

For towers whose images all have one shape, ``(images, C, H, W)``, and whose features of an image depend on
that image alone (:data:`FIXED_SIZE`), one FULL graph per budget (a number of images; by default 1, 2, 4, 8,
independent of the step's token budget) is captured by a :class:`~piecewise_backend.CUDAGraphWrapper` in the
graph pool the engine's graphs use: the step's images are copied into the first rows of a persistent pixel
buffer, the rest of the budget is zeros (their features are dropped). More images than the largest budget run
eagerly. Each replay counts in ``pb.counters["replays"]``. A lazy engine's budgets run eagerly until its
``capture_idle`` captures those steps asked for.

Qwen2-VL's and Qwen2.5-VL's towers (:data:`GRID_TOWERS`) pack its images' patches into one sequence and reads their
lengths on the host (``cu_seqlens.tolist()``, the grid in loops): :class:`GridEncoderGraphs` keys a
graph by the step's image grids instead. Its position ids and segment boundaries are computed before
the capture, outside it, and the vision attention takes its segment lengths as Python ints for the
call (a swap installed only while a graph records, :func:`_segment_attention`), so nothing inside reads
the device. At most ``max_graphs`` grid keys are kept; other grids run eagerly.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ...capture.memory import scratch_pool
from ...capture.wrappers import CUDAGraphWrapper
from ...config import CompilationConfig
from ...context import BatchDescriptor, set_forward_context
from ...inputs import mark_persistent
from ...modes import CUDAGraphMode

#: Model types whose towers take ``pixel_values`` of one shape and encode each image on its own.
FIXED_SIZE = frozenset({"llava"})
#: Images per budget when the engine is given none.
DEFAULT_BUDGETS = (1, 2, 4, 8)


def fixed_image_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """``(C, H, W)`` of every image of ``model``'s tower, when it is one of :data:`FIXED_SIZE` (else None)."""
    if getattr(model.config, "model_type", "") not in FIXED_SIZE:
        return None
    vision = model.config.vision_config
    size = getattr(vision, "image_size", None)
    if not isinstance(size, int):
        return None
    return (getattr(vision, "num_channels", 3), size, size)


class EncoderGraphs:
    """``encode(pixel_values) -> (images * tokens per image, hidden)`` replayed from a graph per budget."""

    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor], image_shape: tuple[int, ...],
                 budgets: Sequence[int], config: CompilationConfig, *, dtype: torch.dtype, device: torch.device,
                 lazy: bool = False):
        if not budgets or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in budgets):
            raise ValueError(f"encoder budgets must be positive ints (images per graph), got {list(budgets)!r}")
        #: the images each graph holds, ascending
        self.budgets = tuple(sorted(set(budgets)))
        self.encode = encode
        self.pixels = torch.zeros(self.budgets[-1], *image_shape, dtype=dtype, device=device)
        mark_persistent(self.pixels)
        self.wrapper = CUDAGraphWrapper(encode, CUDAGraphMode.FULL, config=config)
        #: encoder calls replayed from a graph, and run eagerly (more images than the largest budget, or lazy)
        self.replayed = self.eager = 0
        #: ``lazy``: a budget not captured yet runs eagerly and is asked for here (:meth:`capture` takes it later)
        self.lazy = lazy
        self.demand: set[int] = set()

    def takes(self, inputs: dict[str, torch.Tensor]) -> bool:
        """Whether a request's ``mm_inputs`` can be encoded by these graphs (pixel values alone)."""
        return set(inputs) == {"pixel_values"}

    def budget(self, images: int) -> int | None:
        """The smallest budget that holds ``images`` (None: more than the largest)."""
        return next((b for b in self.budgets if b >= images), None)

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n = pixel_values.shape[0]
        budget = self.budget(n)
        if budget is not None and self.lazy and BatchDescriptor(budget) not in self.wrapper.entries:
            self.demand.add(budget)
            budget = None
        if budget is None:
            self.eager += 1
            return self.encode(pixel_values)
        self.pixels[:n].copy_(pixel_values)
        self.pixels[n:budget].zero_()
        with set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(budget)):
            out = self.wrapper(self.pixels[:budget])
        self.replayed += 1
        return out[: out.shape[0] // budget * n].clone()  # graph memory: the next replay overwrites it

    def capture(self, demanded: bool = False) -> list[BatchDescriptor]:
        """Capture every budget not yet captured (``demanded``: only those steps asked for); returns the
        descriptors captured (``num_tokens``: the images of the budget)."""
        wanted = sorted(self.demand) if demanded else self.budgets
        missing = [BatchDescriptor(b) for b in wanted if BatchDescriptor(b) not in self.wrapper.entries]
        self.demand.clear()
        for desc in missing:
            with set_forward_context(CUDAGraphMode.FULL, desc):
                self.wrapper(self.pixels[:desc.num_tokens])
        return missing

    def estimate_memory(self) -> int:
        """Bytes the graphs add to the pool: the largest budget captured into a scratch pool, then released."""
        platform = self.wrapper.platform
        with scratch_pool(platform):
            before = platform.memory()
            with set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(self.budgets[-1])):
                self.wrapper(self.pixels)
            return max(0, platform.memory() - before)

    @property
    def captured(self) -> int:
        """Budgets captured so far."""
        return len(self.wrapper.entries)


#: Model types whose towers pack patches with ``cu_seqlens``: graphs per grid; True where the tower also attends
#: within windows (qwen2.5-vl: ``window_index`` and ``cu_window_seqlens``).
GRID_TOWERS = {"qwen2_vl": False, "qwen2_5_vl": True}
#: Their vision attention classes (by name), which take their segment lengths as ints while a graph records.
_SEGMENT_ATTENTION = frozenset({"VisionAttention", "Qwen2_5_VLVisionAttention"})


class GridEncoderGraphs:
    """``encode(pixel_values, image_grid_thw) -> (image tokens, hidden)`` replayed from a graph per grid key
    (the grids of the images encoded together), for a tower of :data:`GRID_TOWERS`."""

    def __init__(self, model: torch.nn.Module, config: CompilationConfig, *, max_graphs: int = 8, lazy: bool = False):
        self.visual = model.model.visual
        self.windows = GRID_TOWERS[model.config.model_type]
        self.config = config
        self.max_graphs = max_graphs
        self._graphs: dict[tuple[tuple[int, int, int], ...], tuple[CUDAGraphWrapper, torch.Tensor, dict]] = {}
        self.replayed = self.eager = 0
        #: ``lazy``: a grid not captured yet runs eagerly and is asked for here, with its pixel features
        self.lazy = lazy
        self.demand: dict[tuple[tuple[int, int, int], ...], int] = {}

    def takes(self, inputs: dict[str, torch.Tensor]) -> bool:
        """Whether a request's ``mm_inputs`` can be encoded by these graphs (pixel values and their grid)."""
        return set(inputs) == {"pixel_values", "image_grid_thw"}

    def capture(self, demanded: bool = False) -> list[BatchDescriptor]:
        """Capture the grids steps asked for (a grid is known only from traffic, so ``demanded`` changes nothing);
        returns the descriptors captured (``num_tokens``: the grid's patches)."""
        wanted = dict(self.demand)
        self.demand.clear()
        done = []
        for key, features in wanted.items():
            if key not in self._graphs and len(self._graphs) < self.max_graphs:
                patches = sum(t * h * w for t, h, w in key)
                param = next(self.visual.parameters())
                self._replay(key, torch.zeros(patches, features, dtype=param.dtype, device=param.device))
                self.replayed -= 1  # a capture, not an encoding
                done.append(BatchDescriptor(patches))
        return done

    def estimate_memory(self) -> int:
        """0: a grid graph is captured on first sight of its grid, not before."""
        return 0

    @property
    def captured(self) -> int:
        """Grid keys captured so far."""
        return len(self._graphs)

    def _inputs(self, key: tuple[tuple[int, int, int], ...], device: torch.device) -> dict[str, Any]:
        """What the tower computes from the grid on the host, computed here (outside any capture)."""
        from transformers import vision_utils

        grid = torch.tensor(key, dtype=torch.long)
        merge = self.visual.spatial_merge_size
        full = vision_utils.get_vision_cu_seqlens(grid)
        inputs = {
            "grid_thw": grid.to(device),
            "position_ids": vision_utils.get_vision_position_ids(grid, merge).to(device),
            "cu_seqlens": full.to(device),
            "max_seqlen": int((grid[:, 1] * grid[:, 2]).max()),
        }
        segments = {inputs["cu_seqlens"].data_ptr(): _lengths(full)}  # which boundaries a layer was given
        if self.windows:
            index, windows = vision_utils.get_vision_window_index(
                grid, spatial_merge_size=merge, window_size=self.visual.window_size, patch_size=self.visual.patch_size)
            inputs.update(window_index=index.to(device), cu_window_seqlens=windows.to(device),
                          max_window_seqlen=max(_lengths(windows), default=0))
            segments[inputs["cu_window_seqlens"].data_ptr()] = _lengths(windows)
        mark_persistent(*(v for v in inputs.values() if isinstance(v, torch.Tensor)))  # read in place: segments by address
        inputs["pb_segments"] = segments
        return inputs

    def __call__(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        key = tuple(tuple(int(v) for v in row) for row in image_grid_thw.tolist())
        if key not in self._graphs and (len(self._graphs) >= self.max_graphs or self.lazy):
            if self.lazy and len(self._graphs) < self.max_graphs:
                self.demand[key] = pixel_values.shape[1]
            self.eager += 1
            return self.encode_eagerly(pixel_values, image_grid_thw)
        return self._replay(key, pixel_values)

    def _replay(self, key: tuple[tuple[int, int, int], ...], pixel_values: torch.Tensor) -> torch.Tensor:
        entry = self._graphs.get(key)
        if entry is None:
            pixels = torch.zeros_like(pixel_values, dtype=self.visual.dtype)
            mark_persistent(pixels)
            wrapper = CUDAGraphWrapper(self._tower, CUDAGraphMode.FULL, config=self.config)
            entry = self._graphs[key] = (wrapper, pixels, self._inputs(key, pixels.device))
        wrapper, pixels, inputs = entry
        pixels.copy_(pixel_values)
        with set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(pixels.shape[0])), \
                (_segment_attention(self.visual) if not wrapper.entries else contextlib.nullcontext()):
            out = wrapper(pixels, **inputs)
        self.replayed += 1
        return out.clone()

    def _tower(self, pixels: torch.Tensor, grid_thw: torch.Tensor, **inputs: Any) -> torch.Tensor:
        return self.visual(pixels, grid_thw=grid_thw, **inputs).pooler_output

    def encode_eagerly(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        return self.visual(pixel_values.type(self.visual.dtype), grid_thw=image_grid_thw).pooler_output


@contextlib.contextmanager
def _segment_attention(visual: torch.nn.Module) -> Iterator[None]:
    """While a graph of ``visual`` records: each vision attention takes its segments' lengths from the call's
    ``pb_segments`` (Python ints) instead of reading ``cu_seqlens`` on the host."""
    swapped = [m for m in visual.modules() if type(m).__name__ in _SEGMENT_ATTENTION]
    for m in swapped:
        m.forward = types.MethodType(_segments_forward, m)
    try:
        yield
    finally:
        for m in swapped:
            del m.forward


def _segments_forward(self: Any, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                      position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                      max_seqlen: int | None = None, pb_segments: dict[int, list[int]] | None = None,
                      **kwargs: Any) -> torch.Tensor:
    """Qwen2-VL's vision attention: bidirectional within each segment (an image, or a window of one), the
    segments' lengths those ``pb_segments`` holds for the boundaries this layer was given."""
    lengths = pb_segments[cu_seqlens.data_ptr()]  # type: ignore[index]
    rotary = _rotary(type(self))
    tokens = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(tokens, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = rotary(q, k, cos, sin)
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, tokens, head_dim)
    parts = [F.scaled_dot_product_attention(a, b, c, scale=self.scaling)
             for a, b, c in zip(*(t.split(lengths, dim=2) for t in (q, k, v))) if a.shape[2]]
    out = torch.cat(parts, dim=2)[0].transpose(0, 1).reshape(tokens, -1)
    return self.proj(out)


def _lengths(boundaries: torch.Tensor) -> list[int]:
    """Segment lengths of cumulative ``boundaries`` (a CPU tensor)."""
    return (boundaries[1:] - boundaries[:-1]).tolist()


def _rotary(cls: type) -> Callable[..., Any]:
    """The vision rotary function of the module that defines ``cls``."""
    import sys

    return sys.modules[cls.__module__].apply_rotary_pos_emb_vision
