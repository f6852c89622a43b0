"""Tiny random models of any transformers architecture, built from the config class's own defaults.

:func:`tiny_config` shrinks a config's default values by rules over attribute names (hidden sizes,
layers, heads, vocabulary, positions, image / audio sizes, experts, state sizes ...), recursively
through sub-configs and nested dicts, and then restores the invariants a config relies on (hidden
divisible by heads, key/value heads dividing heads, per-layer lists as long as the layer count,
special token ids inside the vocabulary, rotary sections summing to half the head size).
:func:`model_class` picks the class transformers' auto mappings give the type (a head with a task
first), and :func:`build_tiny` builds it in eval mode. Used by the coverage sweep
(``benchmarks/coverage.py``) and the tests.
"""

from __future__ import annotations

import copy
import inspect
import re
from typing import Any

import torch

# sizes every shrunk model shares, so that a sub-model's output fits the next one's input
HIDDEN = 64
INTERMEDIATE = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2
VOCAB = 256
POSITIONS = 512
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
STATE = 16
PATCHES_PER_SIDE = 4  # image_size = patch_size * 4: 16 patches
CONV_IMAGE = 64  # image size of a model without patches (convolutional stems downsample by up to 32)
MEL_BINS = 16
SOURCE_POSITIONS = 32  # audio encoders with a fixed frame count (Whisper reads 2x this many frames)
CONV_CHANNELS = 32
CODEBOOK = 64

# exact names of each kind of integer (checked first), then name patterns
_EXACT: dict[str, int] = {
    **dict.fromkeys(
        (
            "num_hidden_layers num_layers n_layer n_layers encoder_layers decoder_layers num_decoder_layers "
            "num_encoder_layers depth encoder_depth decoder_depth num_text_layers num_vision_layers "
            "num_single_layers num_cross_layers text_layers vision_layers audio_layers"
        ).split(),
        LAYERS,
    ),
    **dict.fromkeys(
        (
            "num_attention_heads n_head n_heads num_heads encoder_attention_heads decoder_attention_heads "
            "attention_heads num_attn_heads"
        ).split(),
        HEADS,
    ),
    **dict.fromkeys("head_dim d_head d_kv attention_head_dim kv_channels attention_head_size".split(), HEAD_DIM),
    **dict.fromkeys("num_experts num_local_experts n_routed_experts moe_num_experts".split(), EXPERTS),
    **dict.fromkeys("num_experts_per_tok num_experts_per_token moe_topk moe_k top_k".split(), EXPERTS_PER_TOKEN),
    **dict.fromkeys("n_group topk_group num_expert_group first_k_dense_replace".split(), 1),
    **dict.fromkeys("state_size ssm_state_size d_state mamba_d_state linear_key_head_dim".split(), STATE),
    **dict.fromkeys("num_mel_bins feature_size input_feat_per_channel n_mels num_mel_filters".split(), MEL_BINS),
    **dict.fromkeys("codebook_size num_codevectors_per_group codebook_dim".split(), CODEBOOK),
    "num_conv_pos_embeddings": 16,
    "latent_query_num": 8,  # Kosmos-2.5's image tokens in the text
    "num_groups": 4,  # group norms over the shrunk channels
    "num_conv_pos_embedding_groups": HEADS,
    "max_source_positions": SOURCE_POSITIONS,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": HEAD_DIM,
}
_PATTERNS: list[tuple[re.Pattern[str], int]] = [
    (re.compile(r"(^|_)num_key_value_heads$|(^|_)(num_kv_heads|n_kv_heads|multi_query_group_num)$"), KV_HEADS),
    (re.compile(r"vocab_size$"), VOCAB),
    (re.compile(r"(^|_)(max_position_embeddings|n_positions|n_ctx|max_target_positions|max_seq_len)$"), POSITIONS),
    (re.compile(r"moe_intermediate_size$|expert_intermediate_size$|shared_expert_intermediate_size$"), 32),
    (
        re.compile(r"intermediate_size$|(^|_)(ffn_dim|d_ff|n_inner|mlp_dim|ffn_hidden_size|feed_forward_size)$"),
        INTERMEDIATE,
    ),
    (re.compile(r"_heads$"), HEADS),
    (re.compile(r"_layers$"), LAYERS),
    (re.compile(r"(^|_)(hidden_size|d_model|n_embd|n_embed|embed_dim|hidden_dim|dim|d_embed|embedding_size)$"), HIDDEN),
    (re.compile(r"(^|_)(embedding_dim|projection_dim|proj_dim|word_embed_proj_dim|channels)$"), HIDDEN),
]
# integers never shrunk: they are indices, ratios, strides, kernel sizes or counts tied to data
_KEEP = re.compile(
    r"token_id|token_index|_id$|_idx$|stride|kernel|dilation|sampling_rate|ratio|factor|num_labels|"
    r"num_channels|in_chans|in_channels|patch_size|merge_size|temporal|window|chunk|max_window_layers|"
    r"num_feat_extract_layers|_period$|_offset$|_every|_interval|_freq$|frequency|hop|n_fft|win_length"
)
# any other integer larger than this whose name says it is a width is shrunk to HIDDEN
_WIDTH = re.compile(r"(_size|_dim|_dims|_width|_channels|_features)$")
_WIDTH_LIMIT = 256

_LAYER_COUNT_KEYS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "decoder_layers",
    "encoder_layers",
    "depth",
)


_UNTOUCHED = {
    "id2label",
    "label2id",
    "transformers_version",
    "architectures",
    "out_features",
    "out_indices",
    "stage_names",
}


def _rule(name: str, value: int) -> int | None:
    if name in _EXACT:
        return _EXACT[name]
    if _KEEP.search(name):
        return None
    for pattern, target in _PATTERNS:
        if pattern.search(name):
            return target
    if _WIDTH.search(name) and value > _WIDTH_LIMIT:
        return HIDDEN
    return None


def _shrink_int_list(name: str, values: list[int]) -> list[int] | None:
    """Per-stage lists (``hidden_sizes``, ``depths``, ``num_heads``, ``conv_dim`` ...): scaled
    down keeping their ratios, so that stage widths stay divisible by stage heads."""
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    if name in ("depths", "num_layers", "encoder_layers", "decoder_layers", "layers", "block_repeats") or name.endswith(
        ("_depths", "depths")
    ):
        return [1] * len(values)
    if _KEEP.search(name):
        return None
    if name.endswith("heads") or name in ("num_heads", "attention_heads"):
        first = values[0]
        return [max(1, v // first) for v in values]
    if re.search(r"(hidden_sizes|embed_dims?|dims|_dim|widths|channels|conv_dim|tdnn_dim|_sizes|hidden_size)$", name):
        if max(values) <= 32:
            return None
        scale = 16 / values[0] if values[0] >= 16 else 1.0
        if name in ("conv_dim", "tdnn_dim") or name.endswith("conv_dim"):
            return [CONV_CHANNELS] * len(values)
        return [max(8, round(v * scale / 8) * 8) if v * scale >= 8 else max(1, int(v * scale)) for v in values]
    return None


def _resize_per_layer(values: list | str, count: int) -> list | str:
    """A per-layer list (or pattern string) cut to ``count`` entries, keeping one of each kind
    of layer when there is room (so a hybrid keeps its attention and its recurrent layers)."""
    items = list(values)
    picked: list[int] = []
    for i, item in enumerate(items):
        if item not in [items[j] for j in picked] and len(picked) < count:
            picked.append(i)
    for i in range(len(items)):
        if len(picked) >= count:
            break
        if i not in picked:
            picked.append(i)
    resized = [items[i] for i in sorted(picked)]
    return "".join(resized) if isinstance(values, str) else resized


def _layer_count(d: dict) -> int | None:
    for key in _LAYER_COUNT_KEYS:
        if isinstance(d.get(key), int) and not isinstance(d.get(key), bool):
            return d[key]
    return None


def _per_layer(value: Any, layers: int | None) -> bool:
    """Whether ``value`` holds one entry per layer: a list, or a pattern string of layer kinds
    (Nemotron-H's ``"M-M*"``; not a word or version that happens to be as long: Mimi's 8 layers and
    its pad_mode ``"constant"``, Swin's 4 stages and ``"gelu"``)."""
    if not layers or layers < 2 or not isinstance(value, (list, str)) or len(value) != layers:
        return False
    return isinstance(value, list) or not any(c.islower() or c.isdigit() for c in value)


def _layer_kinds(d: dict, original: int | None) -> int:
    """How many layers the tiny model needs to keep one of each kind found in per-layer lists."""
    kinds = 1
    for value in d.values():
        if _per_layer(value, original):
            try:
                kinds = max(kinds, len(set(value)))
            except TypeError:
                continue
    return min(kinds, 4)


def shrink_config_dict(d: dict[str, Any]) -> dict[str, Any]:
    """A config's ``to_dict()`` with every size shrunk (sub-configs included) and its invariants
    restored. The input is not modified."""
    d = copy.deepcopy(d)
    _shrink(d, is_config=True)
    _fix_token_ids(d)
    return d


def _shrink(d: dict[str, Any], is_config: bool) -> None:
    # a staged model (``depths`` per stage: Swin, ConvNeXt ...) has per-stage lists, not per-layer ones
    staged = isinstance(d.get("depths"), list) or isinstance(d.get("stage_names"), list)
    original_layers = _layer_count(d) if is_config and not staged else None
    layers = max(LAYERS, _layer_kinds(d, original_layers)) if original_layers else None
    original_heads = d.get("num_attention_heads")
    original_hidden = d.get("hidden_size")
    original_kv = d.get("num_key_value_heads")
    original_head_dim = _head_dim(d)
    equal_dims = _equal_head_dims(d)
    original_rotary = d.get("rotary_dim")
    for key, value in list(d.items()):
        if key.startswith("_") or key in _UNTOUCHED:
            continue
        if isinstance(value, dict) and original_layers and value and all(_is_index(k) for k in value):
            d[key] = _per_layer_dict(value, layers)
        elif isinstance(value, dict):
            _shrink(value, is_config="model_type" in value)
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int) and key.endswith("groups") and value == original_hidden and value > HIDDEN:
            d[key] = HIDDEN  # groups tied to the width (a depthwise convolution)
        elif isinstance(value, int):
            target = _rule(key, value)
            if target is not None and value > target:
                d[key] = target
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for item in value:
                _shrink(item, is_config="model_type" in item)
        elif _per_layer(value, original_layers) and (isinstance(value, list) or original_layers > 2):
            d[key] = _resize_per_layer(value, layers)
        elif isinstance(value, list):
            shrunk = _shrink_int_list(key, value)
            if shrunk is not None:
                d[key] = shrunk
    if not is_config:
        return
    if layers is not None:
        for key in _LAYER_COUNT_KEYS:
            if isinstance(d.get(key), int) and not isinstance(d.get(key), bool) and d[key] > layers:
                d[key] = layers
        _fix_layer_indices(d, layers)
        _fix_periods(d, layers)
    _fix_heads(d, original_heads, original_kv)
    for group in equal_dims:  # MLA: head_dim is qk_rope_head_dim (DeepSeek-V3, LongCat-Flash)
        smallest = min(d[key] for key in group)
        for key in group:
            d[key] = smallest
    _fix_rope(d, original_head_dim)
    _fix_rotary_dim(d, original_rotary, original_head_dim)
    _fix_ssm(d)
    _fix_images(d)
    _fix_image_tokens(d)
    _fix_mrope(d)
    if staged and type(d.get("window_size")) is int and d["window_size"] > 2:
        d["window_size"] = 2  # every stage's grid (image / patch / 2^stage) holds whole windows


def _is_index(key: Any) -> bool:
    return type(key) is int or (isinstance(key, str) and key.isdigit())


def _per_layer_dict(value: dict, layers: int) -> dict:
    """``{layer index: settings}`` kept to the shrunk layers (the last entry moves to the last layer)."""
    kept = {k: v for k, v in value.items() if int(k) < layers}
    if not kept:
        last = max(value, key=int)
        kept = {type(last)(layers - 1): value[last]}
    return kept


def _fix_layer_indices(d: dict, layers: int) -> None:
    """Lists of layer indices (``mlp_only_layers``, ``global_attn_indexes`` ...) kept in range."""
    for key, value in d.items():
        if not isinstance(value, list) or not value or not all(type(v) is int for v in value):
            continue
        if re.search(r"(layers|layer_ids|indexes|indices|idxs|layer_idx)$", key) and "feature" not in key:
            kept = sorted({v for v in value if 0 <= v < layers})
            if len(kept) < len(value):
                d[key] = kept or [layers - 1]
        elif "feature_layer" in key:
            d[key] = [max(-layers - 1, min(v, layers)) for v in value]
    for key in ("vision_feature_layer", "feature_layer", "select_layer"):
        if type(d.get(key)) is int:
            d[key] = max(-layers - 1, min(d[key], layers))


def _fix_heads(d: dict, original_heads: Any, original_kv: Any) -> None:
    heads = d.get("num_attention_heads")
    if type(original_heads) is int and type(original_kv) is int and type(heads) is int:
        if original_kv == original_heads:
            d["num_key_value_heads"] = heads
        elif original_kv == 1:
            d["num_key_value_heads"] = 1
        elif heads % d["num_key_value_heads"]:
            d["num_key_value_heads"] = 1
    # a head count larger than the width it splits (or not dividing it)
    for width_key, heads_key in (
        ("hidden_size", "num_attention_heads"),
        ("d_model", "encoder_attention_heads"),
        ("d_model", "decoder_attention_heads"),
        ("embed_dim", "num_heads"),
        ("hidden_size", "num_heads"),
    ):
        width, count = d.get(width_key), d.get(heads_key)
        if type(width) is int and type(count) is int and count and width % count:
            d[heads_key] = next(h for h in (HEADS, 2, 1) if width % h == 0)


def _fix_rope(d: dict, original_head_dim: Any) -> None:
    """Rotary sections (``mrope_section``) must sum to half the (new) head size."""
    head_dim = d.get("head_dim")
    if type(head_dim) is not int:
        heads, hidden = d.get("num_attention_heads"), d.get("hidden_size")
        head_dim = hidden // heads if type(hidden) is int and type(heads) is int and heads else None
    for holder in (d, d.get("rope_parameters"), d.get("rope_scaling")):
        if not isinstance(holder, dict):
            continue
        for key in ("mrope_section", "mrope_sections"):
            section = holder.get(key)
            if isinstance(section, list) and section and head_dim and sum(section) != head_dim // 2:
                holder[key] = _split(head_dim // 2, section)


def _equal_head_dims(d: dict) -> list[list[str]]:
    """Groups of ``*head_dim`` fields equal in the original config (a config deriving one from the
    other): they stay equal when shrunk."""
    by_value: dict[int, list[str]] = {}
    for key, value in d.items():
        if key.endswith("head_dim") and type(value) is int and value > 1:
            by_value.setdefault(value, []).append(key)
    return [keys for keys in by_value.values() if len(keys) > 1]


def _head_dim(d: dict) -> int | None:
    head_dim = d.get("head_dim")
    if type(head_dim) is int:
        return head_dim
    for width_key, heads_key in (("hidden_size", "num_attention_heads"), ("n_embd", "n_head"), ("d_model", "n_head")):
        width, heads = d.get(width_key), d.get(heads_key)
        if type(width) is int and type(heads) is int and heads:
            return width // heads
    return None


def _fix_rotary_dim(d: dict, original_rotary: Any, original_head_dim: Any) -> None:
    """A partial rotary width (GPT-J, CodeGen: ``rotary_dim``) keeps its share of the shrunk head."""
    head_dim = _head_dim(d)
    if type(original_rotary) is not int or head_dim is None or d.get("rotary_dim", 0) <= head_dim:
        return
    share = original_rotary / original_head_dim if type(original_head_dim) is int and original_head_dim else 1
    d["rotary_dim"] = max(2, int(head_dim * min(share, 1)) // 2 * 2)


def _fix_mrope(d: dict) -> None:
    """A Qwen2-VL-style composite (a vision tower with spatial and temporal patches) rotates its
    text positions in three sections; a default left to the model sums to the original head size."""
    vision, text = d.get("vision_config"), d.get("text_config")
    if not isinstance(vision, dict) or not isinstance(text, dict) or "temporal_patch_size" not in vision:
        return
    rope = text.get("rope_parameters")
    if not isinstance(rope, dict) or "mrope_section" in rope:
        return
    head_dim = text.get("head_dim")
    if type(head_dim) is not int:
        hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
        head_dim = hidden // heads if type(hidden) is int and type(heads) is int and heads else HEAD_DIM
    rope["mrope_section"] = _split(head_dim // 2, [16, 24, 24])


def _split(total: int, like: list[int]) -> list[int]:
    weights = [max(1, v) for v in like]
    parts = [max(1, total * w // sum(weights)) for w in weights]
    parts[-1] += total - sum(parts)
    return parts


def _fix_ssm(d: dict) -> None:
    """Mamba-2 style: heads x head size must equal expand x hidden size."""
    hidden, expand = d.get("hidden_size"), d.get("mamba_expand", d.get("expand"))
    for heads_key, dim_key in (("mamba_n_heads", "mamba_d_head"), ("num_heads", "head_dim")):
        if heads_key == "num_heads" and "ssm_state_size" not in d and "state_size" not in d:
            continue
        if type(hidden) is int and type(expand) is int and type(d.get(dim_key)) is int:
            inner = hidden * expand
            if d[dim_key] > inner:
                d[dim_key] = HEAD_DIM
            d[heads_key] = max(1, inner // d[dim_key])
    if type(d.get("n_groups")) is int and d["n_groups"] > 1:
        d["n_groups"] = 1
    if type(d.get("mamba_n_groups")) is int and d["mamba_n_groups"] > 1:
        d["mamba_n_groups"] = 1
    if type(d.get("time_step_rank")) is int and d["time_step_rank"] > 16:
        d["time_step_rank"] = 16


def _fix_periods(d: dict, layers: int) -> None:
    """Hybrids placing a kind of layer every ``period`` layers from ``offset`` (Jamba's attention):
    the period fits in the shrunk layers, so every kind keeps a layer."""
    for key, value in list(d.items()):
        if key.endswith("_period") and type(value) is int and value > layers:
            d[key] = layers
            offset_key = key.replace("_period", "_offset")
            if type(d.get(offset_key)) is int and d[offset_key] >= layers:
                d[offset_key] = layers - 1


def _fix_image_tokens(d: dict) -> None:
    """A composite's image token count (``mm_tokens_per_image``) at most the vision tower's patches."""
    vision = d.get("vision_config")
    if not isinstance(vision, dict):
        return
    patch, size = vision.get("patch_size"), vision.get("image_size")
    if type(patch) is not int or type(size) is not int or not patch:
        return
    patches = (size // patch) ** 2
    for key in ("mm_tokens_per_image", "image_seq_length", "num_image_tokens"):
        if type(d.get(key)) is int and d[key] > patches:
            d[key] = patches


def _fix_images(d: dict) -> None:
    """``image_size`` a multiple of ``patch_size`` (a few patches), or small for a patchless model."""
    patch = d.get("patch_size")
    if isinstance(patch, list) and patch and type(patch[0]) is int:
        patch = patch[0]
    for key in ("image_size", "img_size", "input_size"):
        size = d.get(key)
        side = size[0] if isinstance(size, list) and size and type(size[0]) is int else size
        if type(side) is not int or isinstance(side, bool):
            continue
        target = (
            patch * max(PATCHES_PER_SIDE, -(-CONV_IMAGE // patch)) if type(patch) is int and patch > 0 else CONV_IMAGE
        )
        if side > target:
            d[key] = [target] * len(size) if isinstance(size, list) else target


def _token_id_keys(d: dict) -> list[str]:
    return [
        k
        for k, v in d.items()
        if isinstance(k, str) and k.endswith(("_token_id", "_token_index", "_token_ids")) and v is not None
    ]


def _collect_large_ids(d: dict, found: set[int]) -> None:
    for key in _token_id_keys(d):
        values = d[key] if isinstance(d[key], list) else [d[key]]
        found.update(v for v in values if type(v) is int and v >= VOCAB)
    for value in d.values():
        if isinstance(value, dict):
            _collect_large_ids(value, found)


def _remap_ids(d: dict, mapping: dict[int, int]) -> None:
    for key in _token_id_keys(d):
        value = d[key]
        if isinstance(value, list):
            d[key] = [mapping.get(v, v) if type(v) is int else v for v in value]
        elif type(value) is int:
            d[key] = mapping.get(value, value)
    for value in d.values():
        if isinstance(value, dict):
            _remap_ids(value, mapping)


def _fix_token_ids(d: dict) -> None:
    """Special token ids past the shrunk vocabulary, anywhere in the config tree, moved to its top
    end: each id to its own new id, the same at every level (image_token_id at the top level and
    the text config's vocabulary agree)."""
    large: set[int] = set()
    _collect_large_ids(d, large)
    _remap_ids(d, {old: VOCAB - 1 - i for i, old in enumerate(sorted(large))})


# what rules cannot express: model_type -> (reason, overrides applied to the shrunk dict)
OVERRIDES: dict[str, tuple[str, dict[str, Any]]] = {}


def tiny_config(model_type: str) -> Any:
    """A tiny config of ``model_type`` (a key of ``transformers.CONFIG_MAPPING``)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    shrunk = shrink_config_dict(defaults)
    _fix_default_mrope(shrunk, model_type)
    if model_type in OVERRIDES:
        _merge(shrunk, OVERRIDES[model_type][1])
    for key in ("transformers_version", "architectures", "_name_or_path", "model_type"):
        shrunk.pop(key, None)
    try:
        return config_class(**shrunk)
    except Exception:
        _drop_derived(shrunk, len(defaults.get("layer_types") or ()) or _layer_count(defaults))
        return config_class(**shrunk)


def _fix_default_mrope(d: dict, model_type: str) -> None:
    """A text model whose code defaults its rotary sections (``rope_parameters.get("mrope_section",
    [16, 24, 24])``: Qwen2.5-VL's and GLM-OCR's text models) gets sections summing to half the
    shrunk head: the default sums to half the original one."""
    import importlib
    import inspect

    from transformers import CONFIG_MAPPING

    rope = d.get("rope_parameters")
    head_dim = _head_dim(d)
    if not isinstance(rope, dict) or "mrope_section" in rope or head_dim is None:
        return
    try:
        module = importlib.import_module(CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return
    source = inspect.getsource(module)
    found = re.search(r'get\("mrope_section", \[(\d+), (\d+), (\d+)\]\)', source)
    if found:
        rope["mrope_section"] = _split(head_dim // 2, [int(v) for v in found.groups()])


def _drop_derived(d: dict, original_layers: int | None) -> None:
    """Remove what a config derives from its layer count itself (``layer_types``, backbone stages)."""
    for key in [*_UNTOUCHED - {"id2label", "label2id"}, "layer_types"]:
        if key in d and key not in ("transformers_version", "architectures"):
            d.pop(key)
    for value in d.values():
        if isinstance(value, dict) and "model_type" in value:
            _drop_derived(value, None)


def _merge(into: dict, overrides: dict) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


# auto mappings tried in order: the first that maps the type gives its class
TASK_MAPPINGS = (
    ("speech-seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    ("image-text-to-text", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
    ("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("ctc", "MODEL_FOR_CTC_MAPPING_NAMES"),
    ("zero-shot-image-classification", "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("audio-classification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
    ("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ("model", "MODEL_MAPPING_NAMES"),
)


def model_class(model_type: str) -> tuple[str, type]:
    """``(task, class)`` the auto mappings give ``model_type``: a head with a task first, else the
    base model. An encoder with a masked-LM head (BERT-style) takes sequence classification rather
    than its causal-LM head (which needs ``is_decoder``)."""
    import transformers
    from transformers.models.auto import modeling_auto

    masked = modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    for task, mapping_name in TASK_MAPPINGS:
        names = getattr(modeling_auto, mapping_name, {})
        name = names.get(model_type)
        if isinstance(name, (list, tuple)):
            name = name[0]
        if not name:
            continue
        if (
            task == "causal-lm"
            and model_type in masked
            and model_type in (modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
        ):
            continue
        cls = getattr(transformers, name, None)
        if cls is not None:
            return task, cls
    raise KeyError(f"no auto model class for model type {model_type!r}")


def build_tiny(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of ``model_type`` in eval mode: the class of :func:`model_class`, the
    config of :func:`tiny_config`, SDPA attention where the class supports it (else its default)."""
    task, cls = model_class(model_type)
    config = tiny_config(model_type)
    if task == "causal-lm" and _causal_only_as_decoder(cls) and not getattr(config, "is_decoder", False):
        config.is_decoder = True  # as a causal-LM checkpoint of such a class sets it
    torch.manual_seed(seed)
    try:
        model = cls._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    except (ValueError, ImportError) as error:
        if "attention implementation" not in str(error) and "sdpa" not in str(error).lower():
            raise
        torch.manual_seed(seed)
        model = cls._from_config(config)
    _randomize_zero_matrices(model, seed)
    return model.eval()


def _causal_only_as_decoder(cls: type) -> bool:
    """Whether ``cls`` is a BERT-style causal-LM head, which attends both ways unless its config
    sets ``is_decoder`` (transformers warns at its construction: "If you want to use ... as a
    standalone, add `is_decoder=True`")."""
    try:
        source = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False
    return "as a standalone" in source and "is_decoder=True" in source


def _randomize_zero_matrices(model: torch.nn.Module, seed: int) -> None:
    """Draw the weight matrices a model initialises to zero (a router's gate: AFMoE, or a
    zero-initialised projection) at std 0.02: all-zero router scores tie every expert, and torch
    and ONNX Runtime break a top-k tie differently, which a trained checkpoint never shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2 and parameter.is_floating_point() and not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)


def model_kind(model: torch.nn.Module, task: str | None = None) -> str:
    """The sweep's grouping: ``decoder LM``, ``encoder``, ``encoder-decoder``, ``vision``,
    ``audio``, ``multimodal`` or ``SSM / hybrid``."""
    import inspect

    config = model.config
    params = set(inspect.signature(model.forward).parameters)
    text = "input_ids" in params
    vision = bool(params & {"pixel_values", "pixel_values_videos", "flattened_patches"})
    audio = bool(params & {"input_features", "input_values", "audio_values", "input_audio_embeds"})
    flat = _flat_config(config)
    recurrent = any(k in flat for k in ("state_size", "ssm_state_size", "mamba_d_state", "d_state", "rwkv"))
    kinds = " ".join(str(v) for k, v in flat.items() if "layer" in k and isinstance(v, (list, str)))
    if recurrent or any(w in kinds for w in ("mamba", "linear_attention", "recurrent", "conv", "ssm")):
        if text and not vision and not audio:
            return "SSM / hybrid"
    if text and (vision or audio):
        return "multimodal"
    if getattr(config, "is_encoder_decoder", False) and text:
        return "encoder-decoder"
    if audio:
        return "audio"
    if vision:
        return "vision"
    if task in ("causal-lm", "seq2seq-lm") or "past_key_values" in params or "cache" in params:
        return "decoder LM" if not getattr(config, "is_encoder_decoder", False) else "encoder-decoder"
    return "encoder"


def _flat_config(config: Any) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.to_dict().items():
        if isinstance(value, dict) and "model_type" in value:
            flat.update({k: v for k, v in value.items() if k not in flat})
        else:
            flat[key] = value
    return flat
