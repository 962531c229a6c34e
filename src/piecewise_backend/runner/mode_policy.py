"""Mode policy: the mode a runner runs, from the one its config asks for, and each downgrade on the way, in words.

:func:`resolve_cudagraph_mode` is what an attention backend allows; :func:`runner_modes` is the whole
policy of a :class:`~.graph_runner.GraphRunner`: the platform (no GPU: NONE), the attention support,
micro-batching (no breakable wrapper captures PIECEWISE graphs then; some micro-batched steps run
eagerly), and a drafter (never micro-batched; it dispatches PIECEWISE or NONE only). Each step lowers
the mode or drops a feature and says so in :attr:`RunnerModes.downgrades` (``GraphRunner.downgrades``).
"""

from __future__ import annotations

import dataclasses

from ..config import CompilationConfig
from ..modes import AttentionGraphSupport, CUDAGraphMode
from ..observability import logger
from ..platforms.registry import effective_mode

_NONE, _PIECEWISE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


def resolve_cudagraph_mode(
    mode: CUDAGraphMode | str,
    support: AttentionGraphSupport | int,
    *,
    attention_split: bool = True,
    uniform_decode_query_len: int = 1,
) -> CUDAGraphMode:
    """The strongest mode ``mode`` can keep given what the attention backend supports.

    ``UNIFORM_SINGLE_TOKEN_DECODE`` covers decode batches of one token per request only:
    with ``uniform_decode_query_len > 1`` (speculative decode) it supports no full graph.
    """
    mode = CUDAGraphMode.parse(mode)
    support = AttentionGraphSupport(support)
    if not isinstance(uniform_decode_query_len, int) or isinstance(uniform_decode_query_len, bool) or (
        uniform_decode_query_len < 1
    ):
        raise ValueError(f"uniform_decode_query_len must be a positive int, got {uniform_decode_query_len!r}")
    if support == AttentionGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE and uniform_decode_query_len > 1:
        if mode.max_cudagraph_mode() != _FULL:
            return mode
        # no full graph at all: the decode side falls back to what the mixed side does without FULL
        resolved = _PIECEWISE if attention_split and mode != CUDAGraphMode.FULL_DECODE_ONLY else _NONE
        logger.info(
            "cudagraph_mode %s -> %s (attention support %s, uniform_decode_query_len=%d)",
            mode.name, resolved.name, support.name, uniform_decode_query_len,
        )
        return resolved
    if mode.mixed_mode() == _FULL and support < AttentionGraphSupport.ALWAYS:
        if support == AttentionGraphSupport.NEVER:
            raise ValueError(
                f"cudagraph_mode {mode.name} captures attention in full graphs, but the attention backend "
                "supports that NEVER; use PIECEWISE (with attention as a splitting op) or NONE"
            )
        resolved = CUDAGraphMode.FULL_AND_PIECEWISE if attention_split else CUDAGraphMode.FULL_DECODE_ONLY
    elif mode.decode_mode() == _FULL and support == AttentionGraphSupport.NEVER:
        resolved = _PIECEWISE if attention_split else _NONE
    else:
        return mode
    logger.info("cudagraph_mode %s -> %s (attention support %s)", mode.name, resolved.name, support.name)
    return resolved


def drop_full_graphs(mode: CUDAGraphMode | str, reason: str) -> CUDAGraphMode:
    """``mode`` without FULL graphs, for a model no FULL graph can hold (``reason``, logged): FULL and
    FULL_AND_PIECEWISE become PIECEWISE, FULL_DECODE_ONLY becomes NONE; the rest is unchanged."""
    mode = CUDAGraphMode.parse(mode)
    if not mode.has_full_cudagraphs():
        return mode
    resolved = _NONE if mode == CUDAGraphMode.FULL_DECODE_ONLY else _PIECEWISE
    logger.info("cudagraph_mode %s -> %s (no FULL graph can hold it: %s)", mode.name, resolved.name, reason)
    return resolved


@dataclasses.dataclass(frozen=True)
class RunnerModes:
    """What :func:`runner_modes` resolved: the ``mode`` the runner runs (its config's ``cudagraph_mode``),
    the mode its dispatcher's keys come from (``dispatch_mode``: a drafter's is PIECEWISE or NONE), whether
    its steps are micro-batched (``ubatching``), and each way it falls short of the config (``downgrades``)."""

    mode: CUDAGraphMode
    dispatch_mode: CUDAGraphMode
    ubatching: bool
    downgrades: tuple[str, ...]


def runner_modes(
    config: CompilationConfig, *, attention_support: AttentionGraphSupport | int = AttentionGraphSupport.ALWAYS,
    attention_split: bool = True, uniform_decode_query_len: int = 1, drafter: bool = False,
) -> RunnerModes:
    """The modes a runner of ``config`` runs, and every downgrade from what ``config`` asked, in words
    (micro-batching's are also logged as warnings)."""
    downgrades = []
    effective = effective_mode(config)
    if effective != config.cudagraph_mode:
        downgrades.append(
            f"platform {config.platform!r} finds no GPU: cudagraph_mode {config.cudagraph_mode.name} -> NONE"
        )
    mode = resolve_cudagraph_mode(
        effective, attention_support, attention_split=attention_split,
        uniform_decode_query_len=uniform_decode_query_len,
    )
    if mode != effective:
        downgrades.append(
            f"attention support {AttentionGraphSupport(attention_support).name}: cudagraph_mode {effective.name} -> "
            f"{mode.name}"
        )
    ubatching = config.use_ubatching and not drafter
    if config.use_ubatching and drafter:
        downgrades.append("use_ubatching: a drafter's steps are never micro-batched")
    if ubatching and config.use_breakable and mode.has_piecewise_cudagraphs():
        resolved = without_piecewise(mode)
        downgrades.append(
            f"use_ubatching with use_breakable=True: cudagraph_mode {mode.name} -> {resolved.name} (no breakable "
            "wrapper captures PIECEWISE graphs; use_breakable=False keeps per-piece graphs)"
        )
        mode = resolved
    if ubatching:
        eager = eager_halves(mode, config)
        if eager:
            logger.warning("use_ubatching: %s", eager)
            downgrades.append(f"use_ubatching: {eager}")
    return RunnerModes(mode, drafter_mode(mode) if drafter else mode, ubatching, tuple(downgrades))


def without_piecewise(mode: CUDAGraphMode) -> CUDAGraphMode:
    """Micro-batching replaces the breakable wrapper: PIECEWISE graphs have no capturer then."""
    if mode.has_piecewise_cudagraphs():
        resolved = CUDAGraphMode.FULL_DECODE_ONLY if mode.has_full_cudagraphs() else CUDAGraphMode.NONE
        logger.warning(
            "use_ubatching: cudagraph_mode %s -> %s (no breakable wrapper captures PIECEWISE graphs; "
            "use_breakable=False keeps per-piece graphs)", mode.name, resolved.name,
        )
        return resolved
    return mode


def eager_halves(mode: CUDAGraphMode, config: CompilationConfig) -> str:
    """Which graph steps micro-batching runs eagerly instead (in two threads), in words; "" for none.

    Only a uniform decode step dispatched FULL has a micro-batched graph; any other step that
    reaches its threshold within the capture sizes loses its graph.
    """
    largest = config.sizes[-1] if config.sizes else 0
    lost = []
    if mode.decode_mode() == CUDAGraphMode.PIECEWISE and config.dbo_decode_token_threshold <= largest:
        lost.append(f"decode steps of {config.dbo_decode_token_threshold}+ tokens (PIECEWISE)")
    if mode.mixed_mode() != CUDAGraphMode.NONE and config.dbo_prefill_token_threshold <= largest:
        lost.append(f"steps with a prompt of {config.dbo_prefill_token_threshold}+ tokens ({mode.mixed_mode().name})")
    if not lost:
        return ""
    return (
        f"micro-batched {' and '.join(lost)} run eagerly in two threads, without a graph (only uniform decode "
        "steps dispatched FULL replay micro-batched graphs)"
    )


def drafter_mode(mode: CUDAGraphMode) -> CUDAGraphMode:
    """The mode a drafter's dispatcher keys come from: it has only the breakable wrapper, even when the target
    runs plain FULL."""
    return CUDAGraphMode.NONE if mode == CUDAGraphMode.NONE else CUDAGraphMode.PIECEWISE
