"""An engine's capture ladder: the config's sizes plus the engine's own limits.

A FULL_AND_PIECEWISE engine whose sizes stop short of its limits would run its largest steps
eagerly: a decode step of ``max_num_reqs`` requests above the largest size, a prefill chunk of
``max_num_batched_tokens``. :func:`cover_limits` adds both to the ladder (vLLM does the same for
``max_num_seqs`` and ``max_num_batched_tokens``). A ``max_capture_size`` the user set bounds what
is added; the one derived from ``capture_sizes`` does not.
"""

from __future__ import annotations

import dataclasses
import logging

from ..config import MAX_CAPTURE_SIZE_LIMIT, CompilationConfig
from ..modes import CUDAGraphMode

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Ladder:
    """What :func:`cover_limits` did: the ``config`` the engine's runner uses, the sizes it ``added``
    to the ladder (ascending), and the limits it could not cover (``uncovered``: ``(what, size)``,
    above an explicit ``max_capture_size``; those steps run eagerly, said once in a warning)."""

    config: CompilationConfig
    added: tuple[int, ...] = ()
    uncovered: tuple[tuple[str, int], ...] = ()

    @property
    def downgrades(self) -> tuple[str, ...]:
        """Each uncovered limit in words, as ``GraphRunner.downgrades`` lists them."""
        bound = self.config.max_capture_size
        return tuple(f"{what}={size}: steps of {size} tokens run eagerly, above max_capture_size={bound}"
                     for what, size in self.uncovered)


def cover_limits(
    config: CompilationConfig, *, max_num_reqs: int, max_num_batched_tokens: int | None,
    uniform_decode_query_len: int = 1, name: str = "engine",
) -> Ladder:
    """The ladder covering ``max_num_reqs`` uniform decode requests of ``uniform_decode_query_len``
    tokens each (a FULL size) and a step of ``max_num_batched_tokens`` (a PIECEWISE size; None: the
    budget defaults to the largest capture size, nothing to add)."""
    mode = config.cudagraph_mode
    if mode == CUDAGraphMode.NONE or not config.sizes:
        return Ladder(config)
    limits = []
    if mode.decode_mode() == CUDAGraphMode.FULL or mode.mixed_mode() == CUDAGraphMode.FULL:
        limits.append(("max_num_reqs", max_num_reqs * uniform_decode_query_len))
    if mode.mixed_mode() != CUDAGraphMode.NONE and max_num_batched_tokens is not None:
        limits.append(("max_num_batched_tokens", max_num_batched_tokens))
    sizes = set(config.sizes)
    bound = MAX_CAPTURE_SIZE_LIMIT if config.max_capture_size_derived else config.max_capture_size
    added, uncovered = [], []
    for what, size in limits:
        if size in sizes:
            continue
        if size > bound:
            uncovered.append((what, size))
            continue
        sizes.add(size)
        added.append(size)
    if uncovered:
        logger.warning(
            "%s: steps of %s tokens run eagerly: above max_capture_size=%d (raise max_capture_size, or leave "
            "it unset to capture them)", name, ", ".join(f"{what}={size}" for what, size in uncovered), bound,
        )
    if not added:
        return Ladder(config, (), tuple(uncovered))
    logger.info("%s: capture sizes %s added to cover %s", name, sorted(added),
                ", ".join(what for what, size in limits if size in added))
    # an explicit max_capture_size stays; a derived one follows the new sizes
    return Ladder(config.replace(capture_sizes=sorted(sizes)), tuple(sorted(added)), tuple(uncovered))
