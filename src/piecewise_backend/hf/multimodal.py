"""Image-text-to-text models on the engine: a request's images, their encoder output, M-RoPE positions.

A request's ``mm_inputs`` are the model's own multimodal keyword inputs for its prompt (what its
processor returns for it: ``pixel_values``, ``image_grid_thw``, ``image_sizes``, ...). :class:`Admit`
checks them against the prompt's image tokens and keeps a copy (:class:`Images`). The step that
prefills a request's first image token runs the encoder (the model's ``get_image_features``: vision
tower and projector, eagerly) and keeps its output until every image token is prefilled; then
:class:`ImageTokensFirst`, the runner's layout around the model, puts those rows in place of the
image tokens' embeddings. Its step buffers are module buffers written in place before each step
(the graphs read them where they are), so the runner's own inputs are the text model's.

M-RoPE models (qwen2-vl and relatives, a ``get_rope_index``) get 3-D rope positions: per request,
the model's ``get_rope_index`` over its prompt, and past the prompt the sequence position plus the
request's rope delta (the model keeps one delta per batch; here each request has its own). The KV
cache keeps 1-D sequence positions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..inputs import mark_persistent
from ..config import CompilationConfig
from ..modes import CUDAGraphMode
from ..serve.arguments import EngineArgs
from ..serve.loop import Executed
from ..serve.model_runner import Decode, ModelRunner, own_code
from ..serve.scheduler import StepPlan
from .adaptation import TokensFirst
from .encoder_graphs import DEFAULT_BUDGETS, GRID_TOWERS, EncoderGraphs, GridEncoderGraphs, fixed_image_shape
from .modality import image_token, text_model

#: Keyword inputs of video frames: not served (refused at ``add_request``).
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")

#: Why families the embedding swap cannot serve exactly are refused, by model type.
REFUSED = {
    "gemma3": "gemma3 attends bidirectionally within each image's tokens (token_type_ids): the paged attention is causal",
    "paligemma": "paligemma attends bidirectionally over the whole prompt prefix (a prefix-LM): the paged attention is causal",
    "mllama": "mllama reads its images through cross-attention layers, not image tokens in the prompt",
    "shieldgemma2": ("shieldgemma2 is gemma3 (Gemma3ForConditionalGeneration): it attends bidirectionally within each "
                     "image's tokens (token_type_ids): the paged attention is causal"),
    "ovis2": ("ovis2's forward also puts visual-indicator embeddings (from its visual embedding table) at its "
              "indicator tokens, besides the image features at the image tokens"),
}
#: Inputs of the text model's forward that carry image content besides the image tokens' rows: a model whose
#: text model takes one is refused with the reason (the engine gives the text model input embeddings and
#: positions only).
TEXT_IMAGE_INPUTS = {
    "deepstack_visual_embeds": ("its text model adds features of several vision layers to the hidden states of "
                                "its first layers at the image tokens (deepstack), besides the input embeddings"),
}
#: Families whose image-token count is not the grid's patches / spatial_merge_size**2, why: counted when the
#: encoder runs (a prompt with another count is refused then).
GRID_COUNT_BY_ENCODER = {
    "hunyuan_vl": "a row separator per merged row and begin / end rows per image",
    "hy_v4_vl": "a row separator per merged row and begin / end rows per image",
}
#: Families whose ``pixel_values`` carry a leading per-prompt dim, ``(1, images, C, H, W)`` (their processor's
#: output for one prompt).
BATCHED_PIXELS = frozenset({"idefics2", "idefics3", "smolvlm"})


def text_image_input(model: torch.nn.Module) -> str | None:
    """The first :data:`TEXT_IMAGE_INPUTS` name the forward of ``model``'s text model takes (None: none)."""
    inner = getattr(model, "model", model)
    found = (getattr(owner, name, None) for owner in (inner, model) for name in ("language_model", "text_model"))
    text = next((m for m in found if isinstance(m, torch.nn.Module)), None)  # granite_docling: text_model
    if text is None:
        return None
    taken = inspect.signature(text.forward).parameters
    return next((name for name in TEXT_IMAGE_INPUTS if name in taken), None)


def deepstack_layers(model: torch.nn.Module) -> int:
    """How many text layers get vision features added at the image tokens (qwen3-vl's deepstack), where the
    engine serves it: a text model with ``_deepstack_process`` and ``deepstack_visual_indexes`` (0: none)."""
    text = text_model(model)
    indexes = getattr(getattr(model.config, "vision_config", None), "deepstack_visual_indexes", None)
    if text is model or not callable(getattr(text, "_deepstack_process", None)) or not indexes:
        return 0
    return len(indexes)


def refusal(model: torch.nn.Module, config: CompilationConfig, args: EngineArgs, *, tensor_parallel: bool) -> str | None:
    """Why the engine cannot serve the image-text-to-text ``model`` under ``config`` and ``args`` (None: it can)."""
    name = type(model).__name__
    kind = getattr(model.config, "model_type", "")
    if kind in REFUSED:
        return f"{name}: {REFUSED[kind]}"
    extra = text_image_input(model)
    if extra is not None and not (extra == "deepstack_visual_embeds" and deepstack_layers(model)):
        return f"{name}: {TEXT_IMAGE_INPUTS[extra]} (its text model's forward takes {extra})"
    if image_token(model) is None:
        return f"{name}: its config names no image token (image_token_id / image_token_index)"
    if config.use_ubatching:
        return (f"{name}: micro-batching (use_ubatching=True) is not served for image-text-to-text models (each half "
                "would read the image rows of the whole step)")
    if tensor_parallel:
        return f"{name}: tensor parallel is not served for image-text-to-text models yet (the ranks' mm_inputs agreement)"
    return None


def layout(adapted: TokensFirst, config: CompilationConfig, args: EngineArgs) -> ImageTokensFirst:
    """The runner's layout of an adapted image-text-to-text model: image-token buffers as many rows as a step's
    tokens can be (``max_num_batched_tokens``, else the largest capture size, else ``max_model_len``)."""
    rows = max(args.max_num_batched_tokens or 0, max(config.sizes, default=0), args.max_num_reqs) or args.max_model_len
    model = adapted.model
    hidden = model.get_input_embeddings().weight.shape[-1]
    mrope = callable(getattr(getattr(model, "model", model), "get_rope_index", None))
    return own_code(ImageTokensFirst)(adapted, rows=rows, hidden=hidden, mrope=mrope, deepstack=deepstack_layers(model))


@dataclasses.dataclass
class Images:
    """What a request keeps of its ``mm_inputs``: copies on the model's device, the prompt positions
    of its image tokens, its M-RoPE positions (``(prompt, 3)``; None: 1-D rope) and delta, a digest
    of the images' content, and the encoder output while image tokens are left to prefill."""

    inputs: dict[str, torch.Tensor]
    placeholders: torch.Tensor  # (image tokens,) long, ascending prompt positions
    rope: torch.Tensor | None = None
    delta: int = 0
    digest: bytes = b""
    embeds: torch.Tensor | None = None  # (image tokens, hidden): the encoder's output, dropped once prefilled

    @property
    def last(self) -> int:
        """The position after the last image token (the encoder output is needed before it)."""
        return int(self.placeholders[-1]) + 1 if self.placeholders.numel() else 0


def digest(inputs: Mapping[str, torch.Tensor]) -> bytes:
    """A content hash of ``inputs`` (names, dtypes, shapes and bytes): requests with other images never share
    cached prompt blocks."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(inputs):
        t = inputs[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


class Admit:
    """``(prompt ids, mm_inputs, where) -> Images | None`` for one model: the engine's
    :attr:`~piecewise_backend.serve.loop.ServingLoop.multimodal` (refusals name ``where``)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.image_token = image_token(model)
        forward = inspect.signature(model.forward).parameters
        #: the keyword inputs the model's forward takes besides text (what mm_inputs may hold)
        self.accepted = frozenset(n for n in forward if n not in ("input_ids", "attention_mask", "position_ids",
                                                                  "inputs_embeds", "labels", "use_cache", "cache",
                                                                  "past_key_values", "cache_position", "kwargs",
                                                                  "logits_to_keep", "return_dict"))
        self.vision = model.config.vision_config
        self.merge = getattr(self.vision, "spatial_merge_size", None)
        inner = getattr(model, "model", model)
        self.rope_index = getattr(inner, "get_rope_index", None)

    def __call__(self, prompt: list[int], mm_inputs: Any, where: str) -> Images | None:
        ids = torch.tensor(prompt, dtype=torch.long)
        places = (ids == self.image_token).nonzero().flatten()
        if mm_inputs is None:
            if places.numel():
                raise ValueError(f"{where}: the prompt holds {places.numel()} image tokens (id {self.image_token}) "
                                 "but no mm_inputs give their images")
            return self._text(len(prompt))
        inputs = self._copy(mm_inputs, where)
        if not places.numel():
            raise ValueError(f"{where}: mm_inputs given, but the prompt holds no image token (id {self.image_token})")
        expected = self.image_tokens(inputs, where)
        if expected is not None and expected != places.numel():
            raise ValueError(f"{where}: the images in mm_inputs make {expected} image tokens, the prompt holds "
                             f"{places.numel()} (id {self.image_token}): one placeholder token per image feature")
        images = Images(inputs, places.to(self.device), digest=digest(inputs))
        if self.rope_index is not None:
            self._rope(images, ids, where)
        return images

    def _text(self, length: int) -> Images | None:
        """A text-only request: None, or on an M-RoPE model its (equal) 3-D positions."""
        if self.rope_index is None:
            return None
        rope = torch.arange(length, device=self.device)[:, None].expand(length, 3).contiguous()
        return Images({}, torch.zeros(0, dtype=torch.long, device=self.device), rope=rope)

    def _copy(self, mm_inputs: Any, where: str) -> dict[str, torch.Tensor]:
        """``mm_inputs`` copied to the model's device (floating inputs in its dtype, as ``generate`` casts
        pixel values), after the checks of their keys and types."""
        if not isinstance(mm_inputs, Mapping) or not mm_inputs:
            raise ValueError(f"{where}: mm_inputs must be a non-empty dict of the model's multimodal keyword inputs "
                             f"(e.g. pixel_values), got {type(mm_inputs).__name__}")
        video = sorted(k for k in mm_inputs if k in VIDEO_KEYS)
        if video:
            raise ValueError(f"{where}: video inputs {video} are not served (images only)")
        unknown = sorted(str(k) for k in mm_inputs if k not in self.accepted)
        if unknown:
            raise ValueError(f"{where}: mm_inputs {unknown} are not keyword inputs of {type(self.model).__name__}'s "
                             f"forward; it takes {sorted(self.accepted)}")
        if "pixel_values" not in mm_inputs:
            raise ValueError(f"{where}: mm_inputs has no pixel_values")
        out = {}
        for name, value in mm_inputs.items():
            if not isinstance(value, torch.Tensor):
                try:
                    value = torch.as_tensor(value)
                except Exception as e:
                    raise ValueError(f"{where}: mm_inputs[{name!r}] must be a tensor, got {type(value).__name__}") from e
            dtype = self.dtype if value.is_floating_point() else value.dtype
            out[name] = value.detach().to(device=self.device, dtype=dtype, copy=True)
        return out

    def image_tokens(self, inputs: Mapping[str, torch.Tensor], where: str) -> int | None:
        """How many image tokens ``inputs`` make (None where only the encoder can tell: checked when it runs);
        pixel values of the wrong shape refused."""
        pixels = inputs["pixel_values"]
        grid = inputs.get("image_grid_thw")
        if grid is not None and self.merge:  # patches flattened: (sum of t*h*w, channels * patch volume)
            if grid.dim() != 2 or grid.shape[1] != 3:
                raise ValueError(f"{where}: image_grid_thw must be (images, 3), got shape {tuple(grid.shape)}")
            patches = int(grid.prod(-1).sum())
            if pixels.dim() < 2 or pixels.shape[0] != patches:  # (patches, C, p, p): paddleocr_vl, kimi_k25
                raise ValueError(f"{where}: pixel_values of shape {tuple(pixels.shape)} do not match image_grid_thw "
                                 f"{grid.tolist()}: it needs ({patches}, patch features)")
            return None if self.model.config.model_type in GRID_COUNT_BY_ENCODER else patches // self.merge ** 2
        size, patch = getattr(self.vision, "image_size", None), getattr(self.vision, "patch_size", None)
        channels = getattr(self.vision, "num_channels", 3)
        if "image_sizes" in inputs or not isinstance(size, int) or not isinstance(patch, int):
            return None
        if self.model.config.model_type in BATCHED_PIXELS and pixels.dim() == 5 and pixels.shape[0] == 1:
            pixels = pixels[0]
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (channels, size, size):
            raise ValueError(f"{where}: pixel_values must be (images, {channels}, {size}, {size}), got "
                             f"{tuple(pixels.shape)}")
        strategy = getattr(self.model.config, "vision_feature_select_strategy", None)
        if type(self.model).__name__ != "LlavaForConditionalGeneration" or strategy not in ("default", "full"):
            return None
        per_image = (size // patch) ** 2 + (strategy == "full")
        return pixels.shape[0] * per_image

    def _rope(self, images: Images, ids: torch.Tensor, where: str) -> None:
        """The M-RoPE positions of the prompt and its delta, as the model computes them."""
        wanted = inspect.signature(self.rope_index).parameters
        given = {k: v for k, v in images.inputs.items() if k in wanted}
        if "mm_token_type_ids" in wanted and "mm_token_type_ids" not in given:
            given["mm_token_type_ids"] = (ids == self.image_token).int()[None].to(self.device)
        try:
            rope, delta = self.rope_index(ids[None].to(self.device), **given)
        except Exception as e:
            raise ValueError(f"{where}: the model's get_rope_index fails on these mm_inputs "
                             f"({type(e).__name__}: {e})") from e
        images.rope = rope[:, 0].t().contiguous()  # (prompt, 3)
        images.delta = int(delta.flatten()[0])


def encoder_graphs(model: torch.nn.Module, config: CompilationConfig, token_budgets: Sequence[int] | None,
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


class ImageTokensFirst(TokensFirst):
    """:class:`~.adaptation.TokensFirst` of an image-text-to-text model: the text model on input embeddings,
    image tokens' rows from :attr:`mm_embeds` where :attr:`mm_mask` says so, rope positions from
    :attr:`rope_positions` on an M-RoPE model (module buffers, written by :meth:`stage` before a step)."""

    def __init__(self, base: TokensFirst, *, rows: int, hidden: int, mrope: bool, deepstack: int = 0):
        super().__init__(base.model, base.kv_shape, base.host_breaks, base.state_specs, base.indexer_dim,
                         base.call_sites)
        param = next(base.model.parameters())
        self.embed = base.model.get_input_embeddings()
        self.rows, self.hidden = rows, hidden
        #: text layers that add vision features at the image tokens (deepstack): their rows sit beside the
        #: embeddings' in :attr:`mm_embeds`, ``hidden`` columns each
        self.deepstack = deepstack
        if deepstack:
            self.text = text_model(base.model)
            self.text._deepstack_process = types.MethodType(_deepstack_rows, self.text)  # see _deepstack_rows
        self.register_buffer("mm_embeds", torch.zeros(rows, hidden * (1 + deepstack), dtype=param.dtype,
                                                      device=param.device), persistent=False)
        self.register_buffer("mm_mask", torch.zeros(rows, dtype=torch.bool, device=param.device), persistent=False)
        self.mrope = mrope
        self.register_buffer("rope_positions", torch.zeros(rows, 3, dtype=torch.long, device=param.device),
                             persistent=False)
        mark_persistent(self.mm_embeds, self.mm_mask, self.rope_positions)
        self._staged: torch.Tensor | None = None  # rows of mm_mask set for this step

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        torch._check(input_ids.shape[0] >= 1)
        if self.call_sites is not None:
            self.call_sites.start()
        n, h = input_ids.shape[0], self.hidden
        mask = self.mm_mask[:n]
        embeds = torch.where(mask[:, None], self.mm_embeds[:n, :h], self.embed(input_ids))
        positions = self.rope_positions[:n].t()[:, None] if self.mrope else position_ids[None]
        if not self.deepstack:
            return self.model(inputs_embeds=embeds[None], position_ids=positions, use_cache=False).logits[0]
        deep = [self.mm_embeds[:n, h * (i + 1):h * (i + 2)] for i in range(self.deepstack)]
        out = self.text(inputs_embeds=embeds[None], position_ids=positions, use_cache=False,
                        visual_pos_masks=mask[None], deepstack_visual_embeds=deep)
        return self.model.get_output_embeddings()(out.last_hidden_state)[0]

    def restore(self) -> None:
        """Undo what this layout changed in the model (the deepstack step): the engine failed to build on it."""
        if self.deepstack and "_deepstack_process" in vars(self.text):
            del self.text._deepstack_process

    def stage(self, rows: torch.Tensor | None, embeds: torch.Tensor | None, rope: torch.Tensor | None) -> None:
        """Before a step: ``embeds`` in place of the embeddings of step tokens ``rows``, ``rope`` (``(tokens, 3)``)
        the step's rope positions. :meth:`unstage` after it."""
        if rows is not None and rows.numel():
            self.mm_embeds.index_copy_(0, rows, embeds.to(self.mm_embeds.dtype))
            self.mm_mask.index_fill_(0, rows, True)
            self._staged = rows
        if rope is not None:
            self.rope_positions[:rope.shape[0]].copy_(rope)

    def unstage(self) -> None:
        """After a step: no token's embedding replaced."""
        if self._staged is not None:
            self.mm_mask.index_fill_(0, self._staged, False)
            self._staged = None


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


def _deepstack_rows(self: Any, hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor,
                    visual_embeds: torch.Tensor) -> torch.Tensor:
    """The text model's deepstack step with ``visual_embeds`` one row per token (the step's rows; only image
    tokens' are read): added where ``visual_pos_masks`` holds, without the boolean indexing (a host read)."""
    add = visual_embeds.to(hidden_states.dtype)[None]
    return torch.where(visual_pos_masks[..., None], hidden_states + add, hidden_states)


def _rope_rows(images: Images | None, start: int, count: int, device: torch.device) -> torch.Tensor:
    """``(count, 3)`` rope positions of a request's tokens ``start .. start + count``."""
    if images is None or images.rope is None:
        return torch.arange(start, start + count, device=device)[:, None].expand(count, 3)
    prompt = images.rope.shape[0]
    if start + count <= prompt:
        return images.rope[start:start + count]
    after = torch.arange(max(start, prompt), start + count, device=device)[:, None].expand(-1, 3) + images.delta
    return torch.cat([images.rope[start:prompt], after]) if start < prompt else after


def split_inputs(batch: Mapping[str, Any], model: torch.nn.Module) -> list[dict[str, torch.Tensor] | None]:
    """One ``mm_inputs`` dict (None: no image) per prompt of a processor's batched output for ``model``.

    ``batch`` holds ``input_ids`` (prompts, tokens) and the images of every prompt in prompt order:
    per-image inputs (``pixel_values`` of every image, or of every patch with ``image_grid_thw``;
    ``image_sizes``, ...) are cut at each prompt's images; inputs with one row per prompt
    (``pixel_values`` of shape (prompts, images, C, H, W)) at its row. Without a grid, a prompt's
    image count is its image tokens over the tokens per image (every image the same size).
    """
    ids = batch["input_ids"]
    token = image_token(model)
    tokens = (torch.as_tensor(ids) == token).sum(-1).tolist()
    prompts = len(tokens)
    pixels = batch["pixel_values"]
    rest = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids",
                                                         "token_type_ids")}
    grid = batch.get("image_grid_thw")
    if grid is not None:
        merge = model.config.vision_config.spatial_merge_size
        per_image = (grid.prod(-1) // merge ** 2).tolist()
        patches = grid.prod(-1).tolist()
    elif pixels.dim() == 5 and pixels.shape[0] == prompts:  # one row per prompt
        return [({k: v[i] for k, v in rest.items()} if tokens[i] else None) for i in range(prompts)]
    else:
        images = pixels.shape[0]
        if images == 0 or sum(tokens) % images:
            raise ValueError(f"split_inputs: {sum(tokens)} image tokens over {images} images: not one size per image")
        per_image = [sum(tokens) // images] * images
        patches = [1] * images
    out: list[dict[str, torch.Tensor] | None] = []
    image = patch = 0
    for i, n in enumerate(tokens):
        first_image, first_patch, have = image, patch, 0
        while have < n and image < len(per_image):
            have, patch, image = have + per_image[image], patch + patches[image], image + 1
        if have != n:
            raise ValueError(f"split_inputs: prompt {i} holds {n} image tokens; its images make {have}")
        if not n:
            out.append(None)
            continue
        out.append({k: v[first_patch:patch] if k == "pixel_values" else v[first_image:image] for k, v in rest.items()})
    return out
