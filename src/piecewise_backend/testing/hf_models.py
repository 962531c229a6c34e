"""Seeded tiny random-weight Hugging Face causal LMs of any model type (nothing downloaded): a test fixture,
also importable as ``piecewise_backend.hf.tiny_random_model``, which passes in what the engine serves
(this module imports nothing of :mod:`piecewise_backend.hf`: hf's face loads it on first use)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch

#: Which modules of a model keep state between tokens, as ``(layer, module)`` (``hf.mixers.candidates``).
StateLayers = Callable[[torch.nn.Module], Iterable[tuple[int, torch.nn.Module]]]


#: Sizes of :func:`tiny_random_model`; a config gets only the fields it has (and can set).
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    num_experts_per_tok=2,
)
#: Shrunk only where the model's default config sets them (None or 0 means the feature is off).
TINY_IF_SET = dict(
    # mixture of experts: few small experts (the defaults allocate up to GBs: llama4, qwen3_5_moe, ...)
    num_local_experts=4, num_experts=4, n_routed_experts=4, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, expert_ffn_hidden_size=32, intermediate_size_mlp=128, n_group=2, topk_group=1, first_k_dense_replace=1,
    # multi-head latent attention (deepseek_v2/v3, minicpm3, ...): v's head dim differs from q/k's on purpose
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
    # chunked / sliding attention and per-layer inputs sized to the tiny model
    attention_chunk_size=8, sliding_window=8, rotary_dim=8, num_kv_shared_layers=1, activation_sparsity_pattern=[0.0, 0.0], hidden_size_per_layer_input=16, vocab_size_per_layer_input=256,
    # encoder-decoder style names (d_model, *_attention_heads) that the head count must divide
    d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
    encoder_layers=2, decoder_layers=2,
    # indexed (sparse) attention: a top-k shorter than the prompts, so the selection drops tokens
    index_topk=4, index_n_heads=8, index_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
)
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
_CONSTRAINED = ("num_attention_heads", "num_key_value_heads", "head_dim", "num_experts_per_tok")
#: A tiny model above this many parameters means a size field was not shrunk: refused, not allocated.
MAX_PARAMS = 50_000_000
#: Sizes for types whose fields TINY cannot name generically. Mamba2 mixers: heads * head_dim must be
#: expand * hidden, and transformers 5.17's chunked scan materializes chunk^2 * heads * state floats
#: (8-24 GiB at the defaults of bamba, granitemoehybrid, falcon_h1).
_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_state": 16, "mamba_chunk_size": 16}
#: Qwen4-Exp's QSA indexer (one key head; a budget of whole compressed blocks), sized like TINY.
_QSA = {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8, "indexer_compress_ratio": 4}
#: BLT's sub-configs given whole (see TINY_TYPE_SIZES): TINY's sizes.
_BLT_LOCAL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "head_dim": 16, "max_position_embeddings": 256}
#: lfm2_moe's default config has no ``layer_types`` (its model indexes them) and makes its first two layers
#: dense: a short convolution and an attention layer, the second with experts, as in its checkpoints.
TINY_TYPE_SIZES: dict[str, dict[str, Any]] = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "mamba2": {"num_heads": 8, "n_groups": 2, "state_size": 16, "chunk_size": 16},
    "falcon_h1": {**_MAMBA2, "mamba_d_ssm": 128},
    "bamba": _MAMBA2,
    "granitemoehybrid": _MAMBA2,
    "nemotron_h": {"mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16},
    "longcat_flash": {"num_layers": 1},  # its layer count (2 sublayers each); 5.17 does not derive it from num_hidden_layers
    # attention swapped at module level (hf/attention_swaps.py): at the default 0.02 their tokens barely
    # depend on the context, so dropping ALiBi or RoPE would still pass a check; 0.2 makes both matter
    "bloom": {"initializer_range": 0.2},
    "mpt": {"initializer_range": 0.2},
    "falcon": {"initializer_range": 0.2},
    "gpt_neox_japanese": {"initializer_range": 0.2},
    "xglm": {"init_std": 0.2},
    # QSA's indexer fields default to None, which its indexed_attention layers cannot be built with
    "qwen4_exp": _QSA,
    "qwen4_exp_text": _QSA,
    # dbrx's attention reads attn_config.rope_theta, which DbrxAttentionConfig does not declare (transformers
    # 5.24), and clamps q/k/v to clip_qkv, which fails unset (DBRX sets 8); its experts live in ffn_config
    # (DBRX: 16 experts, top 4)
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 500000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
    # dots1's expert counts default to None; dots.llm1: shared experts and a dense first layer
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1},
    # gpt_neo's layers come from attention_types (global, local alternating) with a local window
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    # prophetnet has no settable num_hidden_layers (its encoder and decoder counts) and its own head-count names
    "prophetnet": {"num_encoder_layers": 2, "num_decoder_layers": 2, "num_encoder_attention_heads": 4,
                   "num_decoder_attention_heads": 4},
    # reformer's LM head needs is_decoder; one local and one LSH layer, as its checkpoints alternate;
    # the axial position shape multiplies to max_position_embeddings, its dims add to hidden_size
    "reformer": {"is_decoder": True, "attn_layers": ["local", "lsh"], "axial_pos_shape": [16, 16],
                 "axial_pos_embds_dim": [32, 32], "attention_head_size": 16, "feed_forward_size": 128,
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8, "num_buckets": 4},
    "xlnet": {"d_inner": 128, "d_head": 16, "n_head": 4},  # d_head is derived once, from the default sizes
    # blt's hash embeddings: 6 byte-group sizes times this vocabulary (500002 by default); its global
    # transformer is as wide as the local encoder's cross_attn_k (2) patch copies, as in BLT's checkpoints
    # (the config derives the projection between them from the two sub-configs it is given: both given whole)
    "blt": {"encoder_hash_byte_group_vocab": 256, "hidden_size_global": 128,
            "encoder_config": {**_BLT_LOCAL, "num_hidden_layers": 1, "hidden_size_global": 128},
            "global_config": {**_BLT_LOCAL, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}},
    # musicgen's causal LM is its decoder over 4 audio codebooks (built from its decoder sub-config)
    "musicgen": {"ffn_dim": 128},
    "musicgen_melody": {"ffn_dim": 128},
    # cohere_compass_text reads rope parameters per layer type; its default config has none
    "cohere_compass_text": {"rope_parameters": {
        kind: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
        for kind in ("full_attention", "sliding_attention")}},
}
#: What :func:`tiny_random_model` scales state layers' weights by (see there).
STATE_GAIN = 8.0
#: The config fields that give a tiny model the layer mix of released checkpoints, for types whose
#: default config has another one: lfm2's default is all attention (LFM2 checkpoints are mostly short
#: convolutions); granitemoehybrid's and bamba's are all Mamba2 and jamba's first attention layer is
#: its fifth (their checkpoints interleave attention); recurrent_gemma's first attention layer is its third. zamba and zamba2 run one shared attention block in
#: each hybrid layer: two hybrid layers keep the sharing their checkpoints have.
TINY_LAYER_MIX: dict[str, dict[str, Any]] = {
    "zamba": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2},
    "zamba2": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2},
    # dory's defaults (8 input and 8 output layers) leave a 2-layer model a negative recurrent section: one input
    # layer, a recurrent section of a sliding and a full layer run twice, one output layer
    "dory": {"num_hidden_layers": 4, "n_input_layers": 1, "n_output_layers": 1, "n_recurrent_layers": 2,
             "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "bamba": {"attn_layer_indices": [1]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "recurrent_gemma": {"num_hidden_layers": 3},  # block_types repeats (recurrent, recurrent, attention)
}
# MLA configs expand K/V to every query head (num_key_value_heads = num_attention_heads) and derive
# head_dim from the rope part.
_MLA = ("kv_lora_rank",)


def _settable(config: Any, name: str) -> bool:
    """``config`` has ``name`` and it is not a read-only property (falcon's ``head_dim``)."""
    try:
        getattr(config, name)
    except Exception:  # absent, or a per-layer attribute that refuses a global read (gemma4)
        return False
    prop = getattr(type(config), name, None)
    if not isinstance(prop, property):
        return True
    if prop.fset is None:
        return False
    try:  # a setter that refuses every value (prophetnet's num_hidden_layers, xlnet's max_position_embeddings)
        prop.fset(copy.copy(config), getattr(config, name))
    except (NotImplementedError, AttributeError, TypeError, ValueError):
        return False
    return True


def _fields(defaults: Any, sizes: dict[str, Any], level: int = 0) -> dict[str, Any]:
    """The fields of TINY/TINY_IF_SET/``sizes`` that ``defaults`` (one config) has and can set.

    ``level`` 1 leaves out TINY_IF_SET, level 2 also the fields some configs constrain (head counts,
    head_dim, experts per token) but sets expert counts, level 3 also leaves sub-configs as they are:
    fewer fields, more configs valid, still tiny by the parameter check.
    """
    wanted = {**TINY, **sizes}
    if level >= 2:
        wanted = {k: v for k, v in wanted.items() if k in sizes or k not in _CONSTRAINED}
    if any(_settable(defaults, k) for k in _MLA) and "num_attention_heads" in wanted:  # K/V expanded to every query head; head_dim derived
        wanted["num_key_value_heads"] = sizes.get("num_key_value_heads", wanted["num_attention_heads"])
        if "head_dim" not in sizes:  # MLA's head_dim is the rope part's (deepseek derives it, longcat reads it)
            wanted["head_dim"] = sizes.get("qk_rope_head_dim", TINY_IF_SET["qk_rope_head_dim"])
    optional = {} if level else {k: v for k, v in TINY_IF_SET.items() if k not in sizes and _settable(defaults, k)
                                 and getattr(defaults, k)}
    if level >= 2:  # expert counts some MoE configs leave None by default (dots1)
        optional = {k: TINY_IF_SET[k] for k in _EXPERT_COUNTS if k not in sizes and _settable(defaults, k)}
    # copied: configs rewrite the dicts and lists they are given (rope_parameters), and the tables are shared
    return copy.deepcopy({k: v for k, v in {**optional, **wanted}.items() if _settable(defaults, k)})


def _shrunk(transformers: Any, defaults: Any, sizes: dict[str, Any], level: int) -> Any:
    """``defaults`` rebuilt with tiny sizes, its sub-configs (text, vision, ...) too."""
    config = transformers.AutoConfig.for_model(defaults.model_type, **_fields(defaults, sizes, level))
    for key in (getattr(config, "sub_configs", {}) or {}) if level < 3 else ():
        if key in sizes:  # given whole (dbrx's attn_config): kept as given
            continue
        sub = getattr(config, key, None)
        if isinstance(sub, transformers.PretrainedConfig):
            setattr(config, key, type(sub)(**_fields(sub, sizes, level)))  # the sub-config's defaults, shrunk
    return config


def _lm_config(transformers: Any, defaults: Any) -> Any:
    """The config the type's causal LM class takes: ``defaults``, or the one of its sub-configs the class is
    built from, where the composite config does not build (transformers maps musicgen to its decoder over the
    audio codebooks, whose config is a sub-config; composites that build, emu3, mllama..., are built as they are)."""
    lm_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(defaults)]
    if isinstance(defaults, lm_class.config_class):
        return defaults
    subs = [getattr(defaults, key, None) for key in getattr(defaults, "sub_configs", {}) or {}]
    return next((sub for sub in subs if isinstance(sub, lm_class.config_class)), defaults)


def _from_config(transformers: Any, arch: str, config: Any, **kwargs: Any) -> torch.nn.Module:
    """``arch``'s causal LM built from ``config``: its own config type, or the sub-config :func:`_lm_config` chose
    (a type AutoModelForCausalLM does not map, so its class is built directly)."""
    if type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        return transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    lm_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[transformers.CONFIG_MAPPING[arch]]
    return lm_class._from_config(config, **kwargs)


def _build(transformers: Any, arch: str, defaults: Any, sizes: dict[str, Any]) -> Any:
    """The first shrunk config (fewest changes last) that builds a model under MAX_PARAMS, on the meta device."""
    errors = []
    for level in range(4):
        try:
            config = _shrunk(transformers, defaults, sizes, level)
            with torch.device("meta"):  # count first: a size field left unshrunk can mean GBs
                params = sum(p.numel() for p in _from_config(transformers, arch, config).parameters())
        except Exception as e:  # the config's own validation: try fewer changes
            errors.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            continue
        if params <= MAX_PARAMS:
            return config
        errors.append(f"{params / 1e6:.0f}M parameters (> {MAX_PARAMS / 1e6:.0f}M: a size field TINY does not know)")
    too_big = [e for e in errors if "parameters" in e]  # the one a user can fix with **sizes, if any
    raise ValueError(f"tiny_random_model cannot build {arch!r} from a shrunk config ({(too_big or errors)[-1]}); pass fitting **sizes")


def _build_mixed(transformers: Any, arch: str, defaults: Any, sizes: dict[str, Any]) -> Any:
    """:func:`_build`, or where no shrunk config builds, one with a layer of each type the full config has.

    Some configs keep their default per-layer list at its full length when the layer count shrinks
    (zamba, zamba2: then their validation refuses the mismatch); given the list, they build. The list
    is tried twice over as well: zamba ties its hybrid layers' shared block, so it needs two of them.
    """
    try:
        return _build(transformers, arch, defaults, sizes)
    except ValueError as e:
        first = e
        kinds = list(dict.fromkeys(_layer_kinds(defaults) or []))
        if not kinds or "layer_types" in sizes or "num_hidden_layers" in sizes:
            raise
    # the declared field, not its alias: an alias is set after __post_init__ derives from it (zamba2's hybrid_layer_ids)
    field = (getattr(defaults, "attribute_map", None) or {}).get("layer_types", "layer_types")
    for layers in (kinds, kinds * 2):
        try:
            return _build(transformers, arch, defaults, {**sizes, "num_hidden_layers": len(layers), field: layers})
        except ValueError:
            continue
    raise first  # the shrunk config's own fault


def _layer_kinds(config: Any) -> list[str] | None:
    """The per-layer types a config declares (``layer_types`` or ``layers_block_type``), or None."""
    try:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
    except ValueError:  # several text configs (musicgen's text encoder and decoder): none to read
        return None
    for field in ("layer_types", "layers_block_type"):
        try:
            kinds = getattr(text, field, None)
        except Exception:  # a per-layer attribute that refuses a global read
            kinds = None
        if isinstance(kinds, (list, tuple)) and kinds and all(isinstance(k, str) for k in kinds):
            return list(kinds)
    return None


def _keep_layer_mix(transformers: Any, arch: str, defaults: Any, config: Any, sizes: dict[str, Any],
                    served: frozenset[str]) -> Any:
    """``config``, rebuilt with one layer of each type when shrinking lost a type the full config has.

    The layers keep the order in which each type first appears (qwen3_next: linear, then full
    attention). A config that derives its types from other fields, or refuses the list, is kept as
    built when the types it loses are ones the engine serves (it then tests less); losing a type the
    engine refuses raises (the model would pass for a reason its checkpoints do not have).
    """
    if "layer_types" in sizes or "num_hidden_layers" in sizes:
        return config
    mix = TINY_LAYER_MIX.get(arch)
    if mix is not None:
        return config if set(mix) & set(sizes) else _build(transformers, arch, defaults, {**mix, **sizes})
    wanted = list(dict.fromkeys(_layer_kinds(defaults) or []))
    tiny = _layer_kinds(config) or []
    if not tiny or not set(wanted) - set(tiny):
        return config
    first = wanted if len(wanted) >= len(tiny) else wanted + [wanted[0]] * (len(tiny) - len(wanted))
    for layers in (first, wanted * 2):  # twice: configs whose last layers reuse an earlier layer's cache (gemma3n)
        try:
            rebuilt = _build(transformers, arch, defaults, {**sizes, "num_hidden_layers": len(layers), "layer_types": layers})
        except ValueError:
            continue
        if set(wanted) <= set(_layer_kinds(rebuilt) or ()):
            return rebuilt
    unserved = sorted(set(wanted) - set(tiny) - served)
    if unserved:  # served without them, the model would pass for a reason its checkpoints do not have
        raise ValueError(
            f"tiny_random_model cannot build {arch!r} with a layer of every type its full config has: shrunk, it "
            f"loses {unserved} layers (a config built with them fails or drops them); pass fitting **sizes"
        )
    return config


def tiny_random_model(
    arch: str, *, seed: int = 0, device: torch.device | str = "cpu", state_gain: float = STATE_GAIN,
    served_layer_types: frozenset[str] | None = None, state_layers: StateLayers | None = None, **sizes: Any
) -> torch.nn.Module:
    """A seeded random-weight causal LM of transformers model type ``arch`` (nothing downloaded).

    ``sizes`` override :data:`TINY` (and :data:`TINY_TYPE_SIZES`); only fields the model's config has (and
    can set) are set (GPT-2 has no ``num_key_value_heads``...); a sub-config given in ``sizes`` (dbrx's
    ``attn_config``) is used as given, not shrunk. Fewer layers keep one of each type the full config has
    (``layer_types``; :data:`TINY_LAYER_MIX` where released models differ from the default). The
    weight matrices and convolutions of state layers (modules that call the kernels
    :mod:`piecewise_backend.hf.mixers` routes) are scaled by ``state_gain``: at HF's initialization and this size their
    output barely moves the logits, so a model that dropped their state would still pass a check.
    The model uses HF's SDPA attention (eager where a model has no SDPA support) and is in eval mode.

    What the engine serves comes in from :mod:`piecewise_backend.hf` (``hf.tiny_random_model`` passes both):
    ``served_layer_types`` (a lost layer type outside it is refused; None: every lost type) and
    ``state_layers`` (the modules whose weights ``state_gain`` scales; None: none).
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError("tiny_random_model needs transformers: pip install 'piecewise_backend[hf]'") from e
    served = served_layer_types if served_layer_types is not None else frozenset()
    if arch not in transformers.CONFIG_MAPPING:
        raise ValueError(f"{arch!r} is not a transformers model type (the keys of transformers.CONFIG_MAPPING, e.g. 'llama')")
    try:
        defaults = transformers.AutoConfig.for_model(arch)
    except Exception as e:  # the type's own defaults fail its validation (gemma4_assistant)
        raise ValueError(f"tiny_random_model cannot build {arch!r}: its default config is invalid ({type(e).__name__}: {e})") from e
    if type(defaults) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"transformers model type {arch!r} has no causal LM class (AutoModelForCausalLM cannot build it)")
    sizes = {**TINY_TYPE_SIZES.get(arch, {}), **sizes}
    try:
        config = _keep_layer_mix(transformers, arch, defaults, _build_mixed(transformers, arch, defaults, sizes), sizes, served)
    except ValueError:
        decoder = _lm_config(transformers, defaults)
        if decoder is defaults:
            raise
        config = _keep_layer_mix(transformers, arch, decoder, _build_mixed(transformers, arch, decoder, sizes), sizes, served)
    torch.manual_seed(seed)
    try:
        model = _from_config(transformers, arch, config, attn_implementation="sdpa")
    except ValueError:  # a model without SDPA support (Gemma2...): HF's eager attention
        torch.manual_seed(seed)
        model = _from_config(transformers, arch, config, attn_implementation="eager")
    with torch.no_grad():
        for _, module in state_layers(model) if state_layers is not None else ():
            for p in module.parameters():
                if p.dim() >= 2:
                    p.mul_(state_gain)
    return model.to(device).eval()


#: Sizes of a vision tower in :func:`tiny_random_vlm`: as wide as the text model (towers whose ``hidden_size``
#: is their output width, qwen2-vl's, then match it), 2 layers, an image of 32x32 pixels in patches of 8
#: (a fixed-size tower: 16 patches before any merge or pooling).
TINY_VISION = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    head_dim=16, image_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=4, out_hidden_size=64,
    projection_dim=64, mlp_ratio=2.0,
    # qwen3-vl's deepstack adds features of these tower layers to the text model's first layers: kept within 2 layers
    deepstack_visual_indexes=[0, 1],
)
#: The vocabulary of :func:`tiny_random_vlm`: special tokens (image, video, vision start/end, ...) take its top ids.
VLM_VOCAB = 256
#: Token ids a VLM config names that stay as TINY sets them (not remapped to the top of the vocabulary).
_PLAIN_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
#: Per-type sizes :func:`tiny_random_vlm` cannot derive (by model type; keys of the top-level config, or
#: ``{"vision_config": {...}}`` merged into that sub-config's sizes).
TINY_VLM_SIZES: dict[str, dict[str, Any]] = {
    # llava_next's tiles come from image_grid_pinpoints (336-pixel tiles by default): one 32x32 tile
    **{arch: {"image_grid_pinpoints": [[32, 32]]} for arch in ("llava_next", "llava_next_video", "llava_onevision")},
    # gemma3 pools the tower's 16 patches to mm_tokens_per_image (256 by default: a kernel of 0)
    **{arch: {"mm_tokens_per_image": 4} for arch in ("gemma3", "shieldgemma2")},
    # vipllava concatenates 5 of the tower's layers (down to layer -11): two of the two
    "vipllava": {"vision_feature_layers": [-2, -1]},
    # aria's projector maps a tower's patch count to its query count: the tiny tower's 16 patches to 4 queries
    "aria": {"projector_patch_to_query_dict": {16: 4}},
    # the thinker's get_rope_index reads vision_start_token_id, which only the full omni config declares
    "qwen2_5_omni_thinker": {"vision_start_token_id": VLM_VOCAB - 40},
}


def _special_tokens(config: Any) -> dict[str, int]:
    """The special-token ids a VLM config names (image, video, vision start and end, ...), by field."""
    out = {}
    for name in dir(config):
        if name.startswith("_") or not (name.endswith("_token_id") or name.endswith("_token_index")):
            continue
        if name in _PLAIN_TOKENS:
            continue
        try:
            value = getattr(config, name)
        except Exception:  # a deprecated alias that refuses a read
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            out[name] = value
    return out


def _without_per_layer(config: Any) -> dict[str, Any]:
    """``config.to_dict()`` without its per-layer fields (lists as long as its layer count, dicts keyed by layer
    index): the shrunk layer count derives its own."""
    data = config.to_dict()
    layers = {data.get(k) for k in ("num_hidden_layers", "depth", "num_layers") if isinstance(data.get(k), int)}
    def per_layer(value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return len(value) in layers and len(value) > 2
        return isinstance(value, dict) and bool(value) and all(str(k).isdigit() for k in value)
    return {k: v for k, v in data.items() if not per_layer(v) and k not in ("architectures", "transformers_version")}


def _mrope_scaled(vlm: Any, text: Any, head_dim: int) -> dict[str, Any]:
    """``text``'s ``rope_parameters`` with an M-RoPE ``mrope_section`` (sizes per position axis, summing to half
    the head dim) scaled to ``head_dim``: the config's own, else the default its modeling code falls back to
    (qwen2-vl's ``[16, 24, 24]``, for a head dim of 128); {} where the model has no M-RoPE."""
    import importlib
    import inspect
    import re

    rope = getattr(text, "rope_parameters", None)
    if not isinstance(rope, dict):
        return {}
    section = rope.get("mrope_section")
    if not isinstance(section, (list, tuple)):
        source = ""
        for config in (vlm, text):  # glm46v's text model is glm4v's
            try:
                source += inspect.getsource(importlib.import_module(type(config).__module__.replace("configuration_", "modeling_")))
            except (ImportError, OSError, TypeError):
                pass
        found = re.search(r"mrope_section[^\n]{0,60}?\[(\d+),\s*(\d+),\s*(\d+)\]", source)
        if found is None and "mrope_section" not in source:
            return {}
        section = [int(x) for x in found.groups()] if found else [16, 24, 24]
    partial = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0)) or 1.0
    half = int(head_dim * partial) // 2
    scaled = [max(1, x * half // sum(section)) for x in section]
    scaled[0] += half - sum(scaled)
    return {"rope_parameters": {**rope, "mrope_section": scaled}}


def _vlm_config(transformers: Any, arch: str, defaults: Any, sizes: dict[str, Any], level: int) -> Any:
    """``arch``'s config with its text and vision sub-configs shrunk (``level`` as :func:`_fields`), its
    special tokens remapped to the top of :data:`VLM_VOCAB`."""
    own = {**TINY_VLM_SIZES.get(arch, {}), **sizes}
    subs: dict[str, Any] = {}
    text = None
    try:
        text = defaults.get_text_config()
    except Exception:
        pass
    for key in getattr(defaults, "sub_configs", {}) or {}:
        sub = getattr(defaults, key, None)
        if sub is None and key == "vision_config":  # an optional tower left out by default (gemma4): its defaults
            spec = defaults.sub_configs[key]
            sub = getattr(spec, "config_class", spec)()
        if not isinstance(sub, transformers.PretrainedConfig):
            continue
        given = own.pop(key, {})
        if sub is text:
            typed = TINY_TYPE_SIZES.get(getattr(sub, "model_type", ""), {})  # the text model's own (qwen4_exp_text's QSA)
            fields = _fields(sub, {"vocab_size": VLM_VOCAB, **typed, **given}, level)
            fields.update(_mrope_scaled(defaults, sub, fields.get("head_dim", TINY["head_dim"])))
            kinds = list(dict.fromkeys(_layer_kinds(sub) or []))
            if len(kinds) > 1 and "layer_types" not in given and level < 2:  # one layer of each type (qwen3.5: linear, full)
                layers = max(len(kinds), fields.get("num_hidden_layers", 2))
                fields.update(num_hidden_layers=layers, layer_types=kinds + [kinds[-1]] * (layers - len(kinds)))
            if "sliding_attention" in kinds and getattr(sub, "sliding_window", None) is None:  # step3p7: None by default
                fields["sliding_window"] = TINY_IF_SET["sliding_window"]
        else:  # vision, audio, projector, q-former...: the vision sizes where the sub-config has them
            base = _fields(sub, {**TINY_VISION, **given}, min(level, 1))
            fields = {k: v for k, v in base.items() if k in TINY_VISION or k in given or level == 0 and k in TINY_IF_SET}
            if isinstance(fields.get("mlp_ratio"), float) and isinstance(getattr(sub, "mlp_ratio", None), int):
                fields["mlp_ratio"] = int(fields["mlp_ratio"])  # qwen2-vl validates an int, step3p7 a float
            if "num_hidden_layers" not in fields and _settable(sub, "num_layers"):
                fields["num_layers"] = 2
        subs[key] = type(sub)(**{**_without_per_layer(sub), **fields}) if level < 3 else sub
    top = {k: v for k, v in own.items()}
    tokens = _special_tokens(defaults)
    for i, name in enumerate(sorted(tokens)):
        top.setdefault(name, VLM_VOCAB - 1 - i)
    try:
        config = transformers.AutoConfig.for_model(arch, **subs, **top)
    except TypeError:  # a config that takes its sub-configs as dicts only
        config = transformers.AutoConfig.for_model(arch, **{k: v.to_dict() for k, v in subs.items()}, **top)
    for key, sub in subs.items():  # configs that rebuild a sub-config from their own defaults
        if getattr(config, key, None) is not sub and isinstance(getattr(config, key, None), transformers.PretrainedConfig):
            setattr(config, key, sub)
    for name, value in top.items():  # set after __post_init__ (configs that derive ids from a sub-config)
        if _settable(config, name):
            setattr(config, name, value)
    return config


def tiny_random_vlm(arch: str, *, seed: int = 0, device: torch.device | str = "cpu", **sizes: Any) -> torch.nn.Module:
    """A seeded random-weight image-text-to-text model of transformers model type ``arch`` (a key of
    ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``; nothing downloaded).

    The text sub-config gets :data:`TINY` (vocabulary :data:`VLM_VOCAB`), the vision tower and any other
    sub-config :data:`TINY_VISION` where it has those fields (2 layers, 32x32 images in 8x8 patches); the
    config's special tokens (image, video, vision start / end, ...) move to the top ids of the vocabulary.
    ``sizes`` are set on the top-level config (a sub-config's key, e.g. ``vision_config={...}``, adds to that
    sub-config's sizes). SDPA attention (eager where the model has none), eval mode. A type that cannot be
    built raises ValueError naming why.
    """
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as names
    except ImportError as e:
        raise ImportError("tiny_random_vlm needs transformers: pip install 'piecewise_backend[hf]'") from e
    if arch not in names:
        raise ValueError(f"{arch!r} is not an image-text-to-text model type (the keys of transformers' "
                         "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, e.g. 'llava', 'qwen2_vl')")
    try:
        defaults = transformers.AutoConfig.for_model(arch)
    except Exception as e:
        raise ValueError(f"tiny_random_vlm cannot build {arch!r}: its default config is invalid ({type(e).__name__}: {e})") from e
    errors = []
    config = None
    for level in range(4):
        try:
            candidate = _vlm_config(transformers, arch, defaults, sizes, level)
            with torch.device("meta"):
                params = sum(p.numel() for p in transformers.AutoModelForImageTextToText.from_config(candidate).parameters())
        except Exception as e:  # the config's or the model's own validation: try fewer changes
            errors.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            continue
        if params <= MAX_PARAMS:
            config = candidate
            break
        errors.append(f"{params / 1e6:.0f}M parameters (> {MAX_PARAMS / 1e6:.0f}M: a size field TINY_VISION does not know)")
    if config is None:
        raise ValueError(f"tiny_random_vlm cannot build {arch!r} from a shrunk config ({errors[0]}); pass fitting **sizes")
    for implementation in ("sdpa", "eager"):
        torch.manual_seed(seed)
        try:
            model = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation=implementation)
            break
        except ValueError as e:  # no SDPA support in some sub-model
            error = e
    else:
        raise ValueError(f"tiny_random_vlm cannot build {arch!r}: {error}")
    return model.to(device).eval()


def _image_features(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The rows ``model.get_image_features`` makes of ``inputs`` (flattened as the model scatters them)."""
    import inspect

    method = model.get_image_features
    wanted = inspect.signature(method).parameters
    with torch.no_grad():
        out = method(**{k: v for k, v in inputs.items() if k in wanted or "kwargs" in wanted})
    features = getattr(out, "pooler_output", out)
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features], 0)
    return features.reshape(-1, features.shape[-1])


def random_mm_inputs(model: torch.nn.Module, images: int = 1, seed: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    """Random pixel inputs of the shape ``model`` takes for ``images`` images, and how many image tokens they
    make (``model.get_image_features`` run once to count them).

    Grid models (a ``spatial_merge_size``: qwen2-vl and relatives) get ``image_grid_thw`` rows ``[1, 2m, 2m]``
    and their flattened patches; fixed-size towers ``(images, C, H, W)`` at the tower's ``image_size``, with
    ``image_sizes`` where the model's forward takes them.
    """
    import inspect

    if not callable(getattr(model, "get_image_features", None)):
        raise ValueError(f"random_mm_inputs: {type(model).__name__} has no get_image_features (its images reach "
                         "its forward another way: no image features to count)")
    vision = model.config.vision_config
    gen = torch.Generator().manual_seed(seed)
    forward = inspect.signature(model.forward).parameters
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or 3
    merge = getattr(vision, "spatial_merge_size", None) or getattr(vision, "merge_kernel_size", None)
    merge = merge[0] if isinstance(merge, (list, tuple)) else merge
    if "image_grid_thw" in forward and (merge or getattr(vision, "image_size", None) is None):
        merge = merge or 2
        patch = vision.patch_size
        temporal = getattr(vision, "temporal_patch_size", 1) or 1
        grid = torch.tensor([[1, 2 * merge, 2 * merge]] * images)
        count = int(grid.prod(-1).sum())
        extra = {"image_merge_sizes": torch.tensor([merge] * images)} if "image_merge_sizes" in forward else {}
        # flattened patches of the config's temporal patch size; of 2 frames (a tower that does not declare it);
        # (patches, C, p, p) (kimi_k25)
        shapes = [(count, channels * temporal * patch * patch), (count, channels * 2 * patch * patch),
                  (count, channels, patch, patch)]
        return _first_taken(model, [{"pixel_values": torch.randn(*shape, generator=gen), "image_grid_thw": grid, **extra}
                                    for shape in dict.fromkeys(shapes)])
    if getattr(vision, "image_size", None) is None and "spatial_shapes" in forward:
        # siglip2's variable resolution (lfm2_vl): patches flattened per image, their grid and a mask over them
        patch, side = vision.patch_size, 4
        inputs = {"pixel_values": torch.randn(images, side * side, channels * patch * patch, generator=gen),
                  "spatial_shapes": torch.tensor([[side, side]] * images),
                  "pixel_attention_mask": torch.ones(images, side * side, dtype=torch.long)}
        return _counted(model, inputs)
    size = vision.image_size
    h, w = (size, size) if isinstance(size, int) else (size["height"], size["width"]) if isinstance(size, dict) else tuple(size)
    pixels = torch.randn(images, channels, h, w, generator=gen)
    sizes = torch.tensor([[h, w]] * images)
    # the shapes fixed-size towers take, tried in turn (the first the model's get_image_features takes):
    # (images, C, H, W); with image_sizes (pixtral towers: mistral3); one tile per image besides the base
    # image, with image_sizes (llava_next: image_grid_pinpoints [[H, W]]); (1, images, C, H, W) (idefics2/3)
    tried = [{"pixel_values": pixels}]
    if "image_sizes" in forward:
        tried += [{"pixel_values": pixels, "image_sizes": sizes},
                  {"pixel_values": torch.stack([pixels, pixels], 1), "image_sizes": sizes}]
    tried.append({"pixel_values": pixels[None]})
    return _first_taken(model, tried)


def _first_taken(model: torch.nn.Module, tried: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], int]:
    """The first of ``tried`` that ``model``'s ``get_image_features`` takes, and the image tokens it makes."""
    errors = []
    for inputs in tried:
        try:
            return _counted(model, inputs)
        except Exception as e:  # not this shape: the next
            errors.append(f"{tuple(inputs['pixel_values'].shape)}: {type(e).__name__}: {str(e)[:120]}")
    raise ValueError(f"random_mm_inputs: {type(model).__name__}.get_image_features takes none of the pixel shapes "
                     f"tried ({'; '.join(errors)})")


def _counted(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """``inputs`` on ``model``'s device and dtype, and the image tokens they make."""
    param = next(model.parameters())
    inputs = {k: v.to(param.device, param.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
    return inputs, int(_image_features(model, inputs).shape[0])
