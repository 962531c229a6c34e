"""The step of an image-text-to-text engine: the encoder run for the requests it prefills, their rows staged.

:class:`ImageDecode` runs the encoder (the model's ``get_image_features``, or its graphs:
:mod:`.encoder_graphs`) in the step that prefills a request's first image token, for every such request
of the step in one call, keeps the output until the last image token is prefilled (dropped on
preemption), and stages the step's image rows and rope positions in the :class:`~.layout.ImageTokensFirst`.
A request whose images the encoder cannot encode, or whose features do not match its image tokens, ends
with ``"error"``; the step serves the others.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from ...config import CompilationConfig
from ...modes import CUDAGraphMode
from ...serve.loop import Executed
from ...serve.model_runner import Decode, ModelRunner
from ...serve.scheduler import StepPlan
from .encoder_graphs import DEFAULT_BUDGETS, GRID_TOWERS, EncoderGraphs, GridEncoderGraphs, fixed_image_shape
from .inputs import Images
from .layout import ImageTokensFirst


def build_encoder_graphs(model: torch.nn.Module, config: CompilationConfig, token_budgets: Sequence[int] | None,
                   lazy: bool = False) -> EncoderGraphs | GridEncoderGraphs | None:
    """Graphs of ``model``'s encoder, each holding as many images as fit in one of ``token_budgets`` (image
    tokens; None: :data:`~.encoder_graphs.DEFAULT_BUDGETS` images), or None where it runs eagerly: its images
    vary in shape, or ``config`` captures no graph."""
    if config.cudagraph_mode is CUDAGraphMode.NONE:
        return None
    if getattr(model.config, "model_type", "") in GRID_TOWERS:
        if token_budgets is not None:
            raise ValueError(f"encoder_token_budgets={list(token_budgets)}: {type(model).__name__}'s encoder graphs are "
                             "keyed by the images' grids (image_grid_thw), not by token budgets; leave it None")
        return GridEncoderGraphs(model, config, lazy=lazy)
    shape = fixed_image_shape(model)
    if shape is None:
        return None
    param = next(model.parameters())
    method = model.get_image_features
    encode = lambda pixels: features(method(pixel_values=pixels))  # noqa: E731
    budgets = DEFAULT_BUDGETS
    if token_budgets is not None:
        with torch.inference_mode():  # one image's tokens, from the encoder itself
            per_image = encode(torch.zeros(1, *shape, dtype=param.dtype, device=param.device)).shape[0]
        budgets = tuple(sorted({t // per_image for t in token_budgets if t >= per_image}))
        if not budgets:
            raise ValueError(f"encoder_token_budgets={list(token_budgets)}: each is fewer than the {per_image} tokens "
                             f"of one image of {type(model).__name__}; give budgets of at least {per_image}")
    return EncoderGraphs(encode, shape, budgets, config, dtype=param.dtype, device=param.device, lazy=lazy)


def features(out: Any) -> torch.Tensor:
    """``get_image_features``' output as one row per image token (deepstack features beside the embedding's,
    as more columns, in layer order)."""
    def rows(found: Any) -> torch.Tensor:
        if isinstance(found, (list, tuple)):
            found = torch.cat([f.reshape(-1, f.shape[-1]) for f in found], 0)
        return found.reshape(-1, found.shape[-1])

    main = rows(getattr(out, "pooler_output", out))
    deep = getattr(out, "deepstack_features", None)
    return torch.cat([main, *(rows(d) for d in deep)], -1) if deep else main


def encode(model: torch.nn.Module, images: Images) -> torch.Tensor:
    """The encoder's output for ``images``: one row per image token, in prompt order (as ``masked_scatter``
    in the model's forward takes them)."""
    method = model.get_image_features
    wanted = inspect.signature(method).parameters
    kwargs = {k: v for k, v in images.inputs.items() if k in wanted or "kwargs" in wanted}
    return features(method(**kwargs))


class ImageDecode(Decode):
    """:class:`~piecewise_backend.serve.model_runner.Decode` of an image-text-to-text model: before each step,
    the encoder runs for requests whose image tokens it prefills first, and their rows and the step's rope
    positions are staged in the model's :class:`ImageTokensFirst`."""

    def __init__(self, model: ModelRunner, layout: ImageTokensFirst, encoder: torch.nn.Module, rules: Any = None,
                 graphs: EncoderGraphs | GridEncoderGraphs | None = None):
        super().__init__(model, rules)
        self.layout = layout
        self.encoder = encoder
        #: the encoder's graphs over image budgets (None: it runs eagerly)
        self.graphs = graphs

    def execute(self, plan: StepPlan) -> Executed:
        for r in plan.preempted:  # recomputed from its first token: its images encoded again then
            if r.mm is not None:
                r.mm.embeds = None
        failed = self._encode_all([r for r, start, count in plan.chunks if _wants_encoder(r.mm, start, count)])
        if failed:  # those requests end with "error"; the step runs the others
            kept = [c for c in plan.chunks if id(c[0]) not in failed]
            executed = self._run(dataclasses.replace(plan, chunks=kept)) if kept else Executed(
                [], 0, False, CUDAGraphMode.NONE)
            tokens = iter(executed.tokens)
            executed.tokens = [[] if id(r) in failed else next(tokens) for r, _, _ in plan.chunks]
            executed.failed = {i: failed[id(r)] for i, (r, _, _) in enumerate(plan.chunks) if id(r) in failed}
            return executed
        return self._run(plan)

    def _run(self, plan: StepPlan) -> Executed:
        rows, embeds, rope = self._inputs(plan.chunks)
        self.layout.stage(rows, embeds, rope)
        try:
            return super().execute(plan)
        finally:
            self.layout.unstage()
            for r, start, count in plan.chunks:
                if r.mm is not None and r.mm.embeds is not None and start + count >= r.mm.last:
                    r.mm.embeds = None  # every image token prefilled: the encoder output is not needed again

    def _inputs(self, chunks: Sequence[tuple[Any, int, int]]) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                                       torch.Tensor | None]:
        """The step rows of image tokens, their encoder rows, and the step's rope positions (None: 1-D)."""
        device = self.layout.mm_mask.device
        total = sum(count for _, _, count in chunks)
        if total > self.layout.rows:
            raise ValueError(f"a step of {total} tokens exceeds the {self.layout.rows} rows of the image-token buffers "
                             "(max_num_batched_tokens is fixed when an image-text-to-text engine is built)")
        rows, feats, ropes = [], [], []
        offset = 0
        for r, start, count in chunks:
            images = r.mm
            if images is not None and images.placeholders.numel() and start < images.last:
                places = images.placeholders
                inside = (places >= start) & (places < start + count)
                if bool(inside.any()):
                    rows.append(places[inside] - start + offset)
                    feats.append(images.embeds[inside.nonzero().flatten()])
            if self.layout.mrope:
                ropes.append(_rope_rows(images, start, count, device))
            offset += count
        rope = torch.cat(ropes) if ropes else None
        if not rows:
            return None, None, rope
        return torch.cat(rows), torch.cat(feats), rope

    def _encode_all(self, requests: Sequence[Any]) -> dict[int, str]:
        """The encoder output of every request in ``requests``: their images packed into one graph replay when
        the encoder has graphs, else each request's run eagerly. Returns the requests whose images the
        encoder could not encode, or whose features do not match their image tokens, with the reason (keyed by
        ``id(request)``)."""
        failed: dict[int, str] = {}
        if not requests:
            return failed
        if self.graphs is not None and all(self.graphs.takes(r.mm.inputs) for r in requests):
            packed = {k: torch.cat([r.mm.inputs[k] for r in requests]) for k in requests[0].mm.inputs}
            out = self.graphs(**packed)
            counts = [r.mm.placeholders.numel() for r in requests]
            if out.shape[0] == sum(counts):
                for r, rows in zip(requests, out.split(counts)):
                    r.mm.embeds = rows
                return failed
            # the images make another count than the prompts hold: encoded one by one to find which
        for r in requests:
            try:
                out = encode(self.encoder, r.mm)
            except Exception as e:  # noqa: BLE001 (its images only: the request ends, the step goes on)
                failed[id(r)] = f"the encoder failed on its mm_inputs ({type(e).__name__}: {e})"
                continue
            self._keep(r, out, failed)
        return failed

    def _keep(self, request: Any, out: torch.Tensor, failed: dict[int, str]) -> None:
        """``out`` as ``request``'s encoder output, or the reason it cannot be in ``failed``."""
        if out.shape[0] != request.mm.placeholders.numel():
            failed[id(request)] = (f"its images make {out.shape[0]} image features, its prompt holds "
                               f"{request.mm.placeholders.numel()} image tokens")
            return
        request.mm.embeds = out


def _wants_encoder(images: Images | None, start: int, count: int) -> bool:
    """Whether a chunk ``start .. start + count`` of a request needs its encoder output, not yet computed."""
    if images is None or images.embeds is not None or not images.placeholders.numel():
        return False
    return bool(((images.placeholders >= start) & (images.placeholders < start + count)).any())


def _rope_rows(images: Images | None, start: int, count: int, device: torch.device) -> torch.Tensor:
    """``(count, 3)`` rope positions of a request's tokens ``start .. start + count``."""
    if images is None or images.rope is None:
        return torch.arange(start, start + count, device=device)[:, None].expand(count, 3)
    prompt = images.rope.shape[0]
    if start + count <= prompt:
        return images.rope[start:start + count]
    after = torch.arange(max(start, prompt), start + count, device=device)[:, None].expand(-1, 3) + images.delta
    return torch.cat([images.rope[start:prompt], after]) if start < prompt else after
