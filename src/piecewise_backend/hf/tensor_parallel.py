"""Serve a model transformers loaded tensor-parallel (``from_pretrained(path, tp_plan="auto")``).

transformers shards the weights as DTensors and wraps each planned module's forward in DTensor
redistributions. Dynamo cannot propagate DTensor sharding with the step's unbacked token count
(``aten.embedding``'s strategy guards on it), so :func:`localize` turns every DTensor parameter into
this rank's plain shard and gives each planned module a forward of plain ops and explicit functional
collectives (``_c10d_functional.all_reduce`` / ``all_gather_into_tensor``), which the splitter keeps
inside the pieces and the graphs record and replay (NCCL in CUDA graphs; gloo on the simulator):

* ``colwise`` linear: the local matmul, output sharded by heads or features (no collective);
* ``rowwise`` linear: the local partial matmul, an all-reduce, then the bias once;
* ``colwise_gather_output`` / ``colwise_rep`` (the vocab-parallel ``lm_head``): an all-gather of the features;
* ``embedding_rowwise`` (vocab-parallel embedding): ids outside this rank's rows look up zeros, an all-reduce;
* ``moe_tp_experts``: every expert's local slice of the intermediate features, an all-reduce of the sum;
* ``packed_colwise`` / ``rowwise`` expert parameters, ``replicated_with_grad_allreduce`` norms: parameters only.

Any other plan entry is refused, naming it. :func:`check_engine_agreement` makes every rank agree on
the engine's arguments at construction (ranks built differently would capture different graphs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .transformers_lib import transformers_module

#: plan styles :func:`localize` serves; each module style maps to its forward below
MODULE_STYLES = frozenset({
    "colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise", "moe_tp_experts",
    "replicated_with_grad_allreduce", "replicate",
})
PARAM_STYLES = frozenset({"colwise", "rowwise", "packed_colwise", "replicate"})


def is_tensor_parallel(model: torch.nn.Module) -> bool:
    """True if ``model`` holds DTensor parameters (transformers loaded it with ``tp_plan``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _tp_group(model: torch.nn.Module) -> Any:
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        from torch.distributed.tensor import DTensor

        mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
    names = mesh.mesh_dim_names or ()
    return mesh.get_group("tp") if "tp" in names else mesh.get_group()


def _style(plan: Mapping[str, str], name: str) -> str | None:
    for pattern, style in plan.items():  # a ``*`` stands for one name part (a layer index)
        if re.fullmatch(".".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")), name):
            return style
    return None


def check_heads(config: Any, world: int) -> None:
    """Refuse a world size the attention heads cannot be split by (ValueError naming the numbers)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and heads % world:
        raise ValueError(
            f"tensor parallel over {world} ranks: the model's {heads} attention heads do not divide by {world}; "
            f"use a world size that divides {heads}"
        )
    if isinstance(kv_heads, int) and kv_heads % world and world % kv_heads:
        raise ValueError(
            f"tensor parallel over {world} ranks: the model's {kv_heads} KV heads neither divide by {world} nor "
            f"divide it (fewer KV heads than ranks are replicated, each rank keeping the one its query heads use); "
            f"use a world size that divides {kv_heads} or a multiple of it that divides {heads}"
        )


def replicated_kv_plan(config: Any, world: int) -> dict[str, str]:
    """The ``tp_plan`` overrides that keep K/V projections whole when the ranks outnumber the KV heads
    (:func:`localize` then keeps each rank's one KV head); empty when the KV heads divide by ``world``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if kv_heads >= world:
        return {}
    plan = getattr(type(text), "base_model_tp_plan", None) or {}
    return {f"model.{k}": "replicate" for k, style in plan.items()
            if style == "colwise" and k.rsplit(".", 1)[-1] in _KV_PROJECTIONS}


_KV_PROJECTIONS = ("k_proj", "v_proj")


def tp_load_kwargs(plan: str | Mapping[str, str], base: Any = None) -> dict[str, Any]:
    """The ``from_pretrained`` keyword that loads with ``plan``: ``distributed_config=DistributedConfig(tp_plan=plan)``
    (``base`` with its ``tp_plan`` replaced, when given) where transformers takes it (5.24 deprecates a
    ``tp_plan=`` keyword, warning on every rank), else ``tp_plan=plan``."""
    if base is not None:
        return {"distributed_config": dataclasses.replace(base, tp_plan=plan)}
    config_class = distributed_config_class()
    if config_class is None:
        return {"tp_plan": plan}
    return {"distributed_config": config_class(tp_plan=plan)}


def shards(distributed_config: Any) -> bool:
    """Whether a ``DistributedConfig`` given to ``from_pretrained`` loads tensor-parallel (a ``tp_plan``, or
    ``tp_size`` above 1: the model's own plan)."""
    if distributed_config is None:
        return False
    return getattr(distributed_config, "tp_plan", None) is not None or (getattr(distributed_config, "tp_size", None) or 1) > 1


def distributed_config_class() -> Any:
    """transformers' ``DistributedConfig`` where it takes a ``tp_plan`` and ``from_pretrained`` takes it as
    ``distributed_config`` (transformers >= 5.24); None for older versions (a ``DistributedConfig`` without
    ``tp_plan`` only switched expert parallelism on)."""
    transformers = transformers_module()
    config_class = getattr(transformers, "DistributedConfig", None)
    if config_class is None:
        return None
    try:
        takes_plan = "tp_plan" in inspect.signature(config_class).parameters
    except (TypeError, ValueError):
        return None
    load = transformers.PreTrainedModel.from_pretrained
    # from_pretrained pops it from **kwargs: its documentation names it where the signature does not
    takes_config = "distributed_config" in inspect.signature(load).parameters or "distributed_config" in (load.__doc__ or "")
    return config_class if takes_plan and takes_config else None


#: layer kinds of state layers (the state cache's): their mixers are not sharded by this module yet
_STATE_KINDS = frozenset({"linear_attention", "conv", "mamba", "hybrid"})


def composition_refusal(model: torch.nn.Module, *, lazy_capture: bool) -> str | None:
    """Why a tensor-parallel ``model`` cannot be served with these engine features, or None."""
    text = model.config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ()) | set(getattr(text, "layers_block_type", None) or ())
    state = sorted(kinds & _STATE_KINDS)
    if state:
        return (f"tensor parallel: {type(model).__name__} has state layers ({state}); the state cache is not split "
                "across ranks yet: serve it on one rank")
    if lazy_capture:
        return ("tensor parallel: lazy_capture=True is refused: capture_idle captures within a time budget, so ranks "
                "could capture different graphs (their collectives would pair wrongly); capture() every graph up front")
    return None


def localize(model: torch.nn.Module) -> torch.nn.Module:
    """Turn a model loaded with ``tp_plan`` into plain local shards with explicit collectives (in place).

    Raises ``ValueError`` naming a plan entry it does not serve, before anything is changed.
    """
    from torch.distributed.tensor import DTensor

    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"{type(model).__name__} holds DTensor parameters but no _tp_plan: load it with "
                         "from_pretrained(path, tp_plan='auto')")
    group = _tp_group(model)
    world = dist.get_world_size(group)
    check_heads(model.config, world)
    params = dict(model.named_parameters())
    forwards: list[tuple[torch.nn.Module, str]] = []
    for name, module in model.named_modules():
        style = _style(plan, name)
        if style is None or name in params:
            continue
        if style not in MODULE_STYLES:
            raise ValueError(f"tensor parallel: plan entry {name!r}: {style!r} is not served (served: {sorted(MODULE_STYLES)})")
        if style in ("rowwise", "colwise_gather_output", "colwise_rep") and not isinstance(module, torch.nn.Linear):
            raise ValueError(f"tensor parallel: plan entry {name!r}: {style!r} on a {type(module).__name__} is not "
                             "served (a torch.nn.Linear only)")
        if style in ("colwise_gather_output", "colwise_rep", "embedding_rowwise"):
            rows = module.weight.shape[0]
            if rows % world:
                raise ValueError(f"tensor parallel: {name} has {rows} rows, which do not divide by {world} ranks")
        forwards.append((module, style))
    for name, p in params.items():
        style = _style(plan, name)
        if isinstance(p, DTensor) and style is not None and style not in PARAM_STYLES:
            raise ValueError(f"tensor parallel: plan entry {name!r}: {style!r} is not served (served: {sorted(PARAM_STYLES)})")
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if isinstance(p, DTensor):
                module._parameters[pname] = torch.nn.Parameter(p.to_local().contiguous(), requires_grad=False)
        for bname, b in list(module._buffers.items()):
            if isinstance(b, DTensor):
                module._buffers[bname] = b.to_local()
    name, rank = group.group_name, dist.get_rank(group)
    _keep_own_kv_head(model, plan, rank, world)
    for module, style in forwards:
        module.__dict__.pop("forward", None)  # transformers' DTensor wrapper: back to the class forward
        make = _FORWARDS.get(style)
        if make is not None:
            module.forward = make(module, name, rank)
    model.pb_tp_size = world
    return model


def _keep_own_kv_head(model: torch.nn.Module, plan: Mapping[str, str], rank: int, world: int) -> None:
    """With fewer KV heads than ranks (K/V projections loaded whole): keep the KV head this rank's query heads use."""
    text = model.config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if kv_heads >= world:
        return
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    mine = rank * kv_heads // world  # query heads [rank * q, (rank + 1) * q) all meet this KV head
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _KV_PROJECTIONS and _style(plan, name) == "replicate":
            rows = slice(mine * head_dim, (mine + 1) * head_dim)
            module.weight = torch.nn.Parameter(module.weight.detach()[rows].clone(), requires_grad=False)
            if getattr(module, "bias", None) is not None:
                module.bias = torch.nn.Parameter(module.bias.detach()[rows].clone(), requires_grad=False)
            module.out_features = head_dim


def _all_reduce(t: torch.Tensor, group: str) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))


def _rowwise(module: torch.nn.Module, group: str, rank: int) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        out = _all_reduce(F.linear(x, module.weight), group)
        return out if module.bias is None else out + module.bias
    return forward


def _gather_output(module: torch.nn.Module, group: str, rank: int) -> Callable[..., torch.Tensor]:
    from torch.distributed import _functional_collectives as funcol

    def forward(x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, module.weight, module.bias)
        gathered = funcol.wait_tensor(funcol.all_gather_tensor(local.movedim(-1, 0).contiguous(), 0, group))
        return gathered.movedim(0, -1)
    return forward


def _vocab_embedding(module: torch.nn.Module, group: str, rank: int) -> Callable[..., torch.Tensor]:
    rows = module.weight.shape[0]
    start = rank * rows
    cls_forward = type(module).forward  # the class's own lookup (a scaled embedding keeps its scale)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        local = ids - start
        mine = (local >= 0) & (local < rows)
        out = cls_forward(module, torch.where(mine, local, 0))
        return _all_reduce(out * mine.unsqueeze(-1).to(out.dtype), group)
    return forward


def _experts(module: torch.nn.Module, group: str, rank: int) -> Callable[..., torch.Tensor]:
    cls_forward = type(module).forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        return _all_reduce(cls_forward(module, *args, **kwargs), group)
    return forward


_FORWARDS: dict[str, Callable[..., Callable[..., torch.Tensor]]] = {
    "rowwise": _rowwise,
    "colwise_gather_output": _gather_output,
    "colwise_rep": _gather_output,
    "embedding_rowwise": _vocab_embedding,
    "moe_tp_experts": _experts,
}


def check_engine_agreement(args: Mapping[str, Any]) -> None:
    """In a process group, raise on every rank when the ranks were given different engine arguments.

    Each rank all-gathers a digest of every argument's ``repr`` (one small collective); on a mismatch the
    values are gathered and the first differing argument is named with each rank's value.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    shown = {k: re.sub(r" at 0x[0-9a-f]+", "", repr(v)) for k, v in args.items()}  # a function's repr: no address
    digest = hashlib.sha256(repr(sorted(shown.items())).encode()).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, shown)
    for key in args:
        seen = [v.get(key) for v in values]
        if len(set(seen)) > 1:
            per_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
            raise ValueError(
                f"tensor parallel: the ranks were given different engine arguments: {key} ({per_rank}); every rank "
                "must build its engine with the same arguments"
            )
    raise ValueError("tensor parallel: the ranks were given different engine arguments")
