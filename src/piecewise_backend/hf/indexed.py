"""Route HF's DeepSeek-V3.2-style sparse attention (``indexed_attention`` layers) onto ``pb_kv``'s indexed ops.

transformers' DSA attention asks its lightning indexer for each query's top-k key positions (the
indexer scores the keys it keeps in the HF cache), then hands them to the attention interface as
``indices=``. Served with ``use_cache=False`` the indexer would see the step's tokens only; here:

* :func:`route` gives each indexer a forward that computes its queries, keys and head weights as
  the family does (:data:`INDEXERS`: which part of the head is rotated, and how), then calls
  ``pb_kv::indexer_topk``, which keeps the keys in the paged cache beside K/V and selects over the
  request's cached prefix; ``pb_paged``'s attention runs ``pb_kv::indexed_attention`` on the
  ``indices`` it is given. Before :func:`~piecewise_backend.hf.adapt` gives the indexer its cache
  layer (its :class:`~.adapted_state.AdaptedAttention`: in the adapter's probe) the forward selects among the call's own tokens,
  causally, as HF's does without a cache.
* The attention module slices the mask HF would build (``attention_mask[:, 0]``); ``pb_paged``
  builds none, so :func:`route` gives it the causal mask of the call's tokens (used only by the probe).

:func:`refusal` names what cannot be served: an indexer of another kind (block-compressed, pooled).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..kv import indexed as _ops  # noqa: F401  (registers pb_kv::indexer_topk and pb_kv::indexed_attention)
from .adapted_state import ADAPTED_ATTR
from .patching import Changes, RefusesNothing, recorded

if TYPE_CHECKING:
    from .probe_result import ProbeResult

_MASKED = "pb_indexed_mask"  # on an attention module: its causal-mask hook is installed (a second adapt adds none)


@dataclasses.dataclass(frozen=True)
class IndexerKind:
    """How one family's indexer lays out its heads: rotary part ``first`` (or last) of each head,
    ``interleaved`` RoPE (pairs) or half-split, the softmax scale on the scores or on the head weights,
    and whether its key norm runs in the norm's own dtype."""

    rotary_first: bool = True
    interleaved: bool = False
    scale_on_weights: bool = False
    norm_in_own_dtype: bool = False


#: Indexer classes served, by class name (transformers 5.24).
INDEXERS: dict[str, IndexerKind] = {
    "DeepseekV32Indexer": IndexerKind(),
    "AXK2Indexer": IndexerKind(),
    "Dots3NoteTextIndexer": IndexerKind(interleaved=True),
    "GlmMoeDsaIndexer": IndexerKind(interleaved=True),
    "HYV4Indexer": IndexerKind(rotary_first=False, scale_on_weights=True, norm_in_own_dtype=True),
    "HYV4VLIndexer": IndexerKind(rotary_first=False, scale_on_weights=True, norm_in_own_dtype=True),
}


def indexers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(path, module)`` of every module named like an indexer (``...Indexer``), in model order."""
    return [(p, m) for p, m in model.named_modules() if type(m).__name__.endswith("Indexer")]


def refusal(model: torch.nn.Module) -> str | None:
    """Why ``model``'s indexed attention cannot be served, or None (also None: no indexer at all)."""
    found = indexers(model)
    for path, module in found:
        kind = type(module).__name__
        if kind not in INDEXERS:
            return (
                f"{type(model).__name__} selects attended tokens with {kind} at {path}, an indexer the indexed attention "
                f"does not compute: it computes DeepSeek-V3.2's per-token lightning indexer ({sorted(INDEXERS)}), "
                "one indexer key per token in the paged cache; a selection over pooled or compressed key blocks is not built"
            )
    if not found:
        return f"{type(model).__name__} has indexed_attention layers but no indexer module the indexed attention knows"
    return None


#: Layer types whose attention reads keys compressed over groups of tokens (deepseek_v4).
COMPRESSED_LAYER_TYPES = frozenset({"compressed_sparse_attention", "heavily_compressed_attention"})


def layer_types_refusal(model: torch.nn.Module, kinds: list[str]) -> str | None:
    """Why ``model``'s layers of the (otherwise unserved) types ``kinds`` cannot be served, where this module
    knows them (indexed and compressed attention), or None; ``kinds`` loses the types it serves."""
    compressed = sorted(COMPRESSED_LAYER_TYPES & set(kinds))
    if compressed:
        return (
            f"{type(model).__name__} has {compressed} layers: their attention reads keys compressed over groups of "
            "tokens (a second, pooled KV cache with its own compressor state, filled every few tokens), which the "
            "paged cache (one K/V and one indexer key per token) does not hold"
        )
    if "indexed_attention" in kinds:
        why = refusal(model)
        if why:
            return why
        kinds.remove("indexed_attention")
    return None


def index_dim(model: torch.nn.Module) -> int:
    """The indexer key size of ``model`` (0: no indexer); one size for every layer, or ValueError."""
    dims = {m.head_dim for _, m in indexers(model)}
    if len(dims) > 1:
        raise ValueError(f"{type(model).__name__}: indexers of different key sizes {sorted(dims)}; one cache holds one")
    return dims.pop() if dims else 0


def _rotate(module: torch.nn.Module, kind: IndexerKind, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    family = sys.modules[type(module).__module__]
    rope, rest = module.qk_rope_head_dim, module.head_dim - module.qk_rope_head_dim
    sizes = [rope, rest] if kind.rotary_first else [rest, rope]
    q_parts, k_parts = list(torch.split(q, sizes, dim=-1)), list(torch.split(k, sizes, dim=-1))
    at = 0 if kind.rotary_first else 1
    apply = family.apply_rotary_pos_emb_interleave if kind.interleaved else family.apply_rotary_pos_emb
    q_parts[at], k_parts[at] = apply(q_parts[at], k_parts[at], cos, sin, unsqueeze_dim=2)
    return torch.cat(q_parts, dim=-1), torch.cat(k_parts, dim=-1)


def _local_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float, topk: int) -> torch.Tensor:
    """Selection among the call's own tokens (one request, causal): the probe's, as HF's without a cache."""
    tokens = q.shape[0]
    scores = torch.relu(torch.einsum("thd,ld->thl", q.float(), k.float()) * scale)
    index = torch.einsum("th,thl->tl", weights.float(), scores)
    pos = torch.arange(tokens, device=q.device)
    index = index.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return index.topk(min(topk, tokens), dim=-1).indices


def indexer_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings: Any,
    attention_mask: Any = None, position_ids: Any = None, cache: Any = None, **kwargs: Any,
) -> torch.Tensor:
    """The indexer's top-k positions ``(1, tokens, topk)`` for the tokens-first row, over the paged cache."""
    kind = INDEXERS[type(self).__name__]
    batch, tokens, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(batch, tokens, self.n_heads, self.head_dim)
    k = self.wk(hidden_states)
    k = self.k_norm(k.to(self.k_norm.weight.dtype)).to(hidden_states.dtype) if kind.norm_in_own_dtype else self.k_norm(k)
    q, k = _rotate(self, kind, q, k.unsqueeze(2), cos, sin)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
    scale = self.softmax_scale
    if kind.scale_on_weights:
        weights, scale = weights * scale, 1.0
    q, k, weights = q[0], k[0, :, 0], weights[0]
    state = getattr(self, ADAPTED_ATTR, None)  # its cache layer: set by adapt after the probe
    if state is None:  # the probe (no paged cache yet)
        return _local_topk(q, k, weights, scale, self.index_topk)[None]
    out = torch.empty(tokens, self.index_topk, dtype=torch.long, device=q.device)
    torch.ops.pb_kv.indexer_topk(q.contiguous(), k.contiguous(), weights.contiguous(), out, state.kv_layer, float(scale))
    return out[None]


def _causal_mask(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook: the causal mask of the call's tokens where the model built none (``pb_paged``);
    ``attention_mask`` is the attention modules' third argument (after ``hidden_states``, ``position_embeddings``)."""
    positional = len(args) > 2
    if (args[2] if positional else kwargs.get("attention_mask")) is not None:
        return None
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    tokens = hidden.shape[1]
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=hidden.device).tril()[None, None]
    if positional:
        return (*args[:2], causal, *args[3:]), kwargs
    return args, {**kwargs, "attention_mask": causal}


def route(model: torch.nn.Module, changes: Changes | None = None) -> int:
    """Give every indexer :func:`indexer_forward` and its attention module a causal mask (before the
    probe, which runs them); returns the indexer key size (0: none); ``changes``, if given, can undo it."""
    changes = changes if changes is not None else Changes()
    for _, module in indexers(model):
        changes.set(module, "forward", types.MethodType(indexer_forward, module))
    for module in model.modules():
        if hasattr(module, "indexer") and not module.__dict__.get(_MASKED, False):
            changes.hook(module.register_forward_pre_hook(_causal_mask, with_kwargs=True))
            changes.set(module, _MASKED, True)
    return index_dim(model)


class Indexers(RefusesNothing):
    """The mechanism that routes DSA indexers onto ``pb_kv::indexer_topk`` (:data:`INDEXERS`; each indexer's
    cache layer comes with the paged attention's records, after the probe). Its refusal is the adapter's,
    where the layer types name indexed attention (:func:`layer_types_refusal`)."""

    name = "indexers"

    def install(self, model: torch.nn.Module, probed: ProbeResult | None) -> Callable[[], None]:
        return recorded(route, model)


MECHANISM = Indexers()
