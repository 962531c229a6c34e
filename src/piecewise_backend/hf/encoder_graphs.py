"""A vision encoder as CUDA graphs over image budgets: the images of a step packed into the smallest that holds them.

For towers whose images all have one shape, ``(images, C, H, W)``, and whose features of an image depend on
that image alone (:data:`FIXED_SIZE`), one FULL graph per budget (a number of images; by default 1, 2, 4, 8,
independent of the step's token budget) is captured by a :class:`~piecewise_backend.CUDAGraphWrapper` in the
graph pool the engine's graphs use: the step's images are copied into the first rows of a persistent pixel
buffer, the rest of the budget is zeros (their features are dropped). More images than the largest budget run
eagerly. Each replay counts in ``pb.counters["replays"]``. A lazy engine's budgets run eagerly until its
``capture_idle`` captures those steps asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..capture.memory import scratch_pool
from ..capture.wrappers import CUDAGraphWrapper
from ..config import CompilationConfig
from ..context import BatchDescriptor, set_forward_context
from ..inputs import mark_persistent
from ..modes import CUDAGraphMode

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

    def capture(self, demanded: bool = False) -> int:
        """Capture every budget not yet captured (``demanded``: only those steps asked for); returns how many."""
        wanted = sorted(self.demand) if demanded else self.budgets
        missing = [b for b in wanted if BatchDescriptor(b) not in self.wrapper.entries]
        self.demand.clear()
        for b in missing:
            with set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(b)):
                self.wrapper(self.pixels[:b])
        return len(missing)

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
